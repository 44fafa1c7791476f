"""Per-tensor scaled rounding (HiF8, E4M3, E5M2) and the saturation bound: the twin of the fused HiF8 kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlowfp._core.minifloat import ElementFormat


def scaled_round_mask(x: jax.Array, scale: jax.Array, clip: float, fmt: ElementFormat, bound: jax.Array):
    """``(y, |x| > bound)`` with ``y = dtype_x(fmt.round(clip(f32(x) * (1 / scale), +-clip)) * scale)``.

    One scalar IEEE division; the array sees only a multiply (what XLA would emit anyway)."""
    inv = 1.0 / scale
    xf = x.astype(jnp.float32)
    y = (fmt.round(jnp.clip(xf * inv, -clip, clip)) * scale).astype(x.dtype)
    return y, jnp.abs(xf) > bound


def saturation_bound(scale: jax.Array, clip: float, estimate: jax.Array | None = None) -> jax.Array:
    """The float32 magnitude above which an input counts as saturated (clipped): the amax estimate itself when the
    clip is the target (``scale = estimate / target``; comparing ``|x| > estimate`` avoids the one-ulp noise of
    ``|x / scale| > target`` for ``x == estimate``), else ``clip * scale``."""
    bound = jnp.float32(clip) * scale
    if estimate is None:
        return bound
    return jnp.where(jnp.isfinite(estimate) & (estimate > 0), estimate.astype(jnp.float32), bound)
