"""Shared plumbing for the Mosaic GPU kernels (``mosaic_hif8``, ``mosaic_nvfp4``): the JAX-version gate, interpret
mode, loads and stores, layouts, and float32 arithmetic made exact with integer operations.

How these kernels use Mosaic GPU (``jax.experimental.pallas.mosaic_gpu``, sm_90+):

- ``plgpu.kernel`` with Lane lowering semantics: one Pallas thread is one warpgroup (128 CUDA threads); every
  array names its register layout explicitly. Two layouts are used: ``WG_STRIDED`` (a 1-D block spread over the
  threads, for the elementwise HiF8 kernel) and ``TCGEN05_TMEM_NATIVE(v)`` (row ``r`` of a ``[128 k, C]`` array
  lives in thread ``r mod 128``, ``v`` columns per register), so every per-16-element-block reduction of NVFP4
  runs inside one thread, in exactly the order the jnp twin uses, with no cross-lane shuffles.
- Operands stay in global memory; each program loads its block straight into registers and stores its results.
  Mosaic GPU has no masked loads, so every program covers whole blocks: the wrappers run the kernel on the
  whole programs of the input in place and on a zero-padded copy of the remainder (less than one program's width
  along the split axis), and merge the results with ``dynamic_update_slice``.
- No float division inside a kernel: Mosaic compiled ``1 / d`` to ``rcp.approx.f32`` (seen in the PTX). The one
  division the NVFP4 twin does per block (``1 / (s * S_dec)``) is :func:`reciprocal` here, correctly rounded with
  integer operations; ``/ 6`` and ``/ 1536`` are ``div_by_3_pow2``. Mosaic also marks float add/sub/mul as
  contractible (FMA), so a product that feeds a sum goes through ``no_contract``, as in the twin.

The API has changed between JAX releases; :func:`require` checks the pieces used here and names the JAX needed.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxlowfp._core import capability
from jaxlowfp._core.bits import ABS, BITS_INF, SIGN, u32
from jaxlowfp._core.capability import PallasUnavailableError

__all__ = [
    "MIN_JAX",
    "THREADS",
    "require",
    "resolve_interpret",
    "compiler_params",
    "load",
    "store",
    "rows_layout",
    "strided_layout",
    "vector_length",
    "reciprocal",
    "is_nan",
    "is_finite",
    "round_up",
    "check_pow2",
]

MIN_JAX = "0.11.2"  # oldest release the kernels were checked on (interpreter and deviceless compile)
THREADS = 128  # CUDA threads of one Mosaic GPU program (one warpgroup)


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split(".")[:3] if p.isdigit())


@functools.lru_cache(maxsize=1)
def _plgpu():
    """``(plgpu, None)`` if ``jax.experimental.pallas.mosaic_gpu`` has what the kernels use, else ``(None, why)``."""
    if _version(jax.__version__) < _version(MIN_JAX):
        return None, "older releases lack the Mosaic GPU interpreter or lower Pallas on GPU differently"
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError as e:  # e.g. a JAX built without Mosaic GPU
        return None, f"jax.experimental.pallas.mosaic_gpu cannot be imported ({e})"
    missing = [a for a in ("kernel", "load", "layout_cast", "broadcasted_iota", "Layout", "CompilerParams",
                           "LoweringSemantics", "InterpretGPUParams") if not hasattr(plgpu, a)]
    if not missing:
        missing += [f"Layout.{a}" for a in ("WG_STRIDED", "TCGEN05_TMEM_NATIVE") if not hasattr(plgpu.Layout, a)]
        missing += ["CompilerParams(lowering_semantics=)"] * ("lowering_semantics" not in {
            f.name for f in dataclasses.fields(plgpu.CompilerParams)})
        missing += ["InterpretGPUParams(detect_races=)"] * ("detect_races" not in {
            f.name for f in dataclasses.fields(plgpu.InterpretGPUParams)})
        params = set(inspect.signature(plgpu.kernel).parameters)
        missing += [f"kernel({a}=)" for a in ("out_type", "grid", "grid_names", "compiler_params", "interpret")
                    if a not in params]
        missing += [f"load({a}=)" for a in ("layout", "optimized") if a not in inspect.signature(plgpu.load).parameters]
    if missing:
        return None, f"jax.experimental.pallas.mosaic_gpu lacks {', '.join(missing)}"
    return plgpu, None


def require():
    """The ``plgpu`` module, or :class:`PallasUnavailableError` naming the JAX the Mosaic GPU kernels need."""
    plgpu, why = _plgpu()
    if plgpu is None:
        raise PallasUnavailableError(
            f"the Mosaic GPU kernels need jax >= {MIN_JAX} (plgpu.kernel with Lane semantics, explicit layouts and "
            f"the GPU interpreter); this is jax {jax.__version__}: {why}. Use backend='triton' or impl='xla'."
        )
    return plgpu


def resolve_interpret(interpret: Any, *, kernel: str):
    """``None`` (compiled) or the ``plgpu.InterpretGPUParams`` a kernel runs with.

    `interpret`: a ``plgpu.InterpretGPUParams`` (e.g. with ``detect_races=True``) is used as given; True runs the
    GPU interpreter with default parameters; False compiles for the GPU (also how kernels are compiled deviceless
    from a CPU host); None asks ``jaxlowfp._core.capability.resolve_interpret`` (``JAXLOWFP_PALLAS_INTERPRET=1``:
    interpret; an sm_90+ GPU: compiled; else ``PallasUnavailableError``).
    """
    plgpu = require()
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    if interpret is None:
        interpret = capability.resolve_interpret(None, kernel=kernel, pallas_backend="mosaic")
    elif not isinstance(interpret, bool):
        raise TypeError(f"interpret must be True, False, None or a plgpu.InterpretGPUParams; got {interpret!r}")
    return plgpu.InterpretGPUParams() if interpret else None


def compiler_params():
    """Lane semantics: arrays carry the explicit layouts chosen in the kernels (Warpgroup semantics infers layouts
    and cannot place a per-row reduction)."""
    plgpu = require()
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def rows_layout(v: int):
    """Row r of a [128 k, C] array in thread r mod 128, v consecutive columns per register (v = 1 allows slicing
    single columns; a relayout between vector lengths is free)."""
    return require().Layout.TCGEN05_TMEM_NATIVE(v)


def strided_layout(shape: tuple[int, ...], vec: int):
    """A 1-D block spread over the 128 threads, `vec` consecutive elements per thread and access."""
    return require().Layout.WG_STRIDED(shape, vec_size=vec)


def vector_length(dtype: Any) -> int:
    """Elements in 16 bytes (one vectorised global access) of `dtype`."""
    return 16 // jnp.dtype(dtype).itemsize


def load(ref, layout):
    """Load `ref` (global memory) into registers with `layout`. Unoptimised: Mosaic's transfer planner refuses
    per-thread rows of 64 bytes as "not whole sectors", yet consecutive threads read consecutive rows, so a warp's
    accesses cover whole cache lines."""
    return require().load(ref, layout=layout, optimized=False)


def store(ref, value) -> None:
    """Store `value` to `ref` (global memory); ``plgpu.store`` where it exists (jax >= 0.12), else ``ref[...]``
    (jax 0.11 lowers that unoptimised for tiled layouts)."""
    plgpu = require()
    if hasattr(plgpu, "store"):
        plgpu.store(ref, value, optimized=False)
    else:
        ref[...] = value


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def check_pow2(value, what: str, *, lo: int, hi: int) -> int:
    """`value` if it is an int power of two in [lo, hi], else a ValueError saying what is allowed."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1 and not value & (value - 1)
    if not ok or not lo <= value <= hi:
        raise ValueError(f"{what} must be a power of two in [{lo}, {hi}] for the Mosaic GPU kernel; got {value!r}")
    return value


# ---- exact float32 arithmetic with integer operations ------------------------------------------------------------


def _bits(x: jnp.ndarray) -> jnp.ndarray:
    return lax.bitcast_convert_type(x, jnp.uint32)


def is_nan(x: jnp.ndarray) -> jnp.ndarray:
    """isnan of float32 `x` by its bits (Mosaic GPU has no ``is_finite`` lowering)."""
    return (_bits(x) & u32(ABS)) > u32(BITS_INF)


def is_finite(x: jnp.ndarray) -> jnp.ndarray:
    """isfinite of float32 `x` by its bits."""
    return (_bits(x) & u32(ABS)) < u32(BITS_INF)


def reciprocal(d: jnp.ndarray) -> jnp.ndarray:
    """``1 / d`` for float32 `d`, correctly rounded (IEEE round to nearest even), with integer operations only.

    ``|d| = M * 2^E`` with the significand M normalised to 24 bits (also for subnormal d); then
    ``1 / |d| = (2^48 / M) * 2^(-E-48)``. ``Q = floor(2^48 / M)`` (25 or 26 bits) comes from four exact 32-bit
    divisions (long division in base 2^8); keep 24 bits of Q (fewer for a subnormal result), round to nearest even
    with the dropped bits and the remainder as sticky bit; a carry moves the exponent, overflow gives Inf.
    ``1 / +-0 = +-Inf``, ``1 / +-Inf = +-0``, NaN stays NaN (quieted, sign kept, as x86 does).
    """
    bits = _bits(d)
    sign = bits & u32(SIGN)
    mag = bits & u32(ABS)
    ef = mag >> u32(23)
    frac = mag & u32(0x7FFFFF)
    m = jnp.where(ef == u32(0), frac, frac | u32(0x800000))  # |d| = m * 2^e
    e = jnp.where(ef == u32(0), -149, ef.astype(jnp.int32) - 150)
    lz = jnp.where(m == u32(0), 0, lax.clz(m.astype(jnp.int32)) - 8)  # normalise subnormal significands
    m = m << lz.astype(jnp.uint32)
    e = e - lz
    ms = jnp.where(m == u32(0), u32(1 << 23), m)  # a divisor for the zero lanes (their result is replaced)
    q = u32(1 << 24) // ms  # 1 or 2: 2^24 / M with M in [2^23, 2^24)
    r = u32(1 << 24) - q * ms
    for _ in range(3):  # three more base-256 digits: Q = floor(2^48 / M), r = the remainder
        n = r << u32(8)
        digit = n // ms
        r = n - digit * ms
        q = (q << u32(8)) | digit
    length = jnp.where(q >= u32(1 << 25), 26, 25)  # Q = 2^25 exactly when M = 2^23
    eb = length - 1 - e - 48  # unbiased exponent of the result's leading bit
    drop = length - 24 + jnp.maximum(-126 - eb, 0)  # 1 or 2 bits, more for a subnormal result
    tiny = drop > length  # below half the smallest subnormal
    du = jnp.minimum(drop, 31).astype(jnp.uint32)
    keep = q >> du
    rem = q & ((u32(1) << du) - u32(1))
    half = u32(1) << (du - u32(1))
    up = (rem > half) | ((rem == half) & ((r != u32(0)) | ((keep & u32(1)) == u32(1))))
    keep = keep + up.astype(jnp.uint32)
    normal = eb >= -126
    out = jnp.where(normal, ((eb + 126).astype(jnp.uint32) << u32(23)) + keep, keep)  # a carry moves the exponent
    out = jnp.where(normal & (eb > 127), u32(BITS_INF), jnp.minimum(out, u32(BITS_INF)))
    out = jnp.where(tiny, u32(0), out)
    out = jnp.where(mag == u32(0), u32(BITS_INF), out)  # 1 / +-0
    out = jnp.where(mag == u32(BITS_INF), u32(0), out)  # 1 / +-Inf
    out = jnp.where(mag > u32(BITS_INF), mag | u32(0x400000), out)  # NaN: quieted, sign re-attached below
    return lax.bitcast_convert_type(sign | out, jnp.float32)
