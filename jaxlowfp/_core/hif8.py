"""HiFloat8 (HiF8): Huawei's tapered 8-bit float, bit-exact, as pure `jnp` functions.

A HiF8 code is ``S | Dot | Em | M``: a prefix code ("Dot") gives the width D of a sign-magnitude exponent with a
hidden leading 1, and the mantissa gets what is left of the 7 payload bits::

    |E| <= 3   -> 3 mantissa bits        |E| <= 7 -> 2 bits        |E| <= 15 -> 1 bit
    2^-22 ... 2^-16                       power-of-two denormals ("DML")
    value = (-1)^S * 2^E * (1 + M / 2^m),  max finite 2^15 = 32768 (0x6E),  +-Inf 0x6F/0xEF,  NaN 0x80

Default rounding ("TA") is round to nearest, ties away from zero, within the input's binade (both ends of every
binade are representable, so this is the nearest value overall). ``|x| >= 40960`` overflows to Inf (or to 32768
with ``saturate=True``); ``|x| < 2^-23`` and negative values that round to zero give the unsigned zero 0x00.

Everything works on the float32 bit pattern (``bitcast`` to uint32, integer add and mask), so XLA cannot elide or
re-associate the rounding. float16 and bfloat16 inputs widen exactly to float32 first. See ``docs/formats/hif8.md``.
"""
from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from jaxlowfp._core.bits import ABS, BITS_INF, BITS_NAN, SIGN, f32_bits, u32
from jaxlowfp._core.checks import float_dtype, float_input, one_of, uint8_codes

__all__ = ["encode", "decode", "round", "all_values", "MAX", "MIN_NORMAL", "MIN_SUBNORMAL", "NAN_CODE", "INF_CODE",
           "MAX_CODE", "OVERFLOW_THRESHOLD", "ROUNDINGS"]

MAX = 32768.0  # 2^15, code 0x6E
MIN_NORMAL = 2.0**-15  # code 0x7E
MIN_SUBNORMAL = 2.0**-22  # code 0x01
NAN_CODE = 0x80
INF_CODE = 0x6F
MAX_CODE = 0x6E
OVERFLOW_THRESHOLD = 40960.0  # 1.25 * 2^15: midpoint between 32768 and the code 0x6F would hold; ties go to Inf

Rounding = Literal["ta", "hybrid"]
ROUNDINGS = ("ta", "hybrid")

_BITS_49152 = (127 + 15) << 23 | 0x400000  # 1.5 * 2^15: first magnitude past the finite range
_BITS_32768 = (127 + 15) << 23
_BITS_40960 = (127 + 15) << 23 | 0x200000
_BITS_2M22 = (127 - 22) << 23


def _mantissa_bits(e: jnp.ndarray) -> jnp.ndarray:
    """Mantissa width m for unbiased exponent e: 3 / 2 / 1 for |e| <= 3 / 7 / 15, else 0 (denormals)."""
    a = jnp.abs(e)
    return jnp.where(a <= 3, 3, jnp.where(a <= 7, 2, jnp.where(a <= 15, 1, 0))).astype(jnp.int32)


def _round_ta_bits(mag: jnp.ndarray) -> jnp.ndarray:
    """TA-rounded magnitude bits (uint32) for finite |x| bits, before overflow handling."""
    e = (mag >> 23).astype(jnp.int32) - 127
    sh = (23 - _mantissa_bits(e)).astype(jnp.uint32)
    half = u32(1) << (sh - u32(1))
    rounded = (mag + half) & ~((u32(1) << sh) - u32(1))  # adding half an ulp carries into the exponent
    rounded = jnp.where(e == -23, u32(_BITS_2M22), rounded)  # [2^-23, 2^-22) -> 2^-22 (tie at 2^-23 goes up)
    return jnp.where(e < -23, u32(0), rounded)  # also zeros and float32 subnormals


def _round_hybrid_bits(mag: jnp.ndarray) -> jnp.ndarray:
    """Hybrid ("HR", CAST_HYBRID) rounding of float32 magnitude bits: TA for |E| < 4, else the deterministic
    pseudo-stochastic "SSR" that rounds up iff the top 14 discarded bits >= the low 14 bits (docs/formats/hif8.md 6.2).
    Values with no discarded bits are exact and kept."""
    e = (mag >> 23).astype(jnp.int32) - 127
    frac = mag & u32(0x7FFFFF)
    sh = (23 - _mantissa_bits(e)).astype(jnp.uint32)  # discarded bits: 21 / 22 / 23
    rem = frac & ((u32(1) << sh) - u32(1))
    f14 = rem >> (sh - u32(14))
    t14 = rem & u32(0x3FFF)
    # Read literally, "f14 >= t14" would also move exact values (rem == 0) up a code; nothing is discarded
    # there, so they are kept as they are (no hardware trace was available to confirm either reading).
    up = ((f14 >= t14) & (rem != u32(0))).astype(jnp.uint32)
    ssr = (mag & ~((u32(1) << sh) - u32(1))) + (up << sh)  # a carry out of `keep` moves to the next binade
    # E = -23: keep is empty; the value rounds to 2^-22 or to zero.
    up23 = ((frac >> u32(10)) + u32(8192)) >= (frac & u32(0x3FFF))  # never exact: 2^-23 is not a code
    ssr = jnp.where(e == -23, jnp.where(up23, u32(_BITS_2M22), u32(0)), ssr)
    ssr = jnp.where(e < -23, u32(0), ssr)
    return jnp.where(jnp.abs(e) < 4, _round_ta_bits(mag), ssr)


def _rounded_parts(x: jnp.ndarray, rounding: str):
    """(sign bits, rounded magnitude bits, is_nan, overflows) of float32 `x`."""
    bits = f32_bits(x)
    sign = bits & u32(SIGN)
    mag = bits & u32(ABS)
    is_nan = mag > u32(BITS_INF)
    rounded = _round_hybrid_bits(mag) if rounding == "hybrid" else _round_ta_bits(mag)
    e = (mag >> 23).astype(jnp.int32) - 127
    # |x| >= 40960 overflows in both modes (TA: it rounds to 49152, the Inf code's value); includes +-Inf inputs
    overflow = (e > 15) | (rounded >= u32(_BITS_49152)) | (mag >= u32(_BITS_40960))
    return sign, rounded, is_nan, overflow


def _check(x, rounding: str, what: str) -> jnp.ndarray:
    one_of(rounding, ROUNDINGS, "rounding")
    x = float_input(x, what)
    if rounding == "hybrid" and x.dtype != jnp.float32:
        raise TypeError(
            f"rounding='hybrid' is defined bit-exactly for float32 inputs only (float16 uses a different SSR rule "
            f"that jaxlowfp does not implement); got {x.dtype}. Use x.astype(jnp.float32) or rounding='ta'."
        )
    return x


def round(x, *, saturate: bool = False, rounding: Rounding = "ta") -> jnp.ndarray:  # noqa: A001
    """Nearest HiF8 value of `x`, in `x`'s dtype; equal to ``decode(encode(x), x.dtype)`` bit for bit.

    NaN stays NaN, +-Inf and ``|x| >= 40960`` give +-Inf (``saturate=True``: +-32768); results that round to zero
    are +0 (HiF8 has a single zero).
    """
    return _round(_check(x, rounding, "x"), saturate, rounding)


# The codec's bodies are jitted after the arguments are checked: an eager call compiles one program per shape and
# dtype instead of each of its ~30 operations; inside a caller's jit they are inlined.
@functools.partial(jax.jit, static_argnums=(1, 2))
def _round(x: jax.Array, saturate: bool, rounding: str) -> jax.Array:
    sign, rounded, is_nan, overflow = _rounded_parts(x, rounding)
    ovf_bits = sign | u32(_BITS_32768 if saturate else BITS_INF)
    out = jnp.where(rounded == u32(0), u32(0), sign | rounded)
    out = jnp.where(overflow, ovf_bits, out)
    out = jnp.where(is_nan, u32(BITS_NAN), out)
    return lax.bitcast_convert_type(out, jnp.float32).astype(x.dtype)


def _pack_codes(rounded: jnp.ndarray) -> jnp.ndarray:
    """HiF8 payload (bits 6..0, int32) of a nonzero, finite, already-rounded float32 magnitude."""
    e = (rounded >> 23).astype(jnp.int32) - 127
    man = (rounded & u32(0x7FFFFF)).astype(jnp.int32)
    a = jnp.abs(e)
    m = jnp.where(a <= 3, 3, jnp.where(a <= 7, 2, 1))
    q = man >> (23 - m)
    d = jnp.where(a == 1, 1, jnp.where(a <= 3, 2, jnp.where(a <= 7, 3, 4)))
    dot = jnp.where(d == 1, 0x10, jnp.where(d == 2, 0x20, jnp.where(d == 3, 0x40, 0x60)))
    hidden = 1 << jnp.maximum(d - 1, 0)
    em = jnp.where(e < 0, hidden, 0) | (a - hidden)  # exponent sign in the MSB of Em, hidden leading 1 dropped
    code = dot | (em << m) | q
    code = jnp.where(e == 0, 0x08 | q, code)
    return jnp.where(e <= -16, e + 23, code)  # DML: 0000 MMM with value 2^(M-23)


def encode(x, *, saturate: bool = False, rounding: Rounding = "ta") -> jnp.ndarray:
    """HiF8 codes (uint8) of float32/bfloat16/float16 `x`: TA rounding (round half away from zero).

    NaN -> 0x80; +-Inf and ``|x| >= 40960`` -> 0x6F/0xEF (``saturate=True``: 0x6E/0xEE, +-32768); any value that
    rounds to zero -> 0x00 (sign dropped).
    """
    return _encode(_check(x, rounding, "x"), saturate, rounding)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _encode(x: jax.Array, saturate: bool, rounding: str) -> jax.Array:
    sign, rounded, is_nan, overflow = _rounded_parts(x, rounding)
    sign8 = (sign >> 24).astype(jnp.int32)
    code = jnp.where(rounded == u32(0), 0, sign8 | _pack_codes(rounded))
    code = jnp.where(overflow, sign8 | (MAX_CODE if saturate else INF_CODE), code)
    code = jnp.where(is_nan, NAN_CODE, code)
    return code.astype(jnp.uint8)


def decode(codes, dtype=jnp.float32) -> jnp.ndarray:
    """Values of HiF8 `codes` (uint8) in `dtype` (float32/bfloat16/float16 hold every HiF8 value exactly)."""
    return _decode(uint8_codes(codes, "HiF8 codes"), float_dtype(dtype))


@functools.partial(jax.jit, static_argnums=1)
def _decode(codes: jax.Array, dtype: Any) -> jax.Array:
    c = codes.astype(jnp.int32)
    s = c & 0x80
    p = c & 0x7F
    d = jnp.where(p < 0x10, 0, jnp.where(p < 0x20, 1, (p >> 5) + 1))
    m = jnp.where(d <= 2, 3, 5 - d)
    mant = p & ((1 << m) - 1)
    em = (p >> m) & ((1 << d) - 1)
    hidden = 1 << jnp.maximum(d - 1, 0)
    mag = hidden | (em & (hidden - 1))
    e = jnp.where(d == 0, 0, jnp.where((em & hidden) != 0, -mag, mag))
    normal = ((e + 127) << 23) | (mant << (23 - m))
    dml = jnp.where(p == 0, 0, (p - 23 + 127) << 23)
    bits = jnp.where(p < 0x08, dml, normal)
    bits = jnp.where(p == INF_CODE, BITS_INF, bits).astype(jnp.uint32)
    bits = bits | (s.astype(jnp.uint32) << 24)
    bits = jnp.where(c == NAN_CODE, u32(BITS_NAN), bits)
    return lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


def all_values(dtype=jnp.float32) -> jax.Array:
    """The 256 decoded code values, indexed by code (NaN at 0x80, +-Inf at 0x6F/0xEF)."""
    return decode(jnp.arange(256, dtype=jnp.uint8), dtype)
