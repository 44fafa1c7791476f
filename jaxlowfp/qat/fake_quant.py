"""The scaled quantizer: one tensor quantize-dequantized with its scale state and a straight-through gradient.

    amax  = max |x|                                  (NaN-propagating)
    est   = spec.scaling.amax_estimate(state, amax)  (delayed: from earlier steps; current: amax)
    scale = est / target_max                         (1 when est is 0, NaN or Inf)
    y     = fmt.round(clip(x * (1 / scale), +-c)) * scale     c = target_max ("target") or fmt.max_finite ("format")
    dy/dx = 1  (ste="identity")   or   [|x / scale| <= c]  (ste="masked")
    state' = spec.scaling.update(state, amax)
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxlowfp import dispatch, formats, nvfp4
from jaxlowfp._core.checks import bool_flag, float_input, number
from jaxlowfp._core.nvfp4_blocks import global_scales
from jaxlowfp._core.reduce import abs_max
from jaxlowfp._core.scaled import saturation_bound, scaled_round_mask
from jaxlowfp.qat.spec import KERNELS, QuantSpec, QuantStats
from jaxlowfp.scaling import AmaxHistory, DelayedScaling


def scaled_round(
    x: Any, scale: Any, clip: float, fmt: formats.Format | str, *, bound: Any = None
) -> tuple[jax.Array, jax.Array]:
    """Scaled quantize-dequantize, in float32 (the exact form the Pallas kernel twins)::

        inv = 1 / scale;  xs = f32(x) * inv;  y = dtype_x(fmt.round(clip(xs, -clip, clip)) * scale)

    Returns ``(y, saturated_count)`` with ``saturated_count = #{|f32(x)| > bound}`` (int32; +-Inf counts, NaN
    not); `bound` defaults to ``clip * scale`` (see :func:`saturation_bound`). `scale` is a positive finite float32
    scalar, `clip` a static number in (0, fmt.max_finite].
    """
    fmt = formats.get(fmt)
    x = float_input(x, "x")
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
    """NVFP4 fake-quant of `x` with blocks along `axis` (moved last for :func:`jaxlowfp.nvfp4.fake_quantize`)."""
    xt = jnp.moveaxis(x, axis, -1)
    yt = nvfp4.fake_quantize(xt, rule=spec.rule, block_shape=spec.block_shape, global_amax=global_amax,
                             rounding=spec.rounding, key=key if spec.rounding == "stochastic" else None,
                             impl=spec.impl, backend=spec.backend)
    return jnp.moveaxis(yt.astype(x.dtype), -1, axis)


def need_key(spec: QuantSpec, key: Any, what: str) -> None:
    if spec.rounding == "stochastic" and key is None:
        raise ValueError(f"{what} uses rounding='stochastic' and needs a PRNG key; pass key=jax.random.key(...)")


class _Quantized(NamedTuple):
    y: jax.Array  # forward value: x when observing, else the fake-quantized x (no gradient attached)
    keep: jax.Array | None  # masked STE: where the gradient passes; None for the identity STE
    state: AmaxHistory
    stats: QuantStats
    estimate: jax.Array


def quantize(x: jax.Array, state: AmaxHistory, spec: QuantSpec, observe: bool | jax.Array,
              key: Any, axis: int = -1) -> _Quantized:
    """Quantize `x` (no gradient): value, STE mask, new state and stats. NVFP4 blocks run along `axis`."""
    if x.size == 0:
        raise ValueError(f"cannot quantize an empty array (shape {x.shape})")
    xs = lax.stop_gradient(x)
    fused = spec.format == "hif8" and dispatch.resolve_impl(
        spec.impl, kernel=KERNELS["hif8"], backend=spec.backend, config={"dtype": str(x.dtype)}) == "pallas"
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
        delayed = isinstance(spec.scaling, DelayedScaling)
        yq = nvfp4_fake_quant(xs, spec, est if delayed else None, key, axis)
        sat = (jnp.abs(xs) > est) if delayed else jnp.zeros(xs.shape, jnp.bool_)
        scale = global_scales(est, spec.rule)[1]  # S_dec = 1 / S_enc
        n_sat, n_under = jnp.sum(sat, dtype=jnp.int32), jnp.sum((xs != 0) & (yq == 0), dtype=jnp.int32)
    else:
        scale = spec.scaling.scale(est)
        bound = saturation_bound(scale, spec.clip_bound, est if spec.clip == "target" else None)
        if fused:
            # one pass: y, amax, saturated and underflow counts
            r = dispatch.kernel(KERNELS["hif8"], spec.backend)(xs, scale, spec.clip_bound, bound=bound)
            yq, amax, n_sat, n_under = r.y, r.amax, r.saturated_count, r.underflow_count
            sat = (jnp.abs(xs.astype(jnp.float32)) > bound) if spec.ste == "masked" else None
        else:
            yq, sat = scaled_round_mask(xs, scale, spec.clip_bound, spec.element_format, bound)
            n_sat, n_under = jnp.sum(sat, dtype=jnp.int32), jnp.sum((xs != 0) & (yq == 0), dtype=jnp.int32)
    new_state = spec.scaling.update(state, amax)
    n = float(x.size)
    stats = QuantStats(
        amax=amax,
        amax_estimate=est,
        scale=scale,
        saturated_fraction=n_sat.astype(jnp.float32) / n,
        underflow_fraction=n_under.astype(jnp.float32) / n,
        nonfinite_count=jnp.sum(~jnp.isfinite(xs), dtype=jnp.int32),
    )
    keep = None  # identity STE, or masked but observing (nothing was clipped)
    if spec.ste == "masked" and observe is not True:
        keep = ~sat if observe is False else jnp.logical_or(observe, ~sat)
    return _Quantized(select(observe, xs, yq), keep, new_state, stats, est)


@jax.custom_vjp
def straight_through(x: jax.Array, y: jax.Array, keep: jax.Array | None) -> jax.Array:
    """Value `y`, gradient w.r.t. `x`: identity (keep None) or masked by `keep`."""
    return y


def _st_fwd(x, y, keep):
    return y, keep


def _st_bwd(keep, g):
    return (g if keep is None else jnp.where(keep, g, jnp.zeros((), g.dtype))), None, None


straight_through.defvjp(_st_fwd, _st_bwd)


def fake_quant(
    x: Any,
    state: AmaxHistory,
    spec: QuantSpec,
    *,
    observe_only: bool | jax.Array = False,
    key: jax.Array | None = None,
) -> tuple[jax.Array, AmaxHistory, QuantStats]:
    """Scaled quantize-dequantize of `x` with a straight-through gradient.

    Args:
      x: float32/bfloat16/float16 array.
      state: its amax history (``spec.init()``).
      spec: the :class:`QuantSpec`.
      observe_only: Python bool or boolean scalar (traced is fine): return `x` unchanged (bitwise) but still
        record the amax and compute the statistics.
      key: PRNG key, needed for ``rounding="stochastic"``.

    Returns:
      ``(y, new_state, stats)``: `y` in `x`'s dtype; `new_state` has this step's amax recorded; `stats` a
      :class:`QuantStats`.
    """
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec must be a QuantSpec; got {type(spec).__name__}")
    x = float_input(x, "x")
    q = quantize(x, state, spec, bool_flag(observe_only), key)
    return straight_through(x, q.y, q.keep), q.state, q.stats


