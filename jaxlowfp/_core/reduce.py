"""Reductions with the NaN semantics the quantizers promise."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def abs_max(x: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:
    """``max |x|`` over `axis`, NaN wherever the reduced elements hold a NaN.

    ``jnp.max`` alone is not enough: XLA:CPU's vectorised max reduction can drop a NaN (and return -inf when the NaN
    is the last element), and Triton's max ignores NaN by design.
    """
    m = jnp.max(jnp.abs(x), axis=axis, keepdims=keepdims)
    return jnp.where(jnp.any(jnp.isnan(x), axis=axis, keepdims=keepdims), jnp.nan, m)
