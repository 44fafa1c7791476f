"""Fused scaled HiF8 fake-quant with amax and counters, as a Mosaic GPU kernel (sm_90+): same arguments and results
as :func:`pallas_kernels.hif8.scaled_fake_quant` (the Triton kernel), bit for bit; twin ``jaxlowfp.qat.scaled_round``.

In float32, with the one IEEE division (``1 / scale``) done by XLA outside the kernel::

    y = dtype_x( hif8.round(clip(f32(x) * inv, -c, c)) * scale )
    amax = max |x| (NaN if any x is NaN);  saturated = #{|x| > bound};  nonfinite = #{x NaN or +-Inf}
    underflow = #{x != 0 and y == 0}

Each program takes ``block_size`` contiguous elements of the flattened `x` (``WG_STRIDED`` layout, 16 bytes per
thread and access), writes its slice of `y` and one partial amax / count per output; XLA reduces the partials.
Mosaic GPU cannot mask a ragged block, so the whole blocks run in place and the remainder (fewer than
``block_size`` elements) runs as one zero-padded program whose padding is masked out of the counters.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxlowfp._core import hif8
from jaxlowfp._core.bits import ABS, u32
from . import _mosaic as mg
from .hif8 import ScaledFakeQuant, check_args

__all__ = ["scaled_fake_quant", "ScaledFakeQuant", "KERNEL", "DEFAULT_BLOCK"]

KERNEL = "hif8.scaled_fake_quant"
DEFAULT_BLOCK = 4096  # elements per program on a GPU (32 float32 per thread)
_MAX_BLOCK = 1 << 16


def _clip(xs: jnp.ndarray, c: float) -> jnp.ndarray:
    # where, not jnp.clip: equal for every input (NaN stays NaN) and independent of how max/min treat NaN
    return jnp.where(xs > c, c, jnp.where(xs < -c, -c, xs))


def _kernel(p_ref, x_ref, y_ref, amax_ref, sat_ref, nonfinite_ref, nan_ref, under_ref, *, block: int, valid: int,
            clip: float):
    """One program: `block` elements; `valid` < block only in the padded remainder program (masked counters)."""
    i = lax.axis_index("i")
    inv, scale, bound = p_ref[0], p_ref[1], p_ref[2]
    layout = mg.strided_layout((block,), mg.vector_length(x_ref.dtype))
    x = mg.load(x_ref.at[pl.ds(i * block, block)], layout).astype(jnp.float32)
    y = (hif8.round(_clip(x * inv, clip)) * scale).astype(y_ref.dtype)
    mg.store(y_ref.at[pl.ds(i * block, block)], y)
    ax = lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint32) & u32(ABS), jnp.float32)
    nan = mg.is_nan(x)
    keep_nan, keep = ~nan, None
    if valid < block:  # padding: zeros, already neutral for everything but a negative or NaN bound
        keep = mg.require().broadcasted_iota(jnp.int32, (block,), 0, layout=layout) < valid
        keep_nan = keep_nan & keep

    def count(c):
        return jnp.sum((c if keep is None else c & keep).astype(jnp.int32))

    amax_ref[i] = jnp.max(jnp.where(keep_nan, ax, 0.0))  # NaN-free max; NaN is re-inserted from the count
    sat_ref[i] = count(ax > bound)
    nonfinite_ref[i] = count(~mg.is_finite(x))
    nan_ref[i] = count(nan)
    under_ref[i] = count((x != 0.0) & (y.astype(jnp.float32) == 0.0))


def _call(params, x, *, block: int, valid: int, clip: float, interpret, rest: bool = False):
    """The kernel over the 1-D `x` (a multiple of `block` long): y and five partials per program."""
    plgpu = mg.require()
    grid = x.size // block
    part = lambda dtype: jax.ShapeDtypeStruct((grid,), dtype)  # noqa: E731
    return plgpu.kernel(
        functools.partial(_kernel, block=block, valid=valid, clip=clip),
        out_type=(jax.ShapeDtypeStruct(x.shape, x.dtype), part(jnp.float32), *[part(jnp.int32)] * 4),
        grid=(grid,),
        grid_names=("i",),
        compiler_params=mg.compiler_params(),
        interpret=interpret,
        kernel_name="hif8_scaled_fake_quant" + ("_rest" if rest else ""),  # _rest: the padded remainder
    )(params, x)


@functools.partial(jax.jit, static_argnames=("clip", "interpret", "block"))
def _scaled_fake_quant(x, scale, bound, *, clip: float, interpret, block: int):
    n = x.size
    flat = x.reshape(n)
    params = jnp.stack([1.0 / scale, scale, bound])  # the one IEEE division, in XLA
    body = n // block * block
    parts, y = [], None
    if body:
        y, *p = _call(params, flat, block=block, valid=block, clip=clip, interpret=interpret)
        parts.append(p)
    if n > body:  # the remainder: one program over a zero-padded copy (at most one block)
        rest = n - body
        width = mg.round_up(rest, mg.THREADS * mg.vector_length(x.dtype))
        padded = jnp.zeros((width,), x.dtype).at[:rest].set(flat[body:])
        y_rest, *p = _call(params, padded, block=width, valid=rest, clip=clip, interpret=interpret, rest=True)
        parts.append(p)
        y = y_rest[:rest] if y is None else lax.dynamic_update_slice(y, y_rest[:rest], (body,))
    amax, sat, nonfinite, nan, under = (jnp.concatenate(c) for c in zip(*parts))
    amax = jnp.where(jnp.sum(nan) > 0, jnp.float32(jnp.nan), jnp.max(amax))
    return ScaledFakeQuant(y.reshape(x.shape), amax, jnp.sum(sat), jnp.sum(nonfinite), jnp.sum(under))


def scaled_fake_quant(
    x,
    scale,
    clip: float = 15.0,
    *,
    bound=None,
    interpret=None,
    block_size: int | None = None,
    num_warps: int | None = None,
) -> ScaledFakeQuant:
    """Scaled HiF8 quantize-dequantize of `x` with its amax and counters, in one pass (Mosaic GPU).

    Arguments and result as :func:`pallas_kernels.hif8.scaled_fake_quant`, except:
      interpret: True runs the Mosaic GPU interpreter (any backend), a ``plgpu.InterpretGPUParams`` runs it with
        those parameters (e.g. ``detect_races=True``), False compiles for the GPU, None picks the interpreter when
        ``JAXLOWFP_PALLAS_INTERPRET=1``, else the compiled kernel on an sm_90+ GPU, else raises
        ``PallasUnavailableError``.
      block_size: elements per program, a power of two in [1024, 65536] (default 4096); the remainder of a size
        that is not a multiple runs as one extra padded program.
      num_warps: None or 4 (a Mosaic GPU program is one warpgroup of 4 warps); kept for the Triton signature.
    """
    x, scale, bound = check_args(x, scale, clip, bound)
    if num_warps not in (None, 4):
        raise ValueError(f"num_warps={num_warps!r}: a Mosaic GPU program is one warpgroup (4 warps); pass None or 4")
    block = DEFAULT_BLOCK if block_size is None else block_size
    mg.check_pow2(block, "block_size", lo=mg.THREADS * 8, hi=_MAX_BLOCK)
    interpret = mg.resolve_interpret(interpret, kernel=KERNEL)
    return _scaled_fake_quant(x, scale, bound, clip=float(clip), interpret=interpret, block=block)
