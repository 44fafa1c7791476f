"""PTQ of mixture-of-experts weights: every expert quantized as its own GEMM matrix, calibrated on the tokens the
router sends to it.

An experts module declares its [E, K, N] weights (``grouped_weights``, `jaxlowfp.rules.grouped_weights`) and
computes each grouped GEMM through the hook it finds at ``quant_<name>``. PTQ uses that hook twice:

- calibration: a recorder sees the rows routed to each expert (``lhs [M, K]`` sorted by expert, ``group_sizes``)
  and reduces them per expert: tokens, max |x|, and for GPTQ the Hessian ``H_e = 2/n_e Σ x x^T`` over expert e's
  rows only;
- evaluation: `RaggedActQuant` quantizes the routed activations at run time through the one op layer
  (`jaxlowfp.ops.ragged_dot`), with each expert's calibrated input amax (``activation_scale="static"``), each
  token's own ("token") or one amax over all routed rows ("tensor").

Weights: RTN, or GPTQ with the expert's own Hessian; an expert's gate and up weights share one NVFP4 global amax
(vLLM merges them and reconciles their global scales). Experts that fewer than ``min_tokens`` calibration tokens
reached (``coverage``) are the MoE failure mode: their weights fall back to RTN and their input amax to the max over
the layer's other experts, with a warning that names them, so no 0, NaN or Inf scale is ever produced. A layer whose
experts no token reached at all is an error under static scaling. SmoothQuant and AWQ fold scales into
``nnx.Linear`` layers: refused.

Calibration follows the PTQ pipeline (`jaxlowfp.ptq.quantize_model`). Sequential (GPTQ's default,
`jaxlowfp.ptq.sequential`): block k's experts are calibrated on block k's inputs from the already quantized blocks
0..k-1 (so the router of block k sends them the tokens it sends in the quantized model), with block k's other
layers still unquantized, and quantized before them. One-pass: one pass over the model before any of its layers
is quantized.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxlowfp import ops, sharding
from jaxlowfp._core.placement import commit_tree
from jaxlowfp._core.reduce import group_ids, segment_amax
from jaxlowfp.ptq.formats import Scheme, rtn_weight
from jaxlowfp.ptq.layers import ActQuantBase
from jaxlowfp.rules import grouped_weights

__all__ = ["ExpertStats", "ExpertResult", "RaggedActQuant", "grouped_weights", "targets", "collect", "check",
           "quantize_experts"]

_HI = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class ExpertStats:
    """Calibration statistics of one expert weight's inputs, per expert: ``tokens`` [E] (rows routed), ``amax`` [E]
    (max |x| of those rows), ``hessian`` [E, K, K] (Σ x x^T, GPTQ only)."""

    tokens: np.ndarray
    amax: np.ndarray
    hessian: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class ExpertResult:
    """What PTQ did to one expert weight: ``tokens`` per expert (the coverage), the experts that fell back
    (``fallback``: fewer than ``min_tokens``: RTN weights, input amax from the other experts), and the input amax per
    expert the run-time quantizer uses (static scaling; None otherwise). For NVFP4 weights, ``packed``: per expert
    the NVFP4 `jaxlowfp.QArray` of ``W_e^T`` [out, in] and its encode scale S_enc (what `jaxlowfp.ptq.export` writes; a
    gate/up pair's S_enc are equal), ``scheme``, the weight's `Scheme`, and ``calib_amax``, per expert the calibration
    input amax with the same fallback whatever the run-time scaling (an export's ``input_global_scale``)."""

    tokens: tuple[int, ...]
    fallback: tuple[int, ...]
    input_amax: tuple[float, ...] | None
    packed: tuple[tuple[Any, Any], ...] = ()
    scheme: Scheme | None = None
    calib_amax: tuple[float, ...] | None = None


class RaggedActQuant(ActQuantBase):
    """The run-time activation quantizer of a PTQ'd expert weight (the module's ``quant_<name>``): its
    ``ragged_dot`` is `jaxlowfp.ops.ragged_dot` quantizing the routed rows only (the weight holds its quantized
    values). `amax`: per expert, for static scaling; default scaling per token. An ``nnx.Module`` owning its
    execution record (`record`), as `jaxlowfp.ptq.ActQuant` (`jaxlowfp.ptq.layers.ActQuantBase`)."""

    _amax_in_state = False  # one amax per expert: in the spec (jaxlowfp.ops.ragged_dot reads it there)

    def __init__(self, fmt: Any, activation_scale: str = "token", amax: tuple[float, ...] | None = None,
                 path: str = "", op_key: str | None = None):
        super().__init__(fmt, activation_scale, amax, path)

    def ragged_dot(self, lhs, rhs, group_sizes, *, precision=None, preferred_element_type=None, key=None):
        shared = "shared" if self.activation_scale == "tensor" else "per_expert"
        return ops.ragged_dot(lhs, rhs, group_sizes, recipe=self.recipe, expert_scales=shared, precision=precision,
                              preferred_element_type=preferred_element_type, where=self.path, record=self.record)[0]


@dataclasses.dataclass(frozen=True, eq=False)
class _Recorder:
    """A ``quant_<name>`` hook that records the routed rows and group sizes into `sink` while tracing."""

    path: str
    sink: dict

    def ragged_dot(self, lhs, rhs, group_sizes, *, precision=None, preferred_element_type=None, key=None):
        self.sink[self.path] = (lhs, group_sizes)
        return lax.ragged_dot(lhs, rhs, group_sizes, precision=precision, preferred_element_type=preferred_element_type)


def targets(model: nnx.Module, rules: Sequence[Any]) -> tuple[dict[str, tuple[nnx.Module, str, Scheme]], list, list,
                                                               set[int], list[str]]:
    """The expert weights `rules` quantize: ({path: (module, weight name, scheme)}, kept [(path, rule regex)],
    unmatched [path], indices of the rules that decided one, the paths quantized before)."""
    out, kept, unmatched, used, before = {}, [], [], set(), []
    from jaxlowfp.packed import PackedParam

    for path, module, name in grouped_weights(model):
        if isinstance(getattr(module, "quant_" + name, None), RaggedActQuant) or isinstance(
                getattr(module, name), PackedParam):
            before.append(path)  # quantized before (a packed weight: jaxlowfp.ptq.pack_model)
            continue
        idx = next((i for i, r in enumerate(rules) if r.matches(path)), None)
        if idx is None:
            unmatched.append(path)
            continue
        used.add(idx)
        if rules[idx].scheme is None:
            kept.append((path, rules[idx].path))
            continue
        w = getattr(module, name)
        if w.ndim != 3:
            raise ValueError(f"{path}: an expert weight must be [E, K, N]; got shape {tuple(w.shape)}")
        rules[idx].scheme.check_layer(int(w.shape[1]), int(w.shape[2]), path)
        out[path] = (module, name, rules[idx].scheme)
    return out, kept, unmatched, used, before


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
def _step(graphdef, state, batch, paths: tuple[str, ...], forward, hessian: bool):
    m = nnx.merge(graphdef, state)
    sink: dict = {}
    where = {p: (mod, name) for p, mod, name in grouped_weights(m)}
    for p in paths:
        mod, name = where[p]
        setattr(mod, "quant_" + name, _Recorder(p, sink))
    forward(m, batch)
    out = {}
    for p in paths:
        if p not in sink:
            raise ValueError(f"calibration: the experts weight {p!r} was not used by the forward pass")
        x, sizes = sink[p]
        x = x.astype(jnp.float32)
        e = sizes.shape[0]
        gid, valid = group_ids(sizes.astype(jnp.int32), x.shape[0])
        onehot = ((gid[:, None] == jnp.arange(e)[None, :]) & valid[:, None]).astype(jnp.float32)  # [M, E]
        st = {"tokens": sizes.astype(jnp.int32), "amax": segment_amax(jnp.max(jnp.abs(x), axis=-1), gid, valid, e)}
        if hessian:
            st["hessian"] = jnp.einsum("me,mk,ml->ekl", onehot, x, x, precision=_HI)
        out[p] = st
    return out


def collect(model: nnx.Module, paths: Sequence[str], batches: Sequence[Any], *, forward: Callable, hessian: bool
            ) -> dict[str, ExpertStats]:
    """`ExpertStats` of the expert weights at `paths` over `batches` (one pass over the model as it is)."""
    graphdef, state = nnx.split(model)
    acc: dict[str, dict] = {}
    for batch in batches:
        state, batch = commit_tree((state, batch))  # one compiled step, as in `jaxlowfp.ptq.calibrate.collect`
        res = jax.device_get(_step(graphdef, state, batch, tuple(paths), forward, hessian))
        for p, st in res.items():
            a = acc.setdefault(p, {"tokens": 0, "amax": None, "hessian": None})
            a["tokens"] = a["tokens"] + np.asarray(st["tokens"], np.int64)
            a["amax"] = st["amax"] if a["amax"] is None else np.maximum(a["amax"], st["amax"])
            if hessian:
                a["hessian"] = st["hessian"] if a["hessian"] is None else a["hessian"] + st["hessian"]
    return {p: ExpertStats(tokens=np.asarray(a["tokens"]), amax=np.asarray(a["amax"], np.float32),
                           hessian=a["hessian"]) for p, a in acc.items()}


def _shared_amax(tg: Mapping[str, tuple[nnx.Module, str, Scheme]]) -> dict[str, np.ndarray]:
    """Per expert, the NVFP4 global amax of a gate/up pair of the same module (max of both), else its own."""
    out = {}
    for path, (mod, name, sch) in tg.items():
        own = np.max(np.abs(np.asarray(getattr(mod, name)[...], np.float32)), axis=(1, 2))
        pair = {"gate_proj": "up_proj", "up_proj": "gate_proj"}.get(name)
        other = path.rsplit("/", 1)[0] + "/" + pair if pair else ""
        if pair and other in tg and sch.weight.kind == "nvfp4" and tg[other][2].weight == sch.weight:
            own = np.maximum(own, np.max(np.abs(np.asarray(getattr(mod, pair)[...], np.float32)), axis=(1, 2)))
        out[path] = own
    return out


def check(tg: Mapping[str, tuple[nnx.Module, str, Scheme]], method: Any) -> None:
    """ValueError unless `method` can quantize the expert weights `tg` (RTN or GPTQ) and they are finite."""
    if method.name not in ("rtn", "gptq"):
        raise ValueError(f"method {method.name!r} folds per-channel scales into nnx.Linear layers; the expert "
                         f"weights {list(tg)[:3]} are grouped GEMMs: quantize them with rtn or gptq (or keep them "
                         f"with scheme=None)")
    from jaxlowfp.ptq.stream import fetch

    for path, (mod, name, _) in tg.items():
        w = fetch(getattr(mod, name)[...])  # no host copy left cached on a sharded weight
        if not np.isfinite(w).all():
            bad = sorted({int(i) for i in np.nonzero(~np.isfinite(w))[0]})
            raise ValueError(f"{path}: experts {bad[:8]} hold NaN/Inf weights; refusing to quantize them")


def quantize_experts(model: nnx.Module, tg: Mapping[str, tuple[nnx.Module, str, Scheme]], method: Any, *,
                     batches: Sequence[Any] | None, forward: Callable, activation_scale: str, min_tokens: int = 1,
                     stats: Mapping[str, ExpertStats] | None = None) -> dict[str, ExpertResult]:
    """Quantize the expert weights `tg` in place (`method`: RTN or GPTQ; module docstring) and install their
    run-time activation quantizers; returns the per-weight `ExpertResult` (coverage and fallbacks). `stats`
    (keyed as `tg`): statistics already collected, instead of a pass of `forward` over `batches`."""
    from jaxlowfp.ptq.gptq import GPTQ, gptq_weight

    if not tg:
        return {}
    gptq = isinstance(method, GPTQ)
    check(tg, method)
    if stats is None:
        stats = collect(model, list(tg), batches, forward=forward, hessian=gptq) if batches is not None else {}
    shared = _shared_amax(tg)
    out = {}
    for path, (mod, name, sch) in tg.items():
        param = getattr(mod, name)
        w = jnp.asarray(param[...], jnp.float32)  # type: ignore[assignment]
        n_exp = int(w.shape[0])
        st = stats.get(path)
        tokens = np.zeros(n_exp, np.int64) if st is None else st.tokens
        low = tuple(int(e) for e in np.nonzero(tokens < min_tokens)[0]) if st is not None else ()
        if low:
            warnings.warn(f"{path}: experts {list(low)} saw fewer than {min_tokens} calibration token(s) "
                          f"(tokens per expert: {tokens.tolist()}): their weights are quantized by RTN and their "
                          f"input scale is the max over the layer's other experts", RuntimeWarning, stacklevel=3)
        new, packed = [], []
        for e in range(n_exp):
            ga = jnp.float32(shared[path][e])
            if gptq and e not in low:
                if st is None or st.hessian is None:
                    raise ValueError(f"{path}[expert {e}]: GPTQ needs the expert's Hessian statistics; collect them "
                                     f"with hessian=True (or pass calibration batches)")
                h = st.hessian[e] * np.float32(2.0 / max(int(tokens[e]), 1))
                qw = gptq_weight(w[e], h, sch.weight, method, where=f"{path}[expert {e}]", global_amax=ga)
            else:
                qw = rtn_weight(w[e], sch.weight, ga if sch.weight.kind == "nvfp4" else None)
            new.append(qw.kernel)
            if qw.packed is not None:
                packed.append((qw.packed, qw.s_enc))
        old = param[...]
        stacked = jnp.stack(new).astype(old.dtype)
        # experts on a mesh (jaxlowfp.sharding.moe_rules) keep their placement, as a dense kernel does
        param.set_value(sharding.shard(stacked, old.sharding) if isinstance(old, jax.Array) else stacked)
        amax = calib = None
        if sch.activation is not None and st is not None:
            calibrated = [float(st.amax[e]) for e in range(n_exp) if e not in low]
            if calibrated:
                fill = max(calibrated)
                calib = tuple(fill if e in low else float(st.amax[e]) for e in range(n_exp))
        if sch.activation is not None:
            if activation_scale == "static":
                if calib is None:
                    raise ValueError(f"{path}: no expert saw a calibration token, so no input scale can be "
                                     f"calibrated; use more calibration data or activation_scale='token'")
                amax = calib
                if not all(np.isfinite(a) and a > 0 for a in amax):
                    raise ValueError(f"{path}: calibrated input amaxes {amax} are not all finite and > 0 "
                                     f"(non-finite activations, or all-zero inputs)")
            hook = RaggedActQuant(sch.activation, activation_scale, amax, path)
            setattr(mod, "quant_" + name, nnx.data(hook))  # a Module holding its record: a graph child
        out[path] = ExpertResult(tokens=tuple(int(t) for t in tokens), fallback=low, input_amax=amax,
                                 packed=tuple(packed), scheme=sch, calib_amax=calib)
    return out
