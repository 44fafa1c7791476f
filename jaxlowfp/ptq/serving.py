"""What serving engines assume about NVFP4 weights: fused projection groups that share one global scale, and the
arithmetic convention the weights are quantized and decoded in.

**Fused groups.** vLLM runs q/k/v as one ``qkv_proj`` GEMM and gate/up as one ``gate_up_proj``
(``packed_modules_mapping`` of its Llama model). Its compressed-tensors NVFP4 scheme
(``compressed_tensors_w4a4_nvfp4.py: process_weights_after_loading``) keeps every shard's E4M3 block scales and
decodes the fused weight with the group's largest encode scale, ``max(g_q, g_k, g_v)``, logging a warning only; a
shard whose own ``g`` is smaller is then decoded too small by ``g / max``. llm-compressor therefore gives each group
one global scale (``modifiers/utils/helpers.py: update_fused_layer_weight_global_scales``: the minimum encode scale,
i.e. the group's largest amax). `quantize` does the same before any block is quantized: each member is quantized
with ``global_amax`` = the group's amax, so every block scale (and every Four Over Six choice, which depends on the
global scale through ``S_enc``) is made under the shared scale, not rescaled afterwards.

Groups (`fused_groups`): the model's ``smoothing_folds()`` entries whose projections read the same normed input
(``attn_norm -> q/k/v``, ``mlp_norm -> gate/up``, which is exactly what vLLM fuses), else sibling modules named
``q_proj, k_proj, v_proj`` and ``gate_proj, up_proj`` (vLLM's names).

**Arithmetics** (``arithmetic=``): ``"jaxlowfp"`` quantizes ``q = E2M1(x * (1 / (s * (1 / g))))`` and decodes
``(q * s) * (1 / g)`` (`jaxlowfp.nvfp4`); ``"compressed-tensors"`` quantizes ``q = E2M1(x / (s / g))`` with
``g = (1 / amax) * 2688`` and decodes ``q * (s / g)`` (llm-compressor's order, `jaxlowfp._core.ct_nvfp4`), static_6
round to nearest only. The codes differ in a handful of ties (about 1e-4 of them on SmolLM2-135M), the decodings in
the last bit of about a quarter of the weights; neither is wrong, and the checkpoint records which one was used.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlowfp import formats, nvfp4
from jaxlowfp._core import ct_nvfp4
from jaxlowfp._core.nvfp4_blocks import pack_nibbles
from jaxlowfp._core.format import Format
from jaxlowfp._core.qarray import QArray
from jaxlowfp.ptq.formats import QuantizedWeight, Scheme

CONVENTIONS = ("jaxlowfp", "compressed-tensors")
FUSED_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def check_convention(convention: str, method: str, schemes: Mapping[str, Scheme]) -> str:
    """The compressed-tensors convention exists for RTN static_6 with 1x16 blocks (what llm-compressor does)."""
    if convention not in CONVENTIONS:
        raise ValueError(f"arithmetic={convention!r} is not supported; allowed: {', '.join(map(repr, CONVENTIONS))}")
    if convention == "compressed-tensors":
        bad = sorted({s.weight.name for s in schemes.values()
                      if s.weight.kind != "nvfp4" or s.weight.rule != "static_6" or s.weight.rows != 1})
        if method != "rtn" or bad:
            raise ValueError(f"arithmetic='compressed-tensors' reproduces llm-compressor's RTN NVFP4 (static_6, 1x16 "
                             f"blocks); got method {method!r} and weight formats {bad or 'nvfp4-static_6'}")
    return convention


def name_groups(paths: Sequence[str]) -> list[tuple[str, ...]]:
    """Sibling paths named like vLLM's fused shards (``.../q_proj``, ``.../k_proj``, ``.../v_proj``; ``gate_proj``,
    ``up_proj``), each group in that order; groups with fewer than two members present are dropped."""
    have = set(paths)
    parents = sorted({p.rsplit("/", 1)[0] if "/" in p else "" for p in paths})
    out = []
    for parent in parents:
        for names in FUSED_NAMES:
            members = tuple(f"{parent}/{n}" if parent else n for n in names)
            present = tuple(m for m in members if m in have)
            if len(present) > 1:
                out.append(present)
    return out


def fused_groups(model: nnx.Module, targets: Mapping[str, Scheme], fused: Any = "auto") -> list[tuple[str, ...]]:
    """The groups of quantized layers that must share one NVFP4 global scale (module docstring).

    `fused`: "auto" (the model's ``fused_groups()``, else its ``smoothing_folds()`` groups fed by a norm, else
    vLLM's sibling names), None or
    () (no sharing), or a sequence of path tuples. Members of one group must have the same NVFP4 weight format.
    """
    nv = [p for p, s in targets.items() if s.weight.kind == "nvfp4"]
    if fused is None or (isinstance(fused, (tuple, list)) and len(fused) == 0):
        return []
    if isinstance(fused, str):
        if fused != "auto":
            raise ValueError(f"fused={fused!r} is not supported; allowed: 'auto', None or a list of path tuples")
        groups = None
        own = getattr(model, "smoothing_folds", None)
        said = getattr(model, "fused_groups", None)  # the export protocol (jaxlowfp.ptq.protocol)
        if callable(said):
            groups = [tuple(x for x in g if x in nv) for g in said()]
            groups = [g for g in groups if len(g) > 1]
        elif callable(own):
            linears = {"/".join(map(str, p)) for p, m in nnx.iter_graph(model) if isinstance(m, nnx.Linear)}
            groups = [tuple(x for x in layers if x in nv) for prev, layers in own()[0]
                      if prev not in linears and len(layers) > 1]
            groups = [g for g in groups if len(g) > 1]
        if groups is None:
            groups = name_groups(nv)
    else:
        groups = [tuple(g) for g in fused]
        for g in groups:
            missing = [p for p in g if p not in nv]
            if missing:
                raise ValueError(f"fused group {g}: {missing} are not layers quantized to NVFP4 by these rules")
    seen: dict[str, tuple[str, ...]] = {}
    for g in groups:
        fmts = {targets[p].weight for p in g}
        if len(fmts) > 1:
            raise ValueError(f"fused group {g} mixes NVFP4 weight formats {sorted(f.name for f in fmts)}; a serving "
                             f"engine runs the group as one GEMM with one format: use one scheme for all of them, or "
                             f"fused=None")
        for p in g:
            if p in seen:
                raise ValueError(f"{p} is in two fused groups: {seen[p]} and {g}")
            seen[p] = g
    return groups


def ct_weight(kernel: jax.Array, fmt: Format, global_amax: jax.Array | None = None) -> QuantizedWeight:
    """RTN NVFP4 (static_6) of a kernel [in, out] in compressed-tensors' arithmetic (module docstring); the
    returned kernel is ``q * (s / g)``, `packed` holds the codes and E4M3 scales, ``s_enc = g``."""
    return QuantizedWeight(*_ct_rtn(jnp.asarray(kernel, jnp.float32),
                                    None if global_amax is None else jnp.asarray(global_amax, jnp.float32),
                                    fmt=fmt))


@functools.partial(jax.jit, static_argnames=("fmt",))
def _ct_rtn(kernel, global_amax, *, fmt):
    wt = kernel.T
    amax = jnp.max(jnp.abs(wt)) if global_amax is None else global_amax
    g = ct_nvfp4.global_scale(amax)
    q, s = ct_nvfp4.quantize_tensor(wt, g)
    codes = pack_nibbles(formats.E2M1.encode(q))
    arr = QArray(codes=codes, scales=s.astype(jnp.float8_e4m3fn), global_scale=1.0 / g, format=fmt,
                 dtype=jnp.dtype(jnp.float32), shape=wt.shape)
    return decode(arr, g, "compressed-tensors").T, arr, g


def decode(arr: QArray, s_enc: jax.Array, convention: str) -> jax.Array:
    """The float32 weight [out, in] a packed NVFP4 array stands for in `convention`: ``(q * s) * (1 / g)`` or
    ``q * (s / g)`` (g = `s_enc`)."""
    if convention == "jaxlowfp":
        return arr.dequantize(jnp.float32)
    q = formats.E2M1.decode(nvfp4.unpack_nibbles(arr.codes))
    out, k = q.shape
    s = arr.scales.astype(jnp.float32)  # type: ignore[union-attr]
    if arr.format.rows > 1:
        s = jnp.repeat(s, arr.format.rows, axis=-2)
    return ct_nvfp4.dequantize(q.reshape(out, k // 16, 16), s, jnp.asarray(s_enc, jnp.float32)).reshape(out, k)


def vllm_fused_error(groups: Sequence[tuple[str, ...]], s_enc: Mapping[str, float]) -> list[str]:
    """Groups whose members' encode scales differ (what vLLM would decode wrongly), as messages."""
    out = []
    for g in groups:
        vals = [float(s_enc[p]) for p in g]
        if len(set(vals)) > 1:
            top = max(vals)
            out.append(f"{g}: global scales {vals} (vLLM decodes every member with {top}: own/max down to "
                       f"{min(vals) / top:.3f})")
    return out

