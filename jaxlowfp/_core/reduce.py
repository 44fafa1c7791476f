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


def group_ids(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Rows of a ragged (grouped) matmul, grouped by `group_sizes` (rows of group 0 first): (the group of each of
    the m rows, whether the row belongs to a group: rows past sum(group_sizes) do not)."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(m)
    gid = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    return jnp.minimum(gid, group_sizes.shape[0] - 1), rows < ends[-1]


def segment_amax(row_amax: jax.Array, gid: jax.Array, valid: jax.Array, g: int) -> jax.Array:
    """max of `row_amax` over each of the `g` groups' rows (`group_ids`): NaN if one is NaN, 0 for a group with no
    row."""
    seg = jnp.where(valid, gid, g)
    m = jax.ops.segment_max(jnp.where(jnp.isnan(row_amax), 0.0, row_amax), seg, num_segments=g + 1)[:g]
    nan = jax.ops.segment_max(jnp.isnan(row_amax).astype(jnp.int32), seg, num_segments=g + 1)[:g] > 0
    return jnp.where(nan, jnp.nan, jnp.maximum(m, 0.0))
