"""float32 bit helpers and correctly rounded division, shared by the codecs, the block math and the kernels.

XLA rewrites ``a / c`` (c constant or broadcast) into ``a * (1/c)``, which differs from IEEE division in the last
bit for about a third of inputs, and LLVM contracts ``acc + d*d`` into an FMA (docs/formats/nvfp4.md section 8). The
helpers here keep every rounding the specification asks for: bit patterns, integer-exact division by constants
(:func:`div_const`, no division instruction at all, so exact on every backend), and the older barrier-based forms
(:func:`true_divide`, :func:`ieee_div`) for small tables and scalars.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SIGN = 0x80000000
ABS = 0x7FFFFFFF
BITS_INF = 0x7F800000
BITS_NAN = 0x7FC00000
FLT_MAX = float(np.finfo(np.float32).max)


def u32(v: int) -> jnp.ndarray:
    """A uint32 scalar (so shifts and masks never promote)."""
    return jnp.uint32(v)


def f32_bits(x: jnp.ndarray) -> jnp.ndarray:
    """The float32 bit pattern of `x` (cast to float32 first, exactly for float16/bfloat16) as uint32."""
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def from_bits(b: jnp.ndarray) -> jnp.ndarray:
    """float32 from a uint32 bit pattern."""
    return lax.bitcast_convert_type(b, jnp.float32)


def pow2(e: jnp.ndarray, *, subnormal: bool = False) -> jnp.ndarray:
    """``2.0**e`` in float32 for integer `e` in [-126, 127] built from the exponent bits; with ``subnormal=True``
    also e = -127 (the float32 subnormal 2^-127, mantissa bit 22)."""
    if not subnormal:
        return from_bits(((e + 127) << 23).astype(jnp.uint32))
    return from_bits(jnp.where(e >= -126, (e + 127) << 23, 1 << 22).astype(jnp.uint32))


def true_divide(a: jax.Array, c: float) -> jax.Array:
    """IEEE ``a / c`` for a Python constant `c`: the divisor is a full-size array behind an
    ``optimization_barrier``, so XLA cannot turn the division into a reciprocal multiply. Division by a power of
    two needs no guard."""
    if float(c) == 2.0 ** round(np.log2(c)):
        return a * (1.0 / c)  # exact either way
    return a / lax.optimization_barrier(jnp.full(a.shape, c, jnp.float32))


@jax.custom_batching.custom_vmap
def _div_barrier(a: jax.Array, b: jax.Array) -> jax.Array:
    a, b = jnp.broadcast_arrays(a, b)
    return a / lax.optimization_barrier(b)


@_div_barrier.def_vmap
def _div_barrier_vmap(axis_size, in_batched, a, b):
    a_batched, b_batched = in_batched
    if not a_batched:
        a = jnp.broadcast_to(a, (axis_size,) + a.shape)
    if not b_batched:
        b = jnp.broadcast_to(b, (axis_size,) + b.shape)
    return _div_barrier(a, b), True


def ieee_div(a: Any, b: Any) -> jax.Array:
    """Correctly rounded float32 ``a / b`` of arrays under ``jit`` and ``vmap`` (no gradient): the divisor is hidden
    behind an ``optimization_barrier`` at its full, batched shape, which blocks the reciprocal rewrite."""
    a = lax.stop_gradient(jnp.asarray(a, jnp.float32))
    b = lax.stop_gradient(jnp.asarray(b, jnp.float32))
    return _div_barrier(*jnp.broadcast_arrays(a, b))  # full shapes here: the vmap rule prepends the batch axis


def materialize(a: jax.Array) -> jax.Array:
    """`a` unchanged, computed once into memory on CPU: XLA:CPU otherwise recomputes a cheap per-block value inside
    every consumer loop (16 times per block for a per-element consumer). An ``optimization_barrier`` on CPU only
    (``lax.platform_dependent``); on other backends the compiler's own fusion cost model decides."""
    return lax.platform_dependent(a, cpu=lax.optimization_barrier, default=lambda v: v)


def no_contract(t: jax.Array) -> jax.Array:
    """`t` (float32 >= 0 or NaN) unchanged, through an integer ``min`` with 0x7FFFFFFF: the adds that consume it
    then never see an ``fmul`` operand, so LLVM cannot fuse ``err + d*d`` into an FMA (docs/formats/nvfp4.md 8.2).
    The compiler cannot drop the ``min``: a NaN product may carry a sign bit."""
    bits = lax.bitcast_convert_type(t, jnp.uint32)
    return lax.bitcast_convert_type(jnp.minimum(bits, jnp.uint32(ABS)), jnp.float32)


def div_by_3_pow2(a: jnp.ndarray, k: int) -> jnp.ndarray:
    """``a / (3 * 2**k)`` correctly rounded (IEEE round-to-nearest-even) with integer ops only, for float32 `a`
    and int `k` in [0, 30]. The NVFP4 divisors are ``6 = 3*2`` and ``6*256 = 3*2^9``; Triton lowers f32 ``/`` to
    an approximate division, so the kernels use this (XLA programs use :func:`ieee_div`: one op to compile)::

        a = m * 2^e with m normalised to 24 bits;  n = m * 2^8 in [2^31, 2^32)
        q, r = divmod(n, 3)   ->  a / (3*2^k) = (q + r/3) * 2^(e - 8 - k),  q has 30 or 31 bits
        keep the top 24 bits of q (fewer below 2^-126: subnormal result), round to nearest even, where the
        discarded bits plus r/3 decide; r != 0 makes an exact half-way split impossible (the sticky bit).

    NaN and +-Inf pass through (Inf / 6 = Inf); +-0 stays +-0.
    """
    if not 0 <= k <= 30:
        raise ValueError(f"k must be in [0, 30]; got {k!r}")
    bits = lax.bitcast_convert_type(a, jnp.uint32)
    m, e = _normalised(bits)  # a = m * 2^e
    n = m << u32(8)
    q = n // u32(3)
    r = n - q * u32(3)
    length = jnp.where(q >= u32(1 << 30), 31, 30)
    eb = e - 8 - k + length - 1  # unbiased exponent of q's leading bit in the result
    return _round_quotient(bits, q, r != u32(0), length, eb)


def _normalised(bits: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(m, e) with |a| = m * 2^e and m in [2^23, 2^24) (m = 0 for zeros) from float32 bit patterns."""
    ef = (bits >> 23) & u32(0xFF)
    frac = bits & u32(0x7FFFFF)
    m = jnp.where(ef == 0, frac, frac | u32(0x800000))
    e = jnp.where(ef == 0, -149, ef.astype(jnp.int32) - 150)
    lz = jnp.where(m == 0, 0, lax.clz(m.astype(jnp.int32)) - 8)  # normalise subnormal significands
    return m << lz.astype(jnp.uint32), e - lz


def _round_quotient(bits, q, sticky, length, eb) -> jnp.ndarray:
    """float32 from a quotient `q` of `length` bits (leading bit at unbiased exponent `eb`) and a sticky flag (the
    exact quotient exceeds q): round to nearest even at 24 bits, or fewer for a subnormal result, Inf above the
    range; NaN, Inf, sign and zero handled from the dividend's `bits`."""
    d = length - 24 + jnp.maximum(-126 - eb, 0)  # bits to drop
    tiny = d > length  # below half the smallest subnormal: rounds to zero
    du = jnp.minimum(d, 31).astype(jnp.uint32)
    keep = q >> du
    rem = q & ((u32(1) << du) - u32(1))
    half = u32(1) << (du - u32(1))
    up = (rem > half) | ((rem == half) & (sticky | ((keep & u32(1)) == u32(1))))
    keep = keep + up.astype(jnp.uint32)
    mag = jnp.where(eb >= -126, ((eb + 126).astype(jnp.uint32) << u32(23)) + keep, keep)  # a carry moves the exponent
    mag = jnp.where(eb > 127, u32(BITS_INF), mag)  # overflow (a carry into exponent 255 gives Inf bits too)
    mag = jnp.where(tiny | (q == u32(0)), u32(0), mag)
    mag = jnp.where(((bits >> 23) & u32(0xFF)) == u32(0xFF), bits & u32(ABS), mag)  # NaN, Inf unchanged
    return lax.bitcast_convert_type((bits & u32(SIGN)) | mag, jnp.float32)


def div_const(a: jax.Array, c: float) -> jax.Array:
    """``a / c`` correctly rounded (IEEE round-to-nearest-even, subnormal results included) for float32 `a` and a
    positive normal float32 constant `c`, with integer operations only, so every backend gives the same bits::

        c = 2^k:      a * 2^-k                   (exact)
        c = 3 * 2^k:  div_by_3_pow2(a, k)         (one integer division by 3)
        otherwise:    c = mc * 2^k (mc odd, normalised to 24 bits);  a = m * 2^e
                      Q = floor(m * 2^26 / mc) by long division in 8-bit digits,  sticky = remainder != 0
                      then round Q to 24 bits as div_by_3_pow2 does.
    """
    c32 = np.float32(c)
    if not (np.isfinite(c32) and c32 >= np.finfo(np.float32).tiny):
        raise ValueError(f"c must be a positive normal float32 constant; got {c!r}")
    mant, exp = np.frexp(np.float64(c32))  # c = mant * 2^exp, mant in [0.5, 1), 24 significant bits
    mc = int(mant * 2**24)
    k = exp - 24
    while mc % 2 == 0:
        mc //= 2
        k += 1
    if mc == 1:
        return a * np.float32(2.0**-k)  # multiplication by a power of two is exact (or rounds once to subnormal)
    if mc == 3 and 0 <= k <= 30:
        return div_by_3_pow2(a, k)
    shift = 24 - mc.bit_length()
    mcn, kn = u32(mc << shift), k - shift  # c = mcn * 2^kn, mcn in [2^23, 2^24)
    bits = lax.bitcast_convert_type(a, jnp.uint32)
    m, e = _normalised(bits)
    q = m // mcn  # 0 or 1
    r = m - q * mcn
    for width in (8, 8, 8, 2):  # 26 more quotient bits, a digit at a time (r < 2^24, so r << 8 fits 32 bits)
        n = r << u32(width)
        digit = n // mcn
        r = n - digit * mcn
        q = (q << u32(width)) | digit
    length = jnp.where(q >= u32(1 << 26), 27, 26)
    eb = e - kn - 26 + length - 1  # a / c = (Q + r / mcn) * 2^(e - kn - 26)
    return _round_quotient(bits, q, r != u32(0), length, eb)
