"""The scaled quantizer: one tensor quantize-dequantized with its scale state and a straight-through gradient.

    amax  = max |x|                                  (NaN-propagating)
    est   = spec.scaling.amax_estimate(state, amax)  (delayed: from earlier steps; current: amax)
    scale = est / target_max                         (1 when est is 0, NaN or Inf)
    y     = fmt.round(clip(x * (1 / scale), +-c)) * scale     c = target_max ("target") or fmt.max_finite ("format")
    y     = where(isfinite(x), y, x)                 (NaN/Inf elements pass through unchanged, every format)
    dy/dx = 1  (ste="identity")   or   [|x / scale| <= c]  (ste="masked")
    state' = spec.scaling.update(state, amax)

Conventions "te" and "flax" of :class:`~jaxlowfp.scaling.DelayedScaling` round ``x * (target_max / est)`` and
``x / scale`` instead of ``x * (1 / scale)``, as Transformer Engine and Flax's ``fp8_ops`` do.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, cast

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxlowfp import dispatch, formats, if4, mx, nvfp4
from jaxlowfp._core.bits import ieee_div
from jaxlowfp._core.checks import bool_flag, float_input, number
from jaxlowfp._core.nvfp4_blocks import global_scales
from jaxlowfp._core.reduce import abs_max
from jaxlowfp._core.scaled import saturation_bound, scaled_round_mask
from jaxlowfp.qat.spec import KERNELS, MX_ELEMENTS, QuantSpec, QuantStats, check_size, convention, two_level
from jaxlowfp.scaling import AmaxHistory, CurrentScaling, DelayedScaling

T = TypeVar("T")


def scaled_round(
    x: ArrayLike, scale: ArrayLike, clip: float, fmt: formats.ElementFormat | str, *, bound: ArrayLike | None = None
) -> tuple[jax.Array, jax.Array]:
    """Scaled quantize-dequantize, in float32 (the exact form the Pallas kernel twins)::

        inv = 1 / scale;  xs = f32(x) * inv;  y = dtype_x(fmt.round(clip(xs, -clip, clip)) * scale)

    Returns ``(y, saturated_count)`` with ``saturated_count = #{|f32(x)| > bound}`` (int32; +-Inf counts, NaN
    not); `bound` defaults to ``clip * scale`` (see :func:`saturation_bound`). `scale` is a positive finite float32
    scalar, `clip` a static number in (0, fmt.max_finite]. This is the kernel's twin: a NaN stays NaN but an Inf
    is clipped like any large value (the QAT ops then pass non-finite elements through; :func:`fake_quant`).
    """
    fmt = formats.get(fmt)
    x = float_input(x, "x")
    check_size(x.shape, "x")
    clip = number(clip, "clip", lo=0.0, hi=fmt.max_finite, lo_open=True,
                  allowed=f"a static number in (0, {fmt.max_finite}], the range of {fmt.name}")
    scale = jnp.asarray(jnp.float32(scale) if isinstance(scale, float) else scale)
    if scale.dtype != jnp.float32 or scale.shape != ():
        raise TypeError(f"scale must be a float32 scalar; got dtype {scale.dtype} and shape {scale.shape}")
    bound = saturation_bound(scale, clip) if bound is None else jnp.asarray(bound, jnp.float32)
    y, sat = scaled_round_mask(x, scale, clip, fmt, bound)
    return y, jnp.sum(sat, dtype=jnp.int32)


def select(observe: bool | jax.Array, hp: jax.Array, q: jax.Array) -> jax.Array:
    """`hp` where observing (the warmup), else `q`; bitwise, with no arithmetic on either."""
    if isinstance(observe, bool):
        return hp if observe else q
    return jnp.where(observe, hp, q)


def nvfp4_fake_quant(x: jax.Array, spec: QuantSpec, global_amax: jax.Array | None, key: jax.Array | None,
                    axis: int = -1) -> jax.Array:
    """NVFP4 (or IF4) fake-quant of `x` with blocks along `axis` (moved last for :func:`jaxlowfp.nvfp4.fake_quantize`
    / :func:`jaxlowfp.if4.fake_quantize`)."""
    xt = jnp.moveaxis(x, axis, -1)
    k = key if spec.rounding != "nearest" else None
    rule, block = two_level(spec)
    if spec.format == "if4":
        yt = if4.fake_quantize(xt, rule=cast(if4.IFRule, rule), block_shape=block,
                               global_amax=global_amax, rounding=spec.rounding, key=k)
    else:
        yt = nvfp4.fake_quantize(xt, rule=rule, block_shape=block, global_amax=global_amax,
                                 rounding=spec.rounding, key=k, impl=spec.impl, pallas_backend=spec.pallas_backend)
    return jnp.moveaxis(yt.astype(x.dtype), -1, axis)


def need_key(spec: QuantSpec, key: jax.Array | None, what: str) -> None:
    if spec.rounding != "nearest" and key is None:
        raise ValueError(f"{what} uses rounding={spec.rounding!r} and needs a PRNG key; pass key=jax.random.key(...)")


class _Quantized(NamedTuple):
    y: jax.Array  # forward value: x when observing, else the fake-quantized x (no gradient attached)
    keep: jax.Array | None  # masked STE: where the gradient passes; None for the identity STE
    state: AmaxHistory
    stats: QuantStats
    estimate: jax.Array


class Rounded(NamedTuple):
    y: jax.Array  # the fake-quantized value, non-finite inputs passed through
    sat: jax.Array | None  # bool, where the value was clipped (None: nothing can be, NVFP4 with current scaling)
    scale: jax.Array  # f32[] dequant multiplier (NVFP4: the per-tensor decode scale)
    counts: Any  # the fused kernel's result (amax, saturated and underflow counts), else None


def per_token(spec: QuantSpec) -> bool:
    """Whether `spec` takes one amax per vector along the contraction axis (``CurrentScaling(granularity="token")``)."""
    return getattr(spec.scaling, "granularity", "tensor") == "token"


def fixed_estimate(spec: QuantSpec) -> bool:
    """Whether the amax estimate is given to the quantizer (delayed or static scaling) rather than taken from the
    tensor itself (current scaling): NVFP4 / IF4 then use it as their global amax."""
    return not isinstance(spec.scaling, CurrentScaling)


def fused_kernel(spec: QuantSpec, x: jax.Array) -> bool:
    """Whether `x` goes through the fused Pallas HiF8 kernel (one pass: value, amax and counters)."""
    return spec.format == "hif8" and convention(spec) == "default" and not per_token(spec) and dispatch.resolve_impl(
        spec.impl, kernel=KERNELS["hif8"], pallas_backend=spec.pallas_backend,
        config={"dtype": str(x.dtype)}) == "pallas"


@functools.partial(jax.jit, static_argnames=("spec", "axis"))
def round_with(xs: jax.Array, spec: QuantSpec, est: jax.Array, key: jax.Array | None, axis: int = -1) -> Rounded:
    """Fake-quantize `xs` (no gradient) with the amax estimate `est`: a pure function of its arguments, so the
    backward pass of a matmul recomputes exactly the forward's operands from high precision. Jitted (one program
    per shape and spec, inlined into a caller's jit), as :func:`quantize`.

    Non-finite elements of `xs` come out unchanged (``y = where(isfinite(x), y_q, x)``, every format and path).
    """
    if spec.is_mx:  # E8M0 block scales from each block of 32; no tensor scale
        yq = jnp.moveaxis(mx.fake_quantize(jnp.moveaxis(xs, axis, -1), format=MX_ELEMENTS[spec.format]), -1, axis)  # type: ignore[arg-type]
        sat, scale, counts = None, jnp.float32(1.0), None
    elif spec.is_nvfp4:
        delayed = fixed_estimate(spec)
        yq = nvfp4_fake_quant(xs, spec, est if delayed else None, key, axis)
        sat = (jnp.abs(xs).astype(jnp.float32) > est) if delayed else None  # exact upcast: strict promotion
        gs = if4.global_scales(est, "if4", spec.rounding) if spec.format == "if4" else global_scales(
            est, two_level(spec)[0], spec.rounding)
        scale, counts = gs[1], None  # S_dec = 1 / S_enc
    else:
        sc, conv, c = spec.scaling, convention(spec), spec.clip_bound
        scale = sc.scale(est)
        if conv == "default":
            bound = saturation_bound(scale, c, est if spec.clip == "target" else None)
            if fused_kernel(spec, xs):  # the kernel stays as it is; the non-finite policy is applied after it
                counts = dispatch.kernel(KERNELS["hif8"], spec.pallas_backend)(xs, scale, c, bound=bound)
                yq = counts.y
                sat = jnp.abs(xs.astype(jnp.float32)) > bound
            else:
                yq, sat = scaled_round_mask(xs, scale, c, spec.element_format, bound)
                counts = None
        else:  # TE multiplies by its quantization scale, Flax divides by the dequant scale (IEEE division: XLA
            xf = xs.astype(jnp.float32)  # may turn a plain `/` by a scalar into a reciprocal multiply)
            t = xf * cast(DelayedScaling, sc).multiplier(est) if conv == "te" else ieee_div(xf, scale)
            yq = (spec.element_format.round(jnp.clip(t, -c, c)) * scale).astype(xs.dtype)
            sat, counts = jnp.abs(t) > c, None
    return Rounded(jnp.where(jnp.isfinite(xs), yq, xs), sat, scale, counts)


def quantize(x: jax.Array, state: AmaxHistory, spec: QuantSpec, observe: bool | jax.Array,
              key: jax.Array | None, axis: int = -1) -> _Quantized:
    """Quantize `x` (no gradient): value, STE mask, new state and stats. NVFP4 blocks run along `axis`.

    One jitted program per shape and spec (`observe` static when a Python bool): called eagerly (Qwix's example
    call, a notebook) it compiles once, not once per each of its ~50 operations; inside a jit it is inlined."""
    if x.size == 0:
        raise ValueError(f"cannot quantize an empty array (shape {x.shape})")
    check_size(x.shape, "the quantized tensor")
    run = _quantize_static if isinstance(observe, bool) else _quantize_traced
    return run(x, state, spec, observe, key, axis)


def _quantize(x: jax.Array, state: AmaxHistory, spec: QuantSpec, observe: bool | jax.Array,
              key: jax.Array | None, axis: int) -> _Quantized:
    if per_token(spec):
        return _quantize_per_token(x, state, spec, observe, key, axis)
    xs = lax.stop_gradient(x)
    fused = fused_kernel(spec, x)
    if fused and isinstance(spec.scaling, DelayedScaling):
        # The kernel returns amax from its own pass; a delayed estimate needs this step's amax only while the
        # history is empty (its fallback), so the separate reduction runs only then.
        amax = lax.cond(state.count > 0, lambda: jnp.zeros((), jnp.float32),
                        lambda: abs_max(xs).astype(jnp.float32))
    else:
        amax = abs_max(xs).astype(jnp.float32)
    est = spec.scaling.amax_estimate(state, amax)
    if spec.is_nvfp4:
        need_key(spec, key, "QuantSpec(format='nvfp4')")
    r = round_with(xs, spec, est, key, axis)
    if r.counts is not None:
        amax, n_sat, n_under = r.counts.amax, r.counts.saturated_count, r.counts.underflow_count
    else:
        n_sat, n_under = sat_count(r.sat), underflow_count(xs, r.y)
    new_state = spec.scaling.update(state, amax)
    stats = tensor_stats(xs, amax, est, r.scale, n_sat, n_under)
    keep = None  # identity STE, or masked but observing (nothing was clipped)
    if spec.ste == "masked" and observe is not True:
        keep = keep_mask(r.sat, observe, xs.shape)
    return _Quantized(select(observe, xs, r.y), keep, new_state, stats, est)


_quantize_static = jax.jit(_quantize, static_argnames=("spec", "observe", "axis"))
_quantize_traced = jax.jit(_quantize, static_argnames=("spec", "axis"))


def sat_count(sat: jax.Array | None) -> jax.Array:
    """int32 number of clipped elements (0 when nothing can clip)."""
    return jnp.zeros((), jnp.int32) if sat is None else jnp.sum(sat, dtype=jnp.int32)


def underflow_count(xs: jax.Array, y: jax.Array) -> jax.Array:
    """int32 number of nonzero elements that quantized to 0."""
    return jnp.sum((xs != 0) & (y == 0), dtype=jnp.int32)


def tensor_stats(xs: jax.Array, amax: jax.Array, est: jax.Array, scale: jax.Array, n_sat: jax.Array,
                 n_under: jax.Array) -> QuantStats:
    """The `QuantStats` of one quantized tensor `xs` (fractions of its elements)."""
    n = float(xs.size)
    return QuantStats(amax=amax, amax_estimate=est, scale=scale, saturated_fraction=n_sat.astype(jnp.float32) / n,
                      underflow_fraction=n_under.astype(jnp.float32) / n,
                      nonfinite_count=jnp.sum(~jnp.isfinite(xs), dtype=jnp.int32))


def _quantize_per_token(x: jax.Array, state: AmaxHistory, spec: QuantSpec, observe: bool | jax.Array,
                        key: Any, axis: int) -> _Quantized:
    """`quantize` with one amax per vector along `axis` (``CurrentScaling(granularity="token")``): each vector is
    quantized exactly as it would be alone (a ``vmap`` of the per-tensor quantizer over the vectors), so no other
    row of the batch, and no padding, reaches its scale. The stats and the state take the max over the vectors."""
    xs = lax.stop_gradient(x)
    xt = jnp.moveaxis(xs, axis, -1)
    rows = xt.reshape(-1, xt.shape[-1])
    amax_rows = abs_max(rows, axis=-1).astype(jnp.float32)
    if spec.is_nvfp4:
        need_key(spec, key, f"QuantSpec(format={spec.format!r})")
    if key is None or spec.rounding == "nearest":
        r = jax.vmap(lambda v, a: round_with(v, spec, a, None, -1))(rows, amax_rows)
    else:
        r = jax.vmap(lambda v, a, k: round_with(v, spec, a, k, -1))(rows, amax_rows,
                                                                    jax.random.split(key, rows.shape[0]))
    y = jnp.moveaxis(r.y.reshape(xt.shape), -1, axis)
    sat = None if r.sat is None else jnp.moveaxis(r.sat.reshape(xt.shape), -1, axis)
    amax = abs_max(amax_rows)
    stats = tensor_stats(xs, amax, amax, jnp.max(r.scale), sat_count(sat), underflow_count(xs, y))
    keep = keep_mask(sat, observe, xs.shape) if spec.ste == "masked" and observe is not True else None
    return _Quantized(select(observe, xs, y), keep, spec.scaling.update(state, amax), stats, amax)


def keep_mask(sat: jax.Array | None, observe: bool | jax.Array, shape: tuple) -> jax.Array:
    """Where the masked STE lets the gradient pass: not clipped, or observing."""
    keep = jnp.ones(shape, jnp.bool_) if sat is None else ~sat
    return keep if observe is False else jnp.logical_or(observe, keep)


@jax.custom_vjp
def straight_through(x: jax.Array, y: jax.Array, keep: jax.Array | None) -> jax.Array:
    """Value `y`; gradient w.r.t. `x`: the cotangent itself (identity STE, ``keep`` None) or the cotangent where
    ``keep`` and 0 elsewhere (masked STE); no gradient reaches `y` or `keep`. A ``jax.custom_vjp``: reverse mode
    (``grad``, ``vjp``) only: call it through :func:`reverse_mode_only`, whose error under ``jax.jvp`` says so."""
    return y


def _st_fwd(x, y, keep):
    return y, keep


def _st_bwd(keep, g):
    return (g if keep is None else jnp.where(keep, g, jnp.zeros((), g.dtype))), None, None


straight_through.defvjp(_st_fwd, _st_bwd)


def reverse_mode_only(fn: Callable[..., T], *args: Any, where: str, what: str) -> T:
    """``fn(*args)`` for a ``jax.custom_vjp`` `fn` (a straight-through estimator), with JAX's forward-mode error
    ("can't apply forward-mode autodiff (jvp) to a custom_vjp function") replaced by one that names the op
    (`where`), what it quantizes (`what`, e.g. the recipe) and the way out. Caught where `fn` is called, i.e. under
    an eager ``jax.jvp(f, ...)``; inside ``jax.jit`` JAX defers the error to lowering, after the call returned, and
    keeps its own message (its traceback's "preceding stack trace" still points at this call)."""
    try:
        return fn(*args)
    except TypeError as e:
        if "forward-mode autodiff" not in str(e):
            raise
        raise TypeError(
            f"{where}: {what} has a straight-through gradient (a jax.custom_vjp), which defines reverse mode only: "
            f"jax.jvp, jax.linearize, jax.jacfwd and jax.hessian cannot differentiate through it. Use reverse mode "
            f"(jax.grad, jax.value_and_grad, jax.vjp, jax.jacrev), or pass observe_only=True (the high-precision "
            f"warmup path, which is plain JAX and supports forward mode; for recipes with delayed gradient scaling "
            f"it keeps the custom backward and reverse mode only)") from e


def fake_quant(
    x: ArrayLike,
    state: AmaxHistory,
    spec: QuantSpec,
    *,
    observe_only: bool | jax.Array = False,
    key: jax.Array | None = None,
) -> tuple[jax.Array, AmaxHistory, QuantStats]:
    """Scaled quantize-dequantize of `x` with a straight-through gradient (a ``jax.custom_vjp``).

    The gradient w.r.t. `x` is the output's cotangent (``spec.ste="identity"``) or the cotangent masked to 0 where
    `x` was clipped (``"masked"``); forward mode (``jax.jvp``) is not defined for the estimator and raises a
    TypeError that says so, except with ``observe_only=True`` (static), which returns `x` itself.

    Args:
      x: float32/bfloat16/float16 array.
      state: its amax history (``spec.init()``).
      spec: the :class:`QuantSpec`.
      observe_only: Python bool or boolean scalar (traced is fine): return `x` unchanged (bitwise) but still
        record the amax and compute the statistics.
      key: PRNG key, needed for ``rounding="stochastic"`` and ``"stochastic_unbiased"``.

    Returns:
      ``(y, new_state, stats)``: `y` in `x`'s dtype; `new_state` has this step's amax recorded; `stats` a
      :class:`QuantStats`.
    """
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec must be a QuantSpec; got {type(spec).__name__}")
    x = float_input(x, "x")
    observe = bool_flag(observe_only)
    q = quantize(x, state, spec, observe, key)
    if observe is True:  # y is x bitwise and the STE the identity: plain x (forward mode works too)
        return x, q.state, q.stats
    y = reverse_mode_only(straight_through, x, q.y, q.keep, where="qat.fake_quant",
                          what=f"QuantSpec(format={spec.format!r})")
    return y, q.state, q.stats


