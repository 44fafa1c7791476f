"""Correctly rounded float32 division by ``3 * 2^k`` with integer ops only (for Pallas-Triton kernels).

Triton lowers f32 ``/`` to the approximate ``div.full.f32`` (up to 2 ulp), and XLA rewrites ``x / c`` into
``x * (1/c)``; the jnp twins therefore divide with an IEEE division kept by ``optimization_barrier``. The NVFP4
divisors are ``6 = 3*2`` and ``6*256 = 3*2^9``, so the kernels reproduce ``fl(a / (3*2^k))`` exactly:

    a = m * 2^e with m normalised to 24 bits;  n = m * 2^8 in [2^31, 2^32)
    q, r = divmod(n, 3)              ->  a / (3*2^k) = (q + r/3) * 2^(e - 8 - k),  q has 30 or 31 bits
    keep the top 24 bits of q (fewer below 2^-126: subnormal result) and round to nearest even, where the
    discarded bits plus r/3 decide; r != 0 makes an exact half-way split impossible (the sticky bit).

NaN and +-Inf pass through (Inf / 6 = Inf); +-0 stays +-0.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["div_by_3_pow2"]


def _u32(v: int) -> jnp.ndarray:
    return jnp.uint32(v)


def div_by_3_pow2(a: jnp.ndarray, k: int) -> jnp.ndarray:
    """``a / (3 * 2**k)`` correctly rounded (IEEE round-to-nearest-even), for float32 `a` and int `k` in [0, 30]."""
    if not 0 <= k <= 30:
        raise ValueError(f"k must be in [0, 30]; got {k!r}")
    bits = lax.bitcast_convert_type(a, jnp.uint32)
    sign = bits & _u32(0x80000000)
    ef = (bits >> 23) & _u32(0xFF)
    frac = bits & _u32(0x7FFFFF)
    m = jnp.where(ef == 0, frac, frac | _u32(0x800000))  # a = m * 2^e
    e = jnp.where(ef == 0, -149, ef.astype(jnp.int32) - 150)
    lz = jnp.where(m == 0, 0, lax.clz(m.astype(jnp.int32)) - 8)  # normalise subnormal significands (m < 2^24)
    m = m << lz.astype(jnp.uint32)
    e = e - lz
    n = m << _u32(8)
    q = n // _u32(3)
    r = n - q * _u32(3)
    length = jnp.where(q >= _u32(1 << 30), 31, 30)
    eb = e - 8 - k + length - 1  # unbiased exponent of q's leading bit in the result
    d = length - 24 + jnp.maximum(-126 - eb, 0)  # bits to drop: 6 or 7, more for a subnormal result
    tiny = d > length  # below half the smallest subnormal: rounds to zero
    du = jnp.minimum(d, 31).astype(jnp.uint32)
    keep = q >> du
    rem = q & ((_u32(1) << du) - _u32(1))
    half = _u32(1) << (du - _u32(1))
    up = (rem > half) | ((rem == half) & ((r != _u32(0)) | ((keep & _u32(1)) == _u32(1))))
    keep = keep + up.astype(jnp.uint32)
    normal = eb >= -126
    mag = jnp.where(normal, ((eb + 126).astype(jnp.uint32) << _u32(23)) + keep, keep)  # carry moves the exponent
    mag = jnp.where(tiny | (m == _u32(0)), _u32(0), mag)
    mag = jnp.where(ef == _u32(0xFF), bits & _u32(0x7FFFFFFF), mag)  # NaN, Inf unchanged
    return lax.bitcast_convert_type(sign | mag, jnp.float32)
