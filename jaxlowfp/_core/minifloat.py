"""Element-format descriptors (HiF8, E4M3, E5M2, E2M1) and the E2M1 threshold rounding; public face:
:mod:`jaxlowfp.formats`. Rounding is explicit integer / threshold math on the float32 bit pattern."""
from __future__ import annotations

import abc
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlowfp._core import hif8
from jaxlowfp._core.bits import ABS, BITS_INF, BITS_NAN, SIGN, f32_bits, pow2, u32
from jaxlowfp._core.checks import float_dtype, float_input, uint8_codes

__all__ = ["ElementFormat", "MiniFloat", "HIF8", "E4M3", "E5M2", "E2M1", "E2M1_THRESHOLDS", "FORMATS", "get",
           "e2m1_index", "e2m1_value", "e2m1_magnitude"]


# E2M1 round-to-nearest-even by threshold counting (docs/formats/nvfp4.md 2.1): the index 0..7 of the magnitude grid
# {0, .5, 1, 1.5, 2, 3, 4, 6} is the number of thresholds passed. At a tie the comparison is ">=" where the upper
# neighbour has the even code (idx 2, 4, 6) and ">" where the lower one has. Anything above 5 (Inf too) saturates
# to 6; NaN passes no threshold and gives 0.
E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_index(ay: jnp.ndarray) -> jnp.ndarray:
    """E2M1 magnitude index (int32, 0..7) of ``|y|`` = `ay` (float32 >= 0): RNE, saturating at 6, NaN -> 0.

    Seven compares and a sum; no division, no ``round``, so it is bit-identical under any compiler.
    """
    idx = jnp.zeros(ay.shape, jnp.int32)
    for t, inclusive in E2M1_THRESHOLDS:
        idx = idx + ((ay >= t) if inclusive else (ay > t)).astype(jnp.int32)
    return idx


def e2m1_magnitude(ay: jnp.ndarray) -> jnp.ndarray:
    """RNE E2M1 magnitude (float32) of ``|y|`` = `ay` >= 0, saturating at 6, NaN -> 0: the same seven compares as
    :func:`e2m1_index`, each selecting the next grid value (cheaper than index -> value on the hot path)."""
    v = jnp.zeros(ay.shape, jnp.float32)
    for (t, inclusive), g in zip(E2M1_THRESHOLDS, (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)):
        v = jnp.where((ay >= t) if inclusive else (ay > t), g, v)
    return v


def e2m1_value(idx: jnp.ndarray) -> jnp.ndarray:
    """float32 magnitude of E2M1 index `idx` (0..7): 0, .5, 1, 1.5 = idx/2; then 2, 3, 4, 6 = 2^(e-1)*(1+m/2)."""
    e = idx >> 1
    normal = pow2(jnp.maximum(e, 1) - 1) * (1.0 + 0.5 * (idx & 1).astype(jnp.float32))
    return jnp.where(idx < 2, 0.5 * idx.astype(jnp.float32), normal)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElementFormat(abc.ABC):
    """An 8- or 4-bit element format: range constants, default clip targets and the codec.

    Attributes:
      name: short lookup name ("hif8", "e4m3", ...).
      bits: code width (8, 6 or 4); codes are always stored one per uint8.
      max_finite, min_normal, min_subnormal: the representable range (positive magnitudes).
      default_target_max: the clip bound / scale target for weights and activations in QAT recipes.
      default_grad_target_max: the same for gradients.
      has_inf, has_nan: whether the format has Inf and NaN codes.
    """

    name: str
    bits: int
    max_finite: float
    min_normal: float
    min_subnormal: float
    default_target_max: float
    default_grad_target_max: float
    has_inf: bool
    has_nan: bool

    def __post_init__(self) -> None:
        if self.bits not in (4, 6, 8):
            raise ValueError(f"bits must be 4, 6 or 8; got {self.bits!r}")
        if not 0 < self.min_subnormal <= self.min_normal < self.max_finite:
            raise ValueError(
                f"need 0 < min_subnormal <= min_normal < max_finite; got {self.min_subnormal}, {self.min_normal}, "
                f"{self.max_finite}"
            )
        for f in ("default_target_max", "default_grad_target_max"):
            v = getattr(self, f)
            if not 0 < v <= self.max_finite:
                raise ValueError(f"{f} must be in (0, max_finite={self.max_finite}]; got {v!r}")

    @abc.abstractmethod
    def encode(self, x: Any, *, saturate: bool = False) -> jax.Array:
        """Codes (uint8) of float32/bfloat16/float16 `x`."""
        raise NotImplementedError

    @abc.abstractmethod
    def decode(self, codes: Any, dtype: Any = jnp.float32) -> jax.Array:
        """Values of uint8 `codes` in `dtype` (float32/bfloat16/float16 hold every value of these formats)."""
        raise NotImplementedError

    @abc.abstractmethod
    def round(self, x: Any, *, saturate: bool = False) -> jax.Array:  # noqa: A003
        """Nearest representable value of `x`, in `x`'s dtype (computed directly, not via codes)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class _HiF8(ElementFormat):
    """HiF8 (tapered 8-bit float); everything delegates to :mod:`jaxlowfp.hif8` (TA rounding)."""

    def encode(self, x: Any, *, saturate: bool = False) -> jax.Array:
        return hif8.encode(x, saturate=saturate)

    def decode(self, codes: Any, dtype: Any = jnp.float32) -> jax.Array:
        return hif8.decode(codes, dtype)

    def round(self, x: Any, *, saturate: bool = False) -> jax.Array:  # noqa: A003
        return hif8.round(x, saturate=saturate)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MiniFloat(ElementFormat):
    """An OCP-style minifloat ``sign | exponent | mantissa`` with round-to-nearest-even.

    ``value = (-1)^s * 2^(E - bias) * (1 + M / 2^m)`` for E > 0, ``(-1)^s * M * min_subnormal`` for E == 0.
    `specials` says which top codes are not finite: "fn" (all-ones code is NaN, no Inf: E4M3), "ieee" (all-ones
    exponent is Inf / NaN: E5M2) or "none" (every code finite: E2M1).
    """

    exponent_bits: int
    mantissa_bits: int
    bias: int
    specials: str

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.specials not in ("fn", "ieee", "none"):
            raise ValueError(f"specials={self.specials!r} is not supported; allowed: 'fn', 'ieee', 'none'")
        if 1 + self.exponent_bits + self.mantissa_bits != self.bits:
            raise ValueError(
                f"1 + exponent_bits + mantissa_bits must equal bits={self.bits}; got "
                f"{self.exponent_bits} + {self.mantissa_bits}"
            )

    @property
    def _emin(self) -> int:
        return 1 - self.bias

    def _round_parts(self, x: jnp.ndarray):
        """(sign bits, rounded |x| as float32 before overflow handling, is_nan) of float32 `x`.

        RNE on the 24-bit significand: drop ``d = 23 - m + max(emin - e, 0)`` bits (the second term widens the
        quantum to the subnormal step below min_normal), then rescale the integer by the quantum, exactly.
        """
        bits = f32_bits(x)
        sign = bits & u32(SIGN)
        mag = bits & u32(ABS)
        is_nan = mag > u32(BITS_INF)
        e = (mag >> 23).astype(jnp.int32) - 127  # float32 zeros/subnormals: -127, far below every emin here
        m = self.mantissa_bits
        d = jnp.minimum(23 - m + jnp.maximum(self._emin - e, 0), 31).astype(jnp.uint32)
        sig = (mag & u32(0x7FFFFF)) | u32(0x800000)
        odd = (sig >> d) & u32(1)
        r = (sig + (u32(1) << (d - u32(1))) - u32(1) + odd) >> d  # d >= 25 leaves r == 0
        rounded = r.astype(jnp.float32) * pow2(jnp.maximum(e, self._emin) - m)  # exact (Inf for Inf input)
        return sign, rounded, is_nan

    def _overflow_bits(self, saturate: bool) -> int:
        if saturate or self.specials == "none":
            return int(np.float32(self.max_finite).view(np.uint32))
        return BITS_NAN if self.specials == "fn" else BITS_INF

    def round(self, x: Any, *, saturate: bool = False) -> jax.Array:  # noqa: A003
        """Nearest value of `x` in `x`'s dtype. NaN stays NaN (also for E2M1, whose *codes* have no NaN)."""
        return self._round(float_input(x, "x"), saturate)

    # The codec's bodies are jitted after the arguments are checked (the format itself static: a frozen, hashable
    # dataclass): an eager call compiles one program per shape, not each of its operations; a caller's jit
    # inlines them.
    @functools.partial(jax.jit, static_argnums=(0, 2))
    def _round(self, x: jax.Array, saturate: bool) -> jax.Array:
        sign, rounded, is_nan = self._round_parts(x)
        out = sign | f32_bits(rounded)
        out = jnp.where(rounded > self.max_finite, sign | u32(self._overflow_bits(saturate)), out)
        out = jnp.where(is_nan, u32(BITS_NAN), out)
        return lax.bitcast_convert_type(out, jnp.float32).astype(x.dtype)

    def _nan_code(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.specials == "fn" else (0x7E if self.specials == "ieee" else 0)

    def encode(self, x: Any, *, saturate: bool = False) -> jax.Array:
        """uint8 codes of `x` (4-bit formats in the low nibble). NaN -> the format's NaN with x's sign (E2M1: 0)."""
        return self._encode(float_input(x, "x"), saturate)

    @functools.partial(jax.jit, static_argnums=(0, 2))
    def _encode(self, x: jax.Array, saturate: bool) -> jax.Array:
        sign, rounded, is_nan = self._round_parts(x)
        m, top = self.mantissa_bits, self.bits - 1
        rb = f32_bits(rounded)
        e = (rb >> 23).astype(jnp.int32) - 127
        normal = ((e + self.bias) << m) | ((rb & u32(0x7FFFFF)) >> (23 - m)).astype(jnp.int32)
        sub = (rounded * (2.0 ** (m - self._emin))).astype(jnp.int32)  # integer multiple of min_subnormal
        mag = jnp.where(e < self._emin, sub, normal)
        max_code = self.max_code
        if saturate or self.specials == "none":
            ovf = max_code
        else:
            ovf = (1 << top) - 1 if self.specials == "fn" else max_code + 1  # NaN (E4M3) / Inf (E5M2)
        mag = jnp.where(rounded > self.max_finite, ovf, mag)
        code = (sign >> (32 - self.bits)).astype(jnp.int32) | mag
        if self.specials == "none":
            code = jnp.where(is_nan, 0, code)
        else:
            code = jnp.where(is_nan, (sign >> (32 - self.bits)).astype(jnp.int32) | self._nan_code(), code)
        return code.astype(jnp.uint8)

    @property
    def max_code(self) -> int:
        """Code of +max_finite."""
        frac, exp = math.frexp(self.max_finite)  # max_finite = (2 * frac) * 2^(exp - 1), 2 * frac in [1, 2)
        return ((exp - 1 + self.bias) << self.mantissa_bits) | int((2 * frac - 1) * 2**self.mantissa_bits)

    def decode(self, codes: Any, dtype: Any = jnp.float32) -> jax.Array:
        """Values of `codes` in `dtype`. For 4-bit formats only the low nibble is read."""
        return self._decode(uint8_codes(codes), float_dtype(dtype))

    @functools.partial(jax.jit, static_argnums=(0, 2))
    def _decode(self, codes: jax.Array, dtype: Any) -> jax.Array:
        m, top = self.mantissa_bits, self.bits - 1
        c = codes.astype(jnp.int32) & ((1 << self.bits) - 1)
        mag = c & ((1 << top) - 1)
        ef = mag >> m
        mant = mag & ((1 << m) - 1)
        normal = lax.bitcast_convert_type(
            (((ef - self.bias + 127) << 23) | (mant << (23 - m))).astype(jnp.uint32), jnp.float32
        )
        val = jnp.where(ef == 0, mant.astype(jnp.float32) * self.min_subnormal, normal)
        if self.specials == "fn":
            val = jnp.where(mag == (1 << top) - 1, jnp.nan, val)
        elif self.specials == "ieee":
            all_ones = ef == (1 << self.exponent_bits) - 1
            val = jnp.where(all_ones, jnp.where(mant == 0, jnp.inf, jnp.nan), val)
        val = jnp.where((c >> top) == 1, -val, val)
        return val.astype(dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _E2M1(MiniFloat):
    """E2M1 with the threshold-count rounding (:func:`e2m1_index`), the form the NVFP4 hot path shares."""

    def _round_parts(self, x: jnp.ndarray):
        bits = f32_bits(x)
        ay = lax.bitcast_convert_type(bits & u32(ABS), jnp.float32)
        return bits & u32(SIGN), e2m1_magnitude(ay), jnp.isnan(ay)

    @functools.partial(jax.jit, static_argnums=(0, 2))
    def _encode(self, x: jax.Array, saturate: bool) -> jax.Array:
        bits = f32_bits(x)
        ay = lax.bitcast_convert_type(bits & u32(ABS), jnp.float32)
        code = (bits >> 28).astype(jnp.int32) & 8 | e2m1_index(ay)
        return jnp.where(jnp.isnan(ay), 0, code).astype(jnp.uint8)


HIF8 = _HiF8(
    name="hif8", bits=8, max_finite=hif8.MAX, min_normal=hif8.MIN_NORMAL, min_subnormal=hif8.MIN_SUBNORMAL,
    default_target_max=15.0, default_grad_target_max=224.0, has_inf=True, has_nan=True,
)
E4M3 = MiniFloat(
    name="e4m3", bits=8, max_finite=448.0, min_normal=2.0**-6, min_subnormal=2.0**-9,
    default_target_max=448.0, default_grad_target_max=448.0, has_inf=False, has_nan=True,
    exponent_bits=4, mantissa_bits=3, bias=7, specials="fn",
)
E5M2 = MiniFloat(
    name="e5m2", bits=8, max_finite=57344.0, min_normal=2.0**-14, min_subnormal=2.0**-16,
    default_target_max=57344.0, default_grad_target_max=57344.0, has_inf=True, has_nan=True,
    exponent_bits=5, mantissa_bits=2, bias=15, specials="ieee",
)
E2M1 = _E2M1(
    name="e2m1", bits=4, max_finite=6.0, min_normal=1.0, min_subnormal=0.5,
    default_target_max=6.0, default_grad_target_max=6.0, has_inf=False, has_nan=False,
    exponent_bits=2, mantissa_bits=1, bias=1, specials="none",
)

FORMATS: dict[str, ElementFormat] = {f.name: f for f in (HIF8, E4M3, E5M2, E2M1)}


def get(name: str | ElementFormat) -> ElementFormat:
    """The descriptor for `name` ("hif8", "e4m3", "e5m2", "e2m1"; case-insensitive). An `ElementFormat` passes
    through."""
    if isinstance(name, ElementFormat):
        return name
    if not isinstance(name, str) or name.lower() not in FORMATS:
        raise ValueError(f"unknown format {name!r}; allowed: {', '.join(map(repr, FORMATS))}")
    return FORMATS[name.lower()]
