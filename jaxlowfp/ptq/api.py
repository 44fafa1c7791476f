"""`quantize(model, rules, method=..., calibration=...)`: post-training quantization of the ``nnx.Linear``,
``nnx.LinearGeneral`` and ``nnx.Einsum`` layers of an NNX model, chosen by module-path rules, in place (each
weight quantized as the GEMM matrix of `jaxlowfp.ptq.layers`)."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlowfp import sharding
from jaxlowfp._core.placement import commit_state
from jaxlowfp._core.qarray import QArray
from jaxlowfp._core.deprecation import renamed_kwarg, warn
from jaxlowfp._core.progress import progress_bar
from jaxlowfp.ptq import calibrate, checks, experts, sequential, serving, smooth
from jaxlowfp.ptq.calibration_data import STORAGE_DTYPES, calibration_batches, round_high_precision
from jaxlowfp.rules import grouped_weights
from jaxlowfp.ptq.layers import act_quant, default_hook, hook_name, install, is_act_quant, layout
from jaxlowfp.ptq.formats import ACTIVATION_SCALES, Scheme, rtn_weight
from jaxlowfp.ptq.gptq import GPTQ, gptq_weight
from jaxlowfp.ptq.smooth import AWQ, Fold, SmoothQuant
from jaxlowfp.rules import QuantizeReport, Rule, check_rules, select

METHODS = ("rtn", "gptq", "smoothquant", "awq")
PIPELINES = ("auto", "sequential", "one-pass")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RTN:
    """Round to nearest: each weight quantized once with its own amax; no calibration needed."""

    name = "rtn"


Method = RTN | GPTQ | SmoothQuant | AWQ


def method_from_name(method: str | Method) -> Method:
    """``"rtn" | "gptq" | "smoothquant" | "awq"`` (default settings) or a method object, validated."""
    if isinstance(method, (RTN, GPTQ, SmoothQuant, AWQ)):
        return method
    if isinstance(method, str) and method in METHODS:
        return {"rtn": RTN, "gptq": GPTQ, "smoothquant": SmoothQuant, "awq": AWQ}[method]()
    raise ValueError(f"unknown PTQ method {method!r}; allowed: {', '.join(map(repr, METHODS))} or an RTN, GPTQ, "
                     f"SmoothQuant or AWQ object")


@dataclasses.dataclass(frozen=True)
class PTQResult:
    """What `quantize` did.

    report:   a `jaxlowfp.rules.QuantizeReport` (quantized: (path, scheme name); kept; unmatched; unused_rules)
    method:   the method's name
    schemes:  {path: Scheme} of the quantized layers
    packed:   {path: (NVFP4 QArray of kernel.T [out, in], S_enc float32)} for NVFP4 weights (what `export` writes)
    act_amax: {path: max |input|} over the calibration data (empty without calibration)
    folds:    the folds applied (SmoothQuant / AWQ), and skipped: [(layer, reason)]
    seconds:  wall time, calibration included
    fused:    groups of layers that share one NVFP4 global scale (`jaxlowfp.ptq.serving.fused_groups`)
    arithmetic: "jaxlowfp" or "compressed-tensors", the NVFP4 arithmetic of `packed` (`jaxlowfp.ptq.serving`)
    pipeline: how the statistics were calibrated: "sequential" (block by block, `jaxlowfp.ptq.sequential`),
      "one-pass" (one pass over the unquantized model, or the `stats` given) or "none" (RTN without calibration)
    peak_stats_bytes: the most bytes of calibration statistics (and, sequential, activations) held at once
    activation_scale: how the run-time activations get their amax ("static", "token", "tensor"; see `quantize`),
      None when no layer quantizes activations
    experts:  {expert weight path: `jaxlowfp.ptq.experts.ExpertResult`} (tokens per expert, fallbacks, input amax)
    dtype:    the storage dtype of the high-precision tensors of 2 or more dimensions ("float32", "bfloat16",
      "float16"): they were rounded to it before calibration, so the model evaluated after `quantize` is the model
      `jaxlowfp.ptq.export` writes by default
    """

    report: QuantizeReport
    method: str
    schemes: dict[str, Scheme]
    packed: dict[str, tuple[QArray, jax.Array]]
    act_amax: dict[str, float]
    folds: tuple[Fold, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    seconds: float = 0.0
    fused: tuple[tuple[str, ...], ...] = ()
    arithmetic: str = "jaxlowfp"
    pipeline: str = "one-pass"
    peak_stats_bytes: int = 0
    activation_scale: str | None = None
    experts: dict = dataclasses.field(default_factory=dict)
    dtype: str = "float32"

    @property
    def convention(self) -> str:
        """Deprecated name of :attr:`arithmetic`."""
        warn("PTQResult.convention", "PTQResult.arithmetic")
        return self.arithmetic


def _select(model: nnx.Module, rules: Sequence[Rule]
            ) -> tuple[dict, list, list, Sequence[str], tuple[str, ...], int, int]:
    layers = calibrate.quantizable_modules(model)
    fresh = [p for p, mod in layers.items() if not is_act_quant(getattr(mod, hook_name(mod)))]
    picks, unused = select(rules, fresh)
    decided = dict(zip(fresh, picks))
    targets, kept, unmatched, already = {}, [], [], []
    total = done = 0
    for path, mod in layers.items():
        size = int(np.prod(cast(Any, mod).kernel.shape))  # a LAYER_TYPES module: it has a kernel
        total += size
        hook = getattr(mod, hook_name(mod))
        if is_act_quant(hook):
            already.append(path)
            done += size
            continue
        idx = decided[path]
        if idx is None:
            unmatched.append(path)
            continue
        if rules[idx].scheme is None:
            kept.append((path, rules[idx].path))
            continue
        view = layout(mod, path)
        rules[idx].scheme.check_layer(view.k, view.n, path)
        if hook not in (default_hook(mod), None) or getattr(mod, "dot_general_cls", None) is not None:
            raise ValueError(f"{path}: this {type(mod).__name__} has a custom {hook_name(mod)} ({hook!r}); PTQ would "
                             f"replace it. Exclude it from the rules.")
        targets[path] = rules[idx].scheme
        done += size
    return targets, kept, unmatched, already, unused, total, done


def _snapshot(model: nnx.Module) -> tuple[list, list]:
    """What `quantize` may change, by reference (nothing is copied: arrays are immutable, `set_value` replaces
    them): every Variable's value, and every module's public attributes (the quantizer hooks it sets)."""
    values = [(v, v.get_value()) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)]
    attrs = [(m, {k: a for k, a in vars(m).items() if not k.startswith("_")})
             for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)]
    return values, attrs


def _restore(snapshot: tuple[list, list]) -> None:
    """Put back what `_snapshot` saw: attributes (added ones removed), then every Variable's value."""
    values, attrs = snapshot
    for m, before in attrs:
        for k in [k for k in vars(m) if not k.startswith("_") and k not in before]:
            delattr(m, k)
        for k, a in before.items():
            now = vars(m).get(k, _MISSING)
            if now is not a:
                # a hook module replaced a static function (ptq.layers.install): the attribute is data now, so
                # the function goes back as static, as install swaps it out
                static = isinstance(now, nnx.Module) and not isinstance(a, (nnx.Module, nnx.Variable))
                setattr(m, k, nnx.static(a) if static else a)
    for v, value in values:
        if v.get_value() is not value:
            v.set_value(value)


_MISSING = object()


def quantize(model: nnx.Module, rules: Sequence[Rule] | Rule, **kwargs: Any) -> PTQResult:
    """Transactional: if quantization raises at any point (a refusal in block 5 of sequential GPTQ, an expert's
    overflow, an interrupt), every Variable and quantizer hook of `model` is put back as it was, bit for bit,
    before the error propagates."""
    snapshot = _snapshot(model) if isinstance(model, nnx.Module) else None
    try:
        result = _quantize(model, rules, **kwargs)
    except BaseException:
        if snapshot is not None:
            _restore(snapshot)
        raise
    if isinstance(model, nnx.Module):
        commit_state(model)  # the first jitted call compiles what every later one runs
    return result


def _quantize(
    model: nnx.Module,
    rules: Sequence[Rule] | Rule,
    *,
    method: str | Method = "rtn",
    calibration: Any = None,
    forward: Callable[[nnx.Module, Any], Any] | None = None,
    batch_size: int = 4,
    stats: Mapping[str, calibrate.LayerStats] | None = None,
    progress: bool = False,
    fused: Any = "auto",
    arithmetic: str = "jaxlowfp",
    convention: str | None = None,
    pipeline: str = "auto",
    propagate: str = "quantized",
    activation_scale: str = "auto",
    min_expert_tokens: int = 1,
    dtype: str = "float32",
) -> PTQResult:
    """Post-training quantization of the layers that `rules` select, in place.

    Args:
      model: any ``nnx.Module``; its ``nnx.Linear`` (kernel [in, out]), ``nnx.LinearGeneral`` and ``nnx.Einsum``
        layers are the candidates (the last two as the GEMM matrix of `jaxlowfp.ptq.layers`: blocks along the
        flattened contraction; batched contractions are refused). SmoothQuant / AWQ folds and `export` take
        ``nnx.Linear`` layers.
      rules: `Rule` (path regex -> `Scheme` or None); the first match decides; every Linear is checked before any
        change, so an error leaves the model as it was.
      method: "rtn", "gptq", "smoothquant", "awq" or a configured `RTN` / `GPTQ` / `SmoothQuant` / `AWQ`.
      calibration: token array [n, seq] (split into `batch_size` rows) or an iterable of batches; required by
        GPTQ, SmoothQuant and AWQ; with RTN it only records the activation amax (for export).
      forward: ``forward(model, batch)`` runs the model on a calibration batch (default ``model(batch)``).
      stats: instead of `calibration`, statistics from `jaxlowfp.ptq.collect` on this same unquantized model
        (with ``hessian=True`` for GPTQ, samples for AWQ): one calibration pass shared by many quantize calls.
      fused: layers that share one NVFP4 global scale, as serving engines fuse them (q/k/v, gate/up): "auto"
        (`jaxlowfp.ptq.serving.fused_groups`), None, or a list of path tuples.
      arithmetic: NVFP4 weight arithmetic, "jaxlowfp" or "compressed-tensors" (llm-compressor's RTN; static_6);
        ``convention=`` is its deprecated name.
      pipeline: "sequential" (block by block through the quantized prefix, one block's statistics at a time, a
        mixture-of-experts block's experts included; needs the model's ``ptq_blocks()``,
        `jaxlowfp.ptq.sequential`), "one-pass" (every layer's statistics from one
        pass over the unquantized model), or "auto": sequential for GPTQ, SmoothQuant and AWQ when the model has
        ``ptq_blocks()`` and neither `forward` nor `stats` is given, else one-pass.
      propagate: sequential only: "quantized" (the quantized prefix runs as deployed, activation quantization
        included) or "weights" (activations in high precision while propagating, as llm-compressor does).
      activation_scale: W4A4 / W8A8: where a layer's run-time input amax comes from. "static": the calibrated max
        |input| (what `export` writes as ``input_global_scale`` and vLLM applies); "token": each token's own amax
        (dynamic); "tensor": the whole input's, i.e. the batch's (the Four Over Six paper's setting: a score then
        depends on the other requests in its batch and on padding). "auto" (default): "token". Recorded in
        `PTQResult.activation_scale`. A static amax is compiled into its layer's program, so identical blocks no
        longer share one compiled program (each block compiles its own: slower to compile, same to run).
      min_expert_tokens: mixtures of experts (`jaxlowfp.ptq.experts`): experts whose weight saw fewer calibration
        tokens fall back to RTN weights and the layer's other experts' input amax, with a warning naming them.
      dtype: the storage dtype of the tensors that stay in high precision (2 or more dimensions: embeddings, the
        head, layers no rule quantizes; 1-D ones stay float32), "float32" (default), "bfloat16" or "float16". They
        are rounded to it in place before calibration, so every score of the quantized model describes the model
        `jaxlowfp.ptq.export` writes (its default dtype is this one; `PTQResult.dtype` records it). float32 is the
        default because it changes nothing: a float32 model is quantized and evaluated as it is, and its export
        reloads bit for bit; a smaller file is a choice made here, and then evaluated (llm-compressor likewise
        evaluates a model in the dtype it saves). With `stats`, the statistics were collected before the rounding.

    Afterwards each quantized layer is still the same module: its kernel holds the dequantized quantized weights,
    and, for W4A4 / W8A8 schemes, its ``dot_general`` is an `ActQuant` (an Einsum's ``einsum_op`` an
    `EinsumActQuant`) that fake-quantizes the input at run time.
    """
    t0 = time.perf_counter()
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module; got {type(model).__name__}")
    rules = check_rules(rules, field="scheme", caller="jaxlowfp.ptq.quantize")
    m = method_from_name(method)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(map(repr, STORAGE_DTYPES))}")
    targets, kept, unmatched, already, unused, total, done = _select(model, rules)
    grouped, g_kept, g_unmatched, g_used, g_before = experts.targets(model, rules)
    already = (*already, *g_before)
    if grouped or g_kept:  # rules that decided an expert weight are used
        unused_rules = tuple(r for i, r in enumerate(rules) if r.path in unused and i not in g_used)
        unused = tuple(r.path for r in unused_rules)
    kept, unmatched = [*kept, *g_kept], [*unmatched, *g_unmatched]
    for mod, name, _ in grouped.values():
        size = int(np.prod(getattr(mod, name).shape))
        total, done = total + size, done + size
    total += sum(int(np.prod(getattr(mod, n).shape)) for p, mod, n in grouped_weights(model)
                 if p in g_unmatched or p in dict(g_kept))
    if not targets and not grouped:
        names = list(calibrate.quantizable_modules(model))
        before = f"; quantized before (left alone): {list(already)[:4]}" if already else ""
        raise ValueError(f"no nnx.Linear layer matches a rule with a scheme (nor an nnx.LinearGeneral or "
                         f"nnx.Einsum; rules: {[r.path for r in rules]}); the model's layers: "
                         f"{names[:12]}{' ...' if len(names) > 12 else ''}{before}")
    checks.check_model_weights(model, targets)
    if calibration is not None and stats is not None:
        raise ValueError("pass calibration or stats, not both")
    if calibration is None and stats is None and not isinstance(m, RTN):
        raise ValueError(f"method {m.name!r} needs calibration data (a token array [n, seq] or batches)")
    arithmetic = renamed_kwarg("ptq.quantize_model", "convention", convention, "arithmetic", arithmetic, "jaxlowfp")
    serving.check_convention(arithmetic, m.name, targets)
    act_scale = _activation_scale(activation_scale, calibration is not None or stats is not None)
    expert_results: dict[str, experts.ExpertResult] = {}
    op_keys: dict[str, Any] = {}
    pipe = _pipeline(pipeline, propagate, model, m, forward, calibration, stats)
    batches = None if calibration is None else calibration_batches(calibration, batch_size, forward is None, model)
    round_high_precision(model, dtype, {f"{p}/kernel" for p in targets} | set(grouped))  # after the last refusal
    mods: dict[str, Any] = {"/".join(map(str, p)): x for p, x in nnx.iter_graph(model) if isinstance(x, nnx.Module)}
    expert_hooks: dict[str, Any] = {}
    if grouped and stats is not None and calibration is None:
        raise ValueError(f"the expert weights {list(grouped)[:3]} are calibrated from `calibration` (stats from "
                         f"ptq.collect cover linear layers only)")
    if grouped and pipe == "sequential":  # each block's experts on that block's inputs (jaxlowfp.ptq.experts)
        expert_hooks = _expert_hooks(model, mods, grouped, m, act_scale, min_expert_tokens, expert_results)
    elif grouped:  # one calibration pass over the model as it is, before its linear layers change
        eb = batches
        expert_results = experts.quantize_experts(model, grouped, m, batches=eb,
                                                  forward=forward or calibrate.default_forward,
                                                  activation_scale=act_scale, min_tokens=min_expert_tokens)
        if not targets:
            return dataclasses.replace(
                _result(m, grouped, kept, unmatched, already, unused, done, total, {}, {}, {}, (), (), (), arithmetic,
                        "one-pass" if calibration is not None else "none", 0, act_scale, expert_results, op_keys, t0),
                dtype=dtype)
    groups = serving.fused_groups(model, targets, fused)

    folds: list[Fold] = []
    skipped: list[tuple[str, str]] = []
    if isinstance(m, (SmoothQuant, AWQ)):
        general = [p for p in targets if not isinstance(mods[p], nnx.Linear)]
        if general:
            raise ValueError(f"method {m.name!r} folds per-channel scales into nnx.Linear layers; "
                             f"{', '.join(f'{p} ({type(mods[p]).__name__})' for p in general[:3])} are not: use rtn "
                             f"or gptq for them (or keep them with scheme=None)")
        folds, skipped = _folds(model, mods, m, targets)

    if stats is not None:
        stats = dict(stats)
        need = [p for p in targets if p not in stats or not isinstance(stats[p], calibrate.LayerStats)]
        if need:
            raise ValueError(f"stats has no LayerStats for the layers {need[:4]}")
        if isinstance(m, GPTQ) and any(stats[p].hessian is None for p in targets):
            raise ValueError("GPTQ needs stats collected with hessian=True")
        if (isinstance(m, AWQ) or (isinstance(m, SmoothQuant) and m.alphas is not None)) and any(
                stats[p].samples is None for p in targets):
            raise ValueError(f"{m.name} needs stats collected with samples_per_batch > 0")
    else:
        stats = {}
    packed: dict[str, tuple[QArray, jax.Array]] = {}

    def process(paths: list[str], st: dict[str, calibrate.LayerStats]) -> None:
        """Folds that reach `paths`, then their weights (fused groups: one amax after the folds)."""
        sub = {p: targets[p] for p in paths}
        checks.check_calibration_inputs(st, sub)
        if isinstance(m, (SmoothQuant, AWQ)):
            st = smooth_model(model, m, [f for f in folds if any(p in sub for p in f.layers)], sub, st,
                              progress=progress)
        if isinstance(m, AWQ) and m.clip:  # llm-awq's clipping search, on the inputs as scaled
            for p in sub:
                if not re.fullmatch(m.clip_skip, p):
                    k = mods[p].kernel
                    x_host = cast(jax.Array, st[p].samples)  # host numpy: clip_weight moves it (jnp.asarray)
                    k.set_value(smooth.clip_weight(k[...], x_host, sub[p].weight, clip_grid=m.clip_grid,
                                                   max_shrink=m.max_shrink).astype(k[...].dtype))
        grp = [g for g in groups if any(p in sub for p in g)]
        split = [g for g in grp if not all(p in sub for p in g)]
        if split:
            raise ValueError(f"fused group {split[0]} spans two blocks of the sequential pipeline; pass fused=None "
                             "or pipeline='one-pass'")
        shared = {p: jnp.max(jnp.stack([jnp.max(jnp.abs(mods[x].kernel[...].astype(jnp.float32))) for x in g]))
                  for g in grp for p in g}  # after the folds: the amax of the weights as they are quantized
        _quantize_weights(mods, m, sub, st, shared, arithmetic, packed, progress, act_scale, op_keys)

    samples = 0
    if batches is not None and (isinstance(m, AWQ) or (isinstance(m, SmoothQuant) and m.alphas is not None)):
        samples = max(1, -(-m.samples // len(batches)))
    if pipe == "sequential":
        assert batches is not None  # _pipeline chooses "sequential" for a calibration set only
        blocks = sequential.model_blocks(model, mods)
        for f in folds:
            if len({sequential.owner(p, blocks) for p in (f.prev, *f.layers)}) != 1:
                raise ValueError(f"sequential calibration: {f} folds across blocks; use pipeline='one-pass'")
        act_amax, peak = sequential.run(model, mods, blocks, batches, list(targets), process,
                                        hessian=isinstance(m, GPTQ), samples_per_batch=samples,
                                        propagate=propagate, progress=progress, block_hooks=expert_hooks)
    else:
        if batches is not None:
            stats = calibrate.collect(model, list(targets), batches, forward=forward or calibrate.default_forward,
                                      hessian=isinstance(m, GPTQ), samples_per_batch=samples, progress=progress)
        peak = sequential.stats_bytes(stats)
        act_amax = {p: float(np.max(stats[p].amax)) for p in targets if p in stats}
        process(list(targets), stats)

    return dataclasses.replace(
        _result(m, grouped, kept, unmatched, already, unused, done, total, targets, packed, act_amax, folds, skipped,
                groups, arithmetic, pipe, peak, act_scale, expert_results, op_keys, t0), dtype=dtype)



quantize.__doc__ = f"{quantize.__doc__}\n\n    {_quantize.__doc__}"
quantize.__signature__ = inspect.signature(_quantize)  # type: ignore[attr-defined]

def _result(m: Method, grouped: Mapping[str, Any], kept: Any, unmatched: Any, already: Any, unused: Any, done: int,
            total: int, targets: Mapping[str, Scheme], packed: Any, act_amax: Any, folds: Any, skipped: Any,
            groups: Any, convention: str, pipe: str, peak: int, act_scale: str,
            expert_results: Mapping[str, experts.ExpertResult], op_keys: Mapping[str, Any], t0: float
            ) -> PTQResult:
    """The `PTQResult` of `quantize`, its report included."""
    op_keys = dict(op_keys)
    for p, (mod, name, _) in grouped.items():
        hook = getattr(mod, "quant_" + name, None)  # none for weights-only schemes
        if isinstance(hook, experts.RaggedActQuant):
            op_keys[p] = hook.record
    report = QuantizeReport(
        quantized=tuple((p, s.name) for p, s in targets.items()) + tuple((p, g[2].name) for p, g in grouped.items()),
        kept=tuple(kept), unmatched=tuple(unmatched), already_quantized=tuple(already),
        unused_rules=unused,
        quantized_fraction=float(done / total) if total else 0.0,
        records=tuple((p, op_keys[p]) for p in [*targets, *grouped] if p in op_keys),
    )
    return PTQResult(report=report, method=m.name, schemes=dict(targets), packed=packed, act_amax=act_amax,
                     folds=tuple(folds), skipped=tuple(skipped), seconds=time.perf_counter() - t0,
                     fused=tuple(groups), arithmetic=convention, pipeline=pipe, peak_stats_bytes=peak,
                     experts=dict(expert_results),
                     activation_scale=act_scale if any(s.activation is not None for s in
                                                       [*targets.values(), *(g[2] for g in grouped.values())])
                     else None)


def _expert_hooks(model: nnx.Module, mods: Mapping[str, Any], grouped: Mapping[str, Any], m: Method,
                  act_scale: str, min_tokens: int, results: dict[str, experts.ExpertResult]) -> dict[str, Any]:
    """`jaxlowfp.ptq.sequential.run`'s ``block_hooks`` that calibrate and quantize each block's expert weights on
    that block's inputs (their `ExpertResult` into `results`), checked before any block changes."""
    experts.check(grouped, m)
    blocks = sequential.model_blocks(model, mods)
    outside = [p for p in grouped if sequential.owner(p, blocks) is None]
    if outside:
        raise ValueError(f"sequential calibration: the expert weights {outside[:3]} are outside every block of "
                         f"ptq_blocks(); use pipeline='one-pass'")
    hooks = {}
    for path, _ in blocks.blocks:
        mine = {p: g for p, g in grouped.items() if sequential.owner(p, blocks) == path}
        if mine:
            hooks[path] = functools.partial(_quantize_block_experts, prefix=path + "/", tg=mine, m=m,
                                            act_scale=act_scale, min_tokens=min_tokens, results=results)
    return hooks


def _quantize_block_experts(block: nnx.Module, xs: Any, call: Any, *, prefix: str, tg: Mapping[str, Any], m: Method,
                            act_scale: str, min_tokens: int, results: dict[str, experts.ExpertResult]) -> int:
    """One block's experts from the block's inputs `xs` (`_expert_hooks`); returns the bytes of their statistics."""
    st = experts.collect(block, [p[len(prefix):] for p in tg], xs, forward=call, hessian=isinstance(m, GPTQ))
    stats = {prefix + p: v for p, v in st.items()}
    results.update(experts.quantize_experts(block, tg, m, batches=None, forward=call, activation_scale=act_scale,
                                            min_tokens=min_tokens, stats=stats))
    return sum(x.nbytes for v in stats.values() for x in (v.tokens, v.amax, v.hessian) if x is not None)


def _activation_scale(activation_scale: str, calibrated: bool) -> str:
    """The activation scaling `quantize` applies (see its docstring)."""
    allowed = ("auto", *ACTIVATION_SCALES)
    if activation_scale not in allowed:
        raise ValueError(f"activation_scale={activation_scale!r} is not supported; allowed: "
                         f"{', '.join(map(repr, allowed))}")
    if activation_scale == "static" and not calibrated:
        raise ValueError("activation_scale='static' takes each layer's calibrated input amax: pass calibration "
                         "data (or stats), or use activation_scale='token' (dynamic, per token)")
    if activation_scale == "auto":
        return "token"
    return activation_scale


def _pipeline(pipeline: str, propagate: str, model: nnx.Module, m: Method, forward: Any, calibration: Any,
              stats: Any) -> str:
    """The calibration pipeline that runs (see `quantize`)."""
    if propagate not in sequential.PROPAGATE:
        raise ValueError(f"propagate={propagate!r} is not supported; allowed: "
                         f"{', '.join(map(repr, sequential.PROPAGATE))}")
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline={pipeline!r} is not supported; allowed: {', '.join(map(repr, PIPELINES))}")
    if calibration is None and stats is None:
        return "none"
    if pipeline == "auto":
        seq = (not isinstance(m, RTN) and stats is None and forward is None
               and callable(getattr(model, "ptq_blocks", None)))
        return "sequential" if seq else "one-pass"
    if pipeline == "sequential":
        if not callable(getattr(model, "ptq_blocks", None)):
            raise ValueError(f"pipeline='sequential': a {type(model).__name__} does not say its block structure (it "
                             "has no ptq_blocks() method); use pipeline='one-pass'")
        if stats is not None:
            raise ValueError("pipeline='sequential' calibrates block by block from `calibration`; `stats` (from one "
                             "pass over the unquantized model) needs pipeline='one-pass'")
        if forward is not None:
            raise ValueError("pipeline='sequential' runs the model's ptq_blocks(); `forward` is for the one-pass "
                             "pipeline")
    return pipeline


def _quantize_weights(mods: Mapping[str, Any], m: Method, targets: Mapping[str, Scheme],
                      stats: Mapping[str, calibrate.LayerStats], shared: Mapping[str, jax.Array], convention: str,
                      packed: dict, progress: bool, act_scale: str, op_keys: dict[str, Any]) -> None:
    """Quantize the kernels of `targets` in place (GPTQ with their Hessians, else RTN); NVFP4 arrays into `packed`;
    W4A4 / W8A8 layers get their run-time activation quantizer."""
    for path in progress_bar(list(targets), desc=f"{m.name} weights", enabled=progress):
        mod, sch = mods[path], targets[path]
        view = layout(mod, path)
        kernel = view.to_matrix(mod.kernel[...])  # [K, N]
        if isinstance(m, GPTQ):  # factorized on the host (float64); the column loop where the kernel lives
            hessian = cast(jax.Array, stats[path].gptq_hessian())  # host numpy, which gptq_weight reads as such
            qw = gptq_weight(kernel, hessian, sch.weight, m, where=path, global_amax=shared.get(path))
        elif convention == "compressed-tensors":
            qw = serving.ct_weight(kernel, sch.weight, shared.get(path))
        else:
            qw = rtn_weight(kernel, sch.weight, shared.get(path))
        old = mod.kernel[...]
        new = view.from_matrix(qw.kernel).astype(old.dtype)
        # a kernel on a mesh (jaxlowfp.sharding) keeps its placement: the quantized values go back into its shards
        # (`sharding.shard`: across processes, each builds its own shards of the value every process computed)
        mod.kernel.set_value(sharding.shard(new, old.sharding) if isinstance(old, jax.Array) else new)
        if qw.packed is not None:
            packed[path] = (qw.packed, qw.s_enc)
        if sch.activation is not None:
            amax = float(np.max(stats[path].amax)) if act_scale == "static" else None
            if amax is not None and not (np.isfinite(amax) and amax > 0):
                raise ValueError(f"{path}: activation_scale='static' needs a finite, positive calibrated input "
                                 f"amax; calibration gave {amax} (no calibration token reached the layer, or its "
                                 f"input is non-finite). Use activation_scale='token'")
            hook = act_quant(mod, sch.activation, activation_scale=act_scale, amax=amax, path=path)
            install(mod, hook)
            op_keys[path] = hook.record


def _folds(model: nnx.Module, mods: dict, m: SmoothQuant | AWQ, targets: Mapping[str, Scheme]
           ) -> tuple[list[Fold], list[tuple[str, str]]]:
    """The method's folds (default: the model's ``smoothing_folds()``) that reach a quantized layer, checked; and the
    skipped layers."""
    if m.folds is None:
        own = getattr(model, "smoothing_folds", None)
        if not callable(own):
            raise ValueError(f"method {m.name!r}: a {type(model).__name__} does not say which op precedes which "
                             "projections (it has no smoothing_folds() method); pass folds=[Fold(prev=..., "
                             "layers=(...))]")
        pairs, skipped = own()
        folds = [smooth.Fold(prev=prev, layers=tuple(layers)) for prev, layers in pairs]
    else:
        folds, skipped = list(m.folds), []
    folds = [f for f in folds if any(p in targets for p in f.layers)]
    for f in folds:
        smooth.check_fold(mods, f)
    if not folds:
        raise ValueError(f"method {m.name!r}: no fold reaches a quantized layer (folds={m.folds!r}); pass "
                         f"folds=[Fold(prev=..., layers=(...))] for this model")
    return folds, [(p, why) for p, why in skipped if p in targets]


def smooth_model(model: nnx.Module, method: SmoothQuant | AWQ, folds: Sequence[Fold], schemes: Mapping[str, Scheme],
                 stats: Mapping[str, calibrate.LayerStats], *, progress: bool = False
                 ) -> dict[str, calibrate.LayerStats]:
    """Apply SmoothQuant or AWQ scales to `folds` in place (no quantization: the model computes the same function
    up to float32 rounding). AWQ's search uses `schemes[layer]` of the fold's first quantized layer. Returns the
    statistics of the layers' new inputs (X / s)."""
    mods: dict[str, Any] = {"/".join(map(str, p)): x for p, x in nnx.iter_graph(model) if isinstance(x, nnx.Module)}
    stats = dict(stats)
    for f in progress_bar(list(folds), desc=f"{method.name} scales", enabled=progress):
        first = next(p for p in f.layers if p in schemes)
        st = stats[first]
        kernels = tuple(mods[p].kernel[...] for p in f.layers)
        if isinstance(method, SmoothQuant) and method.alphas is None:
            s = smooth.smoothquant_scales(st.amax, kernels, method.alpha)
        else:
            if st.samples is None:
                raise ValueError(f"{method.name} needs calibration samples of {first}")
            if isinstance(method, SmoothQuant):  # the small alpha search
                cands = np.stack([smooth.smoothquant_scales(st.amax, kernels, a) for a in method.alphas or ()])
            else:
                w_mean = smooth.awq_w_mean(kernels, schemes[first].weight.group)
                cands = smooth.awq_candidates(st.abs_mean, w_mean, method.grid_params())
            # host numpy samples and candidates: awq_losses moves them (jnp.asarray)
            losses = np.asarray(smooth.awq_losses(cast(jax.Array, st.samples), kernels, cast(jax.Array, cands),
                                                  scheme=schemes[first]))
            if not np.isfinite(losses).any():
                raise ValueError(f"{method.name}: no finite loss for the fold into {f.prev} (non-finite activations?)")
            s = cands[int(np.nanargmin(np.where(np.isfinite(losses), losses, np.nan)))]
        smooth.apply_fold(mods, f, s)
        for p in f.layers:  # the layers' inputs are now X / s
            if p in stats:
                stats[p] = dataclasses.replace(stats[p], amax=stats[p].amax / s, abs_sum=stats[p].abs_sum / s,
                                               samples=None if stats[p].samples is None else stats[p].samples / s)
    return stats


