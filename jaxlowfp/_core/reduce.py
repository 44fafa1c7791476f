"""Reductions with the NaN semantics the quantizers promise, and the block-error sums of the 4/6-style choices."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxlowfp._core.bits import no_contract


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


def pairwise_rows(r: jax.Array, op) -> jax.Array:
    """Reduce the row axis of [..., R, nb] (R = 1 or a power of two) by halves: op(r[:R/2], r[R/2:]), repeated
    (TE's 2D order)."""
    while r.shape[-2] > 1:
        h = r.shape[-2] // 2
        r = op(r[..., :h, :], r[..., h:, :])
    return r[..., 0, :]


def accumulate_error(acc: jax.Array, d: jax.Array, rule: str) -> jax.Array:
    """The running block error after one more column of differences `d` (`acc` +0 before the first column):
    ``acc + d*d`` (mse; ``d*d`` through :func:`~jaxlowfp._core.bits.no_contract`, so no FMA), ``acc + |d|`` (mae)
    or ``max(acc, |d|)``."""
    if rule == "abs_max":
        return jnp.maximum(acc, jnp.abs(d))
    return acc + (no_contract(d * d) if rule == "mse" else jnp.abs(d))


def combine_rows(acc: jax.Array, rule: str) -> jax.Array:
    """The per-row errors [..., R, nb] of a block combined pairwise over rows (TE's 2D order): sum, or max."""
    return pairwise_rows(acc, jnp.maximum if rule == "abs_max" else jnp.add)


# From this many elements per candidate (xb.size), the column fold is written out (run time dominates); below it, a
# rolled loop (compile time dominates): docs/limits.md. 256 x 1024 is the first written-out size.
UNROLLED_FROM = 1 << 18


def unrolled(xb: jax.Array) -> bool:
    """Whether :func:`column_loop` writes the columns of blocks `xb` out (``xb.size >= UNROLLED_FROM``); callers
    with several candidates then fold each candidate on its own (:func:`~jaxlowfp._core.nvfp4_blocks.block_errors`)."""
    return xb.size >= UNROLLED_FROM


def column_loop(xb: jax.Array, aux: jax.Array | None, column, shape: tuple[int, ...] = (), *, with_max: bool = False):
    """Fold ``column(|x_i|, aux_i, carry)`` over the 16 columns i = 0..15 of blocks `xb` [..., R, nb, 16], in
    order: ``|x_i|`` is float32 [..., R, nb]; `aux_i` is column i of `aux` (laid out as `xb`: uniforms, say), or
    None. The carry is (error, max), float32 of `shape` broadcast with [..., R, nb], starting at +0 (exact:
    ``+0 + t == t`` and ``max(+0, t) == t`` for every t >= 0 or NaN); the max is None unless `with_max`.

    Two forms, the same bits. Small tensors: a rolled loop over a copy with the columns swapped in front of the
    blocks, so XLA compiles one column's work, not sixteen. From :data:`UNROLLED_FROM` elements: the sixteen
    columns written out, which XLA fuses into one pass over `xb` (the loop's copy and its pass per column cost
    2-3x the run time there; docs/limits.md)."""
    zero = jnp.zeros(jnp.broadcast_shapes(shape, xb.shape[:-1]), jnp.float32)
    carry = (zero, zero if with_max else None)
    if unrolled(xb):
        for i in range(xb.shape[-1]):
            carry = column(jnp.abs(xb[..., i].astype(jnp.float32)), None if aux is None else aux[..., i], carry)
        return carry
    cols = jnp.swapaxes(xb, -1, -2)  # [..., R, 16, nb]: column i is contiguous within each row
    acols = None if aux is None else jnp.swapaxes(aux, -1, -2)

    def body(i, carry):
        ai = None if acols is None else lax.dynamic_index_in_dim(acols, i, -2, keepdims=False)
        return column(jnp.abs(lax.dynamic_index_in_dim(cols, i, -2, keepdims=False).astype(jnp.float32)), ai, carry)

    return lax.fori_loop(0, xb.shape[-1], body, carry)
