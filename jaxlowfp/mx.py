"""OCP Microscaling (MX) baselines: MXFP4 (E2M1 elements) and MXFP8 (E4M3 or E5M2), 32 elements per E8M0 scale.

Per block of 32 along the last axis, a power-of-two scale ``X = 2^e`` (``docs/formats/nvfp4.md`` section 6)::

    floor (OCP v1.0):  e = floor(log2(amax)) - emax_elem        emax_elem = 2 (E2M1), 8 (E4M3), 15 (E5M2)
    ceil  (RCEIL):     e = ceil(log2(amax / max_elem))           amax / max_elem one IEEE float32 division
                                                                 (integer-exact: bits.div_const)
    e clamped to [-127, 127] (amax == 0 -> -127);   P_i = round_elem_satfinite(x_i / X)   (RNE, exact scaling)
    x̂_i = P_i * X

``floor`` can saturate (amax = 7 -> X = 1, 7 -> 6); ``ceil`` never does but may waste up to one binade. A block with
NaN or Inf gets the NaN scale (0xFF) and dequantizes to NaN. MX is a baseline here: power-of-two scales cannot
express Four Over Six's x1.5. Note that XLA:CPU flushes float32 subnormals, so values below 2^-126 are zero.

>>> import jax.numpy as jnp
>>> from jaxlowfp import mx
>>> q = mx.quantize(jnp.linspace(-3.0, 3.0, 32, dtype=jnp.float32).reshape(1, 32))   # MXFP4, OCP floor rule
>>> q.codes.shape, q.scales.shape, str(q.scales.dtype)    # two codes a byte, one E8M0 scale per 32
((1, 16), (1, 1), 'float8_e8m0fnu')
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jaxlowfp import formats, registry
from jaxlowfp._core.bits import div_const, materialize, pow2
from jaxlowfp._core.checks import float_dtype, float_input, one_of
from jaxlowfp._core.deprecation import deprecated_getattr, renamed_kwarg
from jaxlowfp._core.nvfp4_blocks import block_amax, pack_nibbles
from jaxlowfp._core.format import MX_ELEMENT
from jaxlowfp._core.format import Format as _Format
from jaxlowfp._core.qarray import MXArray as _MXArray
from jaxlowfp._core.qarray import QArray

__all__ = ["MXConfig", "MXFormat", "MXRule", "FORMATS", "RULES", "BLOCK", "quantize", "dequantize",
           "fake_quantize", "shared_exponent"]

MXFormat = Literal["e2m1", "e4m3", "e5m2"]
MXRule = Literal["floor", "ceil"]
FORMATS = registry.MX_FORMATS  # the element format: "e2m1" (MXFP4), "e4m3" / "e5m2" (MXFP8)
RULES = registry.MX_RULES  # the shared exponent: "floor" (OCP) or "ceil" (RCEIL)
BLOCK = 32
# old names (one release): the keywords were elem= / scale_rule=, the lists ELEMENTS / SCALE_RULES; the same
# meaning is format= / rule= in jaxlowfp.if4 and jaxlowfp.nvfp4
_DEPRECATED = {"ELEMENTS": ("jaxlowfp.mx.FORMATS", lambda: FORMATS),
               "SCALE_RULES": ("jaxlowfp.mx.RULES", lambda: RULES),
               "MXArray": ("jaxlowfp.QArray", lambda: _MXArray)}
__getattr__ = deprecated_getattr(__name__, _DEPRECATED)
_EMAX = {"e2m1": 2, "e4m3": 8, "e5m2": 15}
_KIND = {e: k for k, e in MX_ELEMENT.items()}  # element format -> jaxlowfp.Format kind


@dataclasses.dataclass(frozen=True, kw_only=True)
class MXConfig:
    """MX settings. format: "e2m1" (MXFP4), "e4m3" or "e5m2" (MXFP8); rule: "floor" (OCP) or "ceil" (RCEIL)."""

    format: MXFormat = "e2m1"
    rule: MXRule = "floor"

    def __post_init__(self) -> None:
        one_of(self.format, FORMATS, "format")
        one_of(self.rule, RULES, "rule")

    @property
    def fmt(self) -> formats.MiniFloat:
        return formats.get(self.format)  # type: ignore[return-value]


def shared_exponent(blk_amax: jax.Array, format: str, rule: str) -> jax.Array:  # noqa: A002
    """int32 scale exponent e in [-127, 127] of float32 block maxima (see the module docstring); read from the
    float32 bits, so no log2 rounding. Non-finite maxima give 128 (the NaN scale)."""
    bits = lax.bitcast_convert_type(blk_amax, jnp.uint32)
    if rule == "floor":
        # floor(log2 a) = unbiased exponent for normals; subnormals (and 0) sit below -127 + emax: clamped anyway
        e = (bits >> 23).astype(jnp.int32) - 127 - _EMAX[format]
    else:
        r = lax.bitcast_convert_type(div_const(blk_amax, formats.get(format).max_finite), jnp.uint32)  # integer-exact
        biased, mant = (r >> 23).astype(jnp.int32), r & jnp.uint32(0x7FFFFF)
        e = biased - 127 + (mant != 0).astype(jnp.int32)  # ceil(log2 r) for normal r
        # subnormal r = mant * 2^-149: ceil(log2 r) is -126 if r > 2^-127, else <= -127 (clamped below)
        e = jnp.where(biased == 0, jnp.where(mant > jnp.uint32(1 << 22), -126, -127), e)
    e = jnp.clip(e, -127, 127)
    return jnp.where(jnp.isfinite(blk_amax), e, 128)


def _check_x(x: ArrayLike) -> jax.Array:
    x = float_input(x, "x")
    if x.ndim < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"the last axis of x (shape {x.shape}) must be a multiple of {BLOCK}")
    return x


@functools.partial(jax.jit, static_argnames=("cfg", "out"))
def _run(x: jax.Array, *, cfg: MXConfig, out: str):
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    e = materialize(shared_exponent(block_amax(xb, axes=(-1,)), cfg.format, cfg.rule))  # once per block
    xb = xb.astype(jnp.float32)
    # x / 2^e exactly (one rounding only if y is subnormal)
    y = xb * pow2(-jnp.minimum(e, 127), subnormal=True)[..., None]
    if out == "fake":
        scale = jnp.where(e == 128, jnp.nan, pow2(jnp.minimum(e, 127), subnormal=True))
        return (cfg.fmt.round(y, saturate=True) * scale[..., None]).reshape(x.shape).astype(x.dtype)
    codes = cfg.fmt.encode(y, saturate=True).reshape(x.shape)
    if cfg.format == "e2m1":
        codes = pack_nibbles(codes)
    scales = lax.bitcast_convert_type((e + 127).astype(jnp.uint8), jnp.float8_e8m0fnu)  # 128 + 127 = 0xFF: NaN
    return codes, scales


def _cfg(where: str, format: str, rule: str, elem: str | None, scale_rule: str | None) -> MXConfig:  # noqa: A002
    format = renamed_kwarg(where, "elem", elem, "format", format, "e2m1", stacklevel=5)  # noqa: A001
    rule = renamed_kwarg(where, "scale_rule", scale_rule, "rule", rule, "floor", stacklevel=5)
    return MXConfig(format=format, rule=rule)  # type: ignore[arg-type]


def quantize(x: ArrayLike, *, format: MXFormat = "e2m1", rule: MXRule = "floor",  # noqa: A002 (as if4.quantize)
             elem: str | None = None, scale_rule: str | None = None) -> QArray:
    """MX-quantize `x` (float32/bfloat16/float16, last axis a multiple of 32): `format` elements ("e2m1": MXFP4,
    "e4m3" / "e5m2": MXFP8), the shared exponent by `rule` ("floor": OCP, "ceil": RCEIL). ``elem=`` /
    ``scale_rule=`` are the deprecated names of ``format=`` / ``rule=``."""
    cfg = _cfg("mx.quantize", format, rule, elem, scale_rule)
    x = _check_x(x)
    codes, scales = _run(x, cfg=cfg, out="q")
    return QArray(codes=codes, scales=scales, global_scale=None, format=_Format(kind=_KIND[cfg.format], rule=cfg.rule),
                  dtype=x.dtype, shape=x.shape)


def dequantize(q: QArray, dtype: DTypeLike = jnp.float32) -> jax.Array:
    """``x̂ = P_i * 2^e`` in float32, cast to `dtype`."""
    if not isinstance(q, QArray) or q.format.kind not in MX_ELEMENT:
        got = f"a QArray of {q.format!r}" if isinstance(q, QArray) else type(q).__name__
        raise TypeError(f"mx.dequantize expects an MX jaxlowfp.QArray (mx.quantize's result); got {got}")
    return q.dequantize(float_dtype(dtype))


def fake_quantize(x: ArrayLike, *, format: MXFormat = "e2m1", rule: MXRule = "floor",  # noqa: A002
                  elem: str | None = None, scale_rule: str | None = None) -> jax.Array:
    """``dequantize(quantize(x, ...), x.dtype)`` bit for bit, without building codes (same arguments)."""
    cfg = _cfg("mx.fake_quantize", format, rule, elem, scale_rule)
    return _run(_check_x(x), cfg=cfg, out="fake")


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
