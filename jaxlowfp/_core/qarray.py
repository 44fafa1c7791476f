"""One quantized array: :class:`QArray` (codes, block scales, a global scale and the :class:`~jaxlowfp.Format`).

Every quantizer of the library returns one (``jaxlowfp.quantize``, ``nvfp4.quantize``, ``if4.quantize``,
``mx.quantize``, ``packed.scaled_quantize``, the Pallas kernels), and ``q.dequantize()`` decodes it with the decode
step of the quantizer that made it, so it equals the fake-quantized tensor of the same format bit for bit. By
``format.kind``, with codes ``q`` (element 2j of a 4-bit layout in the low nibble of byte j)::

    kind           codes                              scales               global_scale  x̂
    nvfp4          uint8 [..., K/2], E2M1 sign<<3|idx  E4M3 [..., K/16] (1) S_dec         (q * s) * S_dec
    if4, if6_e2m3, IF4: uint8 [..., K/2]; IF6 / IF3:   flagged E4M3 (2)     S_dec         FP block: (q * |s|) * S_dec
    if6_e3m2, if3  uint8 [..., K], sign<<(b-1)|mag                                        INT block:
                                                                                          ((q * |s|) * step) * S_dec
    mxfp4, mxfp8,  E2M1: uint8 [..., K/2]; E4M3 /      E8M0 [..., K/32]     None          q * 2^e (0xFF: NaN)
    mxfp8_e5m2     E5M2: uint8 [..., K]
    fp8            float8_e4m3fn, x's shape            None                 s = amax/448  f32(q) * s
    hif8           uint8 HiF8 codes, x's shape         None                 s = amax/15   HiF8(q) * s

(1) [..., M/16, K/16] for 16x16 tiles. (2) the sign bit of an E4M3 scale flags an INT block (arXiv 2603.28765, as
fouroversix stores it). NVFP4's ``S_dec = 1 / S_enc`` with ``S_enc = (6 * 448) / amax`` (NVIDIA's two-level
scaling); the compressed-tensors arithmetic's decode ``q * (s / g)`` needs the encode scale ``g`` itself, which
``jaxlowfp.packed.PackedWeight.s_enc`` carries: ``QArray.dequantize`` decodes ``(q * s) * S_dec``.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlowfp._core import if4_blocks, minifloat, nvfp4_blocks
from jaxlowfp._core.bits import pow2
from jaxlowfp._core.checks import float_dtype
from jaxlowfp._core.format import IF_KINDS, MX_ELEMENT, PER_TENSOR, Format
from jaxlowfp._core.pytree import pytree_dataclass

__all__ = ["QArray", "kernel_array", "mx_decode"]


@pytree_dataclass(data=("codes", "scales", "global_scale"), meta=("format", "dtype", "shape"))
class QArray:
    """A quantized tensor (pytree), for every format (module docstring: the layouts and the decode of each kind).

    Attributes:
      codes: uint8 codes (two 4-bit codes a byte, element 2j in the low nibble), or float8_e4m3fn for FP8.
      scales: the block scales: float8_e4m3fn (NVFP4, IF), float8_e8m0fnu (MX); None for FP8 / HiF8.
      global_scale: float32 scalar decode scale: ``S_dec`` (NVFP4, IF), the per-tensor scale (FP8, HiF8); None
        for MX.
      format: the :class:`~jaxlowfp.Format` (static): kind, rule, block shape, arithmetic.
      dtype, shape: the original dtype and shape (static).
    """

    codes: jax.Array
    scales: jax.Array | None
    global_scale: jax.Array | None
    format: Format
    dtype: Any
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.format, Format):
            raise TypeError(f"QArray.format must be a jaxlowfp.Format; got {type(self.format).__name__}: "
                            f"{self.format!r}")

    def dequantize(self, dtype: Any = None) -> jax.Array:
        """The values in `dtype` (default: the original dtype), computed in float32 (module docstring)."""
        dtype = float_dtype(self.dtype if dtype is None else dtype)
        kind = self.format.kind
        if kind == "nvfp4":
            return nvfp4_blocks.dequantize_blocks(self.codes, self.scales, self.global_scale, rows=self.format.rows,
                                                  shape=self.shape, dtype=dtype)
        if kind in IF_KINDS:
            return if4_blocks.dequantize_blocks(self.codes, self.scales, self.global_scale, fmt=kind,
                                                rows=self.format.rows, shape=self.shape, dtype=dtype)
        if kind in MX_ELEMENT:
            return mx_decode(self.codes, block_scales(self), fmt=MX_ELEMENT[kind], shape=self.shape, dtype=dtype)
        assert self.global_scale is not None  # a per-tensor format's array carries one
        return (self.values() * self.global_scale).astype(dtype)

    def values(self) -> jax.Array:
        """FP8 / HiF8: the element values ``f32(q)`` (exact)."""
        if not self.format.per_tensor:
            raise ValueError(f"values() reads the codes of a per-tensor format (fp8, hif8); this is {self.format!r}")
        if PER_TENSOR[self.format.kind][0] == "hif8":
            return minifloat.HIF8.decode(self.codes, jnp.float32)
        return self.codes.astype(jnp.float32)

    @property
    def rule(self) -> str | None:
        """The format's block-scale rule (None for FP8 / HiF8)."""
        return self.format.rule

    @property
    def block_shape(self) -> tuple[int, int] | None:
        """NVFP4 / IF: (1, 16) or (16, 16); None otherwise."""
        return self.format.block_shape

    @property
    def is_int(self) -> jax.Array:
        """IF: bool per block, the block uses the INT grid (the scale's sign bit)."""
        if self.format.kind not in IF_KINDS:
            raise ValueError(f"is_int is the INT-block flag of the IF formats; this is {self.format!r}")
        assert self.scales is not None  # an IF array carries its block scales
        return (lax.bitcast_convert_type(self.scales, jnp.uint8) >> 7) == 1

    @property
    def scale(self) -> jax.Array:
        """FP8 / HiF8: the per-tensor decode scale (= :attr:`global_scale`)."""
        if not self.format.per_tensor:
            raise ValueError(f"scale is the per-tensor scale of fp8 / hif8; this is {self.format!r} (its block "
                             f"scales are .scales, its tensor scale .global_scale)")
        return self.global_scale  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        """Bytes of every leaf (codes, scales, global scale)."""
        return int(sum(np.dtype(a.dtype).itemsize * math.prod(a.shape) for a in jax.tree.leaves(self)))


MX_BLOCK = 32


def block_scales(q: QArray) -> jax.Array:
    """The block scales of a block-scaled `q` (NVFP4, IF, MX); a ValueError for a per-tensor one (FP8, HiF8)."""
    if q.scales is None:
        raise ValueError(f"a {q.format.name} array has no block scales (only a per-tensor scale)")
    return q.scales


@functools.partial(jax.jit, static_argnames=("fmt", "shape", "dtype"))
def mx_decode(codes: jax.Array, scales: jax.Array, *, fmt: str, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """``P_i * 2^e`` of MX codes (uint8, E2M1 two a byte) and E8M0 scales (0xFF: NaN), `fmt` the element format
    ("e2m1", "e4m3", "e5m2"), in `dtype`: `jaxlowfp.mx`'s decode step."""
    if fmt == "e2m1":
        codes = nvfp4_blocks.unpack_nibbles(codes)
    v = minifloat.get(fmt).decode(codes).reshape(*shape[:-1], shape[-1] // MX_BLOCK, MX_BLOCK)
    sb = lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32)
    scale = jnp.where(sb == 255, jnp.nan, pow2(jnp.minimum(sb - 127, 127), subnormal=True))
    return (v * scale[..., None]).reshape(shape).astype(dtype)


def kernel_array(
    x: jax.Array, cfg: nvfp4_blocks.NVFP4Config, codes: jax.Array, scale_bytes: jax.Array, global_scale: jax.Array
) -> QArray:
    """The `jaxlowfp.QArray` of `x` from a kernel's outputs: packed codes and E4M3 scale bytes in any layout."""
    k = x.shape[-1]
    scales = lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn)
    tile = cfg.rows > 1
    sshape = (*x.shape[:-2], x.shape[-2] // cfg.rows, k // 16) if tile else (*x.shape[:-1], k // 16)
    return QArray(
        codes=codes.reshape(*x.shape[:-1], k // 2), scales=scales.reshape(sshape), global_scale=global_scale,
        format=Format(kind="nvfp4", rule=cfg.rule, block_shape=cfg.block_shape), dtype=x.dtype, shape=x.shape,
    )


# ---- the old array types (one release): constructors that build a QArray, and isinstance by format kind


class _LegacyArrayMeta(type):
    """``Old(**old_kwargs)`` builds a :class:`QArray`; ``isinstance(q, Old)`` is True for a QArray of its kinds."""

    _kinds: tuple[str, ...]
    _fields: tuple[str, ...]  # the old dataclass's field order (positional arguments)

    def __call__(cls, *args: Any, **kwargs: Any) -> QArray:  # type: ignore[override]
        if len(args) > len(cls._fields):
            raise TypeError(f"{cls.__name__} takes at most {len(cls._fields)} arguments ({', '.join(cls._fields)}); "
                            f"got {len(args)}")
        for name, value in zip(cls._fields, args):
            if name in kwargs:
                raise TypeError(f"{cls.__name__} got {name}= twice (positionally and as a keyword)")
            kwargs[name] = value
        return cls._build(**kwargs)  # type: ignore[attr-defined, no-any-return]

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, QArray) and obj.format.kind in cls._kinds


class NVFP4Array(metaclass=_LegacyArrayMeta):
    """Deprecated: :class:`QArray` of kind "nvfp4"."""

    _kinds = ("nvfp4",)
    _fields = ("codes", "scales", "global_scale", "rule", "block_shape", "dtype", "shape")

    @staticmethod
    def _build(*, codes: Any, scales: Any, global_scale: Any, rule: str, block_shape: tuple[int, int] = (1, 16),
               dtype: Any, shape: tuple[int, ...]) -> QArray:
        return QArray(codes=codes, scales=scales, global_scale=global_scale,
                      format=Format(kind="nvfp4", rule=rule, block_shape=block_shape), dtype=dtype, shape=shape)


class IFArray(metaclass=_LegacyArrayMeta):
    """Deprecated: :class:`QArray` of kind "if4", "if6_e2m3", "if6_e3m2" or "if3"."""

    _kinds = tuple(IF_KINDS)
    _fields = ("codes", "scales", "global_scale", "format", "rule", "block_shape", "dtype", "shape")

    @staticmethod
    def _build(*, codes: Any, scales: Any, global_scale: Any, format: str, rule: str,  # noqa: A002
               block_shape: tuple[int, int] = (1, 16), dtype: Any, shape: tuple[int, ...]) -> QArray:
        return QArray(codes=codes, scales=scales, global_scale=global_scale,
                      format=Format(kind=format, rule=rule, block_shape=block_shape), dtype=dtype, shape=shape)


class MXArray(metaclass=_LegacyArrayMeta):
    """Deprecated: :class:`QArray` of kind "mxfp4", "mxfp8" or "mxfp8_e5m2"."""

    _kinds = tuple(MX_ELEMENT)
    _fields = ("codes", "scales", "format", "rule", "dtype", "shape")

    @staticmethod
    def _build(*, codes: Any, scales: Any, format: str, rule: str, dtype: Any,  # noqa: A002
               shape: tuple[int, ...]) -> QArray:
        kinds = {e: k for k, e in MX_ELEMENT.items()}
        if format not in kinds:
            raise ValueError(f"MXArray format={format!r} is not an MX element format; allowed: "
                             f"{', '.join(map(repr, kinds))}")
        return QArray(codes=codes, scales=scales, global_scale=None, format=Format(kind=kinds[format], rule=rule),
                      dtype=dtype, shape=shape)


class ScaledArray(metaclass=_LegacyArrayMeta):
    """Deprecated: :class:`QArray` of kind "fp8" or "hif8"."""

    _kinds = tuple(PER_TENSOR)
    _fields = ("codes", "scale", "elem", "dtype", "shape")

    @staticmethod
    def _build(*, codes: Any, scale: Any, elem: str, dtype: Any, shape: tuple[int, ...]) -> QArray:
        kinds = {e: k for k, (e, _) in PER_TENSOR.items()}
        if elem not in kinds:
            raise ValueError(f"ScaledArray elem={elem!r} is not supported; allowed: {', '.join(map(repr, kinds))}")
        return QArray(codes=codes, scales=None, global_scale=scale, format=Format(kind=kinds[elem]), dtype=dtype,
                      shape=shape)
