"""HiFloat8 (HiF8): Huawei's tapered 8-bit float, bit-exact, as pure `jnp` functions.

A HiF8 code is ``S | Dot | Em | M``: a prefix code ("Dot") gives the width D of a sign-magnitude exponent, and the
mantissa gets what is left of the 7 payload bits (3 bits for ``|E| <= 3``, 2 for ``|E| <= 7``, 1 for ``|E| <= 15``,
power-of-two denormals 2^-22 .. 2^-16). Max finite 32768 (0x6E), +-Inf 0x6F/0xEF, NaN 0x80. Rounding "TA": to
nearest, ties away from zero; ``|x| >= 40960`` overflows to Inf (32768 with ``saturate=True``). See
``docs/formats/hif8.md``; the bit math lives in ``jaxlowfp._core.hif8`` (shared with the Pallas kernel).

>>> import jax.numpy as jnp
>>> from jaxlowfp import hif8
>>> hif8.round(jnp.float32([1.0625, 17.0, 50000.0])).tolist()   # 3-bit mantissa up to 15, 2 bits up to 224
[1.125, 16.0, inf]
>>> hex(int(hif8.encode(jnp.float32(1.0))))
'0x8'
"""
from jaxlowfp._core.surface import public_dir as _public_dir
from jaxlowfp._core.hif8 import (
    INF_CODE,
    MAX,
    MAX_CODE,
    MIN_NORMAL,
    MIN_SUBNORMAL,
    NAN_CODE,
    OVERFLOW_THRESHOLD,
    ROUNDINGS,
    all_values,
    decode,
    encode,
    round,
)

__all__ = ["encode", "decode", "round", "all_values", "MAX", "MIN_NORMAL", "MIN_SUBNORMAL", "NAN_CODE", "INF_CODE",
           "MAX_CODE", "OVERFLOW_THRESHOLD", "ROUNDINGS"]


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
