"""Fused scaled HiF8 fake-quant in one pass over `x`: Pallas twin of ``jaxlowfp.qat.scaled_round``
(its math: ``jaxlowfp._core.scaled``).

In float32, with one IEEE scalar division outside the kernel::

    inv = 1 / scale
    xs  = f32(x) * inv
    y   = dtype_x( hif8.round(clip(xs, -c, c)) * scale )
    amax = max |x|                 (NaN if any x is NaN, checked explicitly: the max reductions of Triton and
                                    of XLA:CPU can drop a NaN)
    saturated = #{ |f32(x)| > bound }  (+-Inf count, NaN does not; bound = saturation_bound in _core.scaled)
    nonfinite = #{ x is NaN or +-Inf }
    underflow = #{ x != 0 and y == 0 }   (nonzero inputs that round to zero)

Each grid step handles ``block_size`` contiguous elements of the flattened `x`, writes its slice of `y`, and one
partial amax / count per output; a tiny XLA reduction over the ``cdiv(n, block_size)`` partials finishes the job.
The rounding is ``jaxlowfp.hif8.round`` itself (pure uint32 bit math, which lowers to Triton).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxlowfp._core import hif8
from jaxlowfp._core.checks import float_input
from jaxlowfp._core.scaled import saturation_bound
from ._common import (
    MAX_BLOCK_ELEMENTS,
    check_pow2,
    compiler_params,
    resolve_interpret,
    triton_lowering,
    valid_mask,
)

__all__ = ["scaled_fake_quant", "ScaledFakeQuant", "KERNEL", "DEFAULT_BLOCK", "DEFAULT_WARPS"]

KERNEL = "hif8.scaled_fake_quant"
DEFAULT_BLOCK = 8192  # elements per program on a GPU (bench/gpu_kernels.py sweeps this)
DEFAULT_WARPS = 8


class ScaledFakeQuant(NamedTuple):
    """Result of :func:`scaled_fake_quant` (the first four fields in the order of the issue's contract)."""

    y: jax.Array  # x's shape and dtype: the fake-quantized values
    amax: jax.Array  # f32[]: max |x|, NaN if x holds a NaN
    saturated_count: jax.Array  # i32[]: #{|x| > bound}
    nonfinite_count: jax.Array  # i32[]: #{x is NaN or +-Inf}
    underflow_count: jax.Array  # i32[]: #{x != 0 and y == 0}


def _clip(xs: jnp.ndarray, c: float) -> jnp.ndarray:
    # Not jnp.clip: Triton's min/max are NaN-ignoring (clip(NaN) would give c); comparisons keep NaN as XLA does.
    return jnp.where(xs > c, c, jnp.where(xs < -c, -c, xs))


def _kernel(p_ref, x_ref, y_ref, amax_ref, sat_ref, nonfinite_ref, nan_ref, under_ref, *, n: int, block: int,
            clip: float):
    inv, scale, bound = p_ref[0], p_ref[1], p_ref[2]
    x_in = x_ref[...]
    x = x_in.astype(jnp.float32)
    xs = x * inv
    y = (hif8.round(_clip(xs, clip)) * scale).astype(y_ref.dtype)
    y_ref[...] = y
    valid = valid_mask((block,), 0, block, n)  # the ragged last block holds padding (NaN in interpret mode)
    nan = jnp.isnan(x)
    # max over non-NaN values only (Triton's max ignores NaN anyway); NaN is re-inserted from the count outside.
    amax_ref[...] = jnp.max(jnp.where(valid & ~nan, jnp.abs(x), 0.0)).reshape(1)
    sat_ref[...] = jnp.sum((valid & (jnp.abs(x) > bound)).astype(jnp.int32)).reshape(1)
    nonfinite_ref[...] = jnp.sum((valid & ~jnp.isfinite(x)).astype(jnp.int32)).reshape(1)
    nan_ref[...] = jnp.sum((valid & nan).astype(jnp.int32)).reshape(1)
    under_ref[...] = jnp.sum((valid & (x_in != 0) & (y == 0)).astype(jnp.int32)).reshape(1)


@functools.partial(jax.jit, static_argnames=("clip", "interpret", "block", "num_warps"))
def _scaled_fake_quant(x, scale, bound, *, clip: float, interpret: bool, block: int, num_warps: int):
    n = x.size
    grid = pl.cdiv(n, block)
    params = jnp.stack([1.0 / scale, scale, bound, scale])  # the one IEEE division, in XLA (Triton's f32 `/` is
    # approximate); padded to 4 entries: Triton blocks need a power-of-two size
    part = lambda dtype: jax.ShapeDtypeStruct((grid,), dtype)  # noqa: E731
    part_spec = pl.BlockSpec((1,), lambda i: (i,))
    y, amax, sat, nonfinite, nan, under = pl.pallas_call(
        functools.partial(_kernel, n=n, block=block, clip=clip),
        grid=(grid,),
        in_specs=[pl.BlockSpec((4,), lambda i: (0,)), pl.BlockSpec((block,), lambda i: (i,))],
        out_specs=[pl.BlockSpec((block,), lambda i: (i,))] + [part_spec] * 5,
        out_shape=[jax.ShapeDtypeStruct((n,), x.dtype), part(jnp.float32)] + [part(jnp.int32)] * 4,
        interpret=interpret,
        compiler_params=compiler_params(interpret, num_warps),
        name="hif8_scaled_fake_quant",
    )(params, x.reshape(n))
    amax = jnp.where(jnp.sum(nan) > 0, jnp.float32(jnp.nan), jnp.max(amax))
    return ScaledFakeQuant(y.reshape(x.shape), amax, jnp.sum(sat), jnp.sum(nonfinite), jnp.sum(under))


def check_args(x: Any, scale: Any, clip: Any, bound: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The arguments of a fused HiF8 kernel (Triton or Mosaic), checked: ``(x, scale, bound)`` as arrays."""
    x = float_input(x, "x")
    if x.size == 0:
        raise ValueError(f"x must have at least one element; got shape {x.shape}")
    if x.size >= 2**31:
        raise ValueError(f"x has {x.size} elements; the kernel indexes with int32 and supports fewer than 2^31")
    if isinstance(scale, float):
        scale = jnp.float32(scale)
    scale = jnp.asarray(scale)
    if scale.dtype != jnp.float32 or scale.shape != ():
        raise TypeError(f"scale must be a float32 scalar; got dtype {scale.dtype} and shape {scale.shape}")
    if isinstance(clip, bool) or not isinstance(clip, (int, float, np.floating)):
        raise TypeError(f"clip must be a Python number (static); got {type(clip).__name__}")
    if not 0 < float(clip) <= hif8.MAX:
        raise ValueError(f"clip={clip!r} must be in (0, {hif8.MAX}], the range of hif8")
    bound = saturation_bound(scale, float(clip)) if bound is None else jnp.asarray(bound, jnp.float32)
    if bound.shape != ():
        raise TypeError(f"bound must be a float32 scalar; got shape {bound.shape}")
    return x, scale, bound


def scaled_fake_quant(
    x,
    scale,
    clip: float = 15.0,
    *,
    bound=None,
    interpret: bool | None = None,
    block_size: int | None = None,
    num_warps: int | None = None,
) -> ScaledFakeQuant:
    """Scaled HiF8 quantize-dequantize of `x` with its amax and counters, in one pass (Pallas).

    Args:
      x: float32/bfloat16/float16 array of any shape (fewer than 2^31 elements).
      scale: float32 scalar, shape () (decode scale, ``amax_estimate / target_max``); a Python float is float32.
      clip: the static clip bound ``c`` applied to ``x / scale`` before rounding (``target_max``), in (0, 32768].
      bound: float32 scalar: inputs with ``|x| > bound`` count as saturated (default ``clip * scale``; QAT passes
        the amax estimate, see ``jaxlowfp.qat.saturation_bound``).
      interpret: True runs Pallas interpret mode (any backend), False the compiled Triton kernel; None picks
        interpret mode when ``JAXLOWFP_PALLAS_INTERPRET=1``, else the compiled kernel on a supporting GPU, else
        raises ``jaxlowfp.dispatch.PallasUnavailableError``.
      block_size: elements per program, a power of two <= 2^20 (default 8192 compiled; interpret mode uses one
        block up to 2^20 elements, since its cost grows with the number of grid steps).
      num_warps: Triton warps per program (default 8; ignored in interpret mode).

    Returns:
      :class:`ScaledFakeQuant` ``(y, amax, saturated_count, nonfinite_count, underflow_count)``: `y` in `x`'s
      dtype and shape; `y` and the saturated count equal ``jaxlowfp.qat.scaled_round(x, scale, clip, "hif8")``.
    """
    x, scale, bound = check_args(x, scale, clip, bound)
    interpret = resolve_interpret(interpret, kernel=KERNEL)
    if block_size is None:
        block_size = min(pl.next_power_of_2(x.size), MAX_BLOCK_ELEMENTS) if interpret else DEFAULT_BLOCK
    check_pow2(block_size, "block_size")
    num_warps = DEFAULT_WARPS if num_warps is None else num_warps
    with triton_lowering(interpret):
        return _scaled_fake_quant(
            x, scale, bound, clip=float(clip), interpret=interpret, block=block_size, num_warps=num_warps
        )
