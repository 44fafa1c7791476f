"""Packed low-precision weights: the codes and scales themselves, as pytrees and as an ``nnx.Variable`` of their own.

A weight is packed as the GEMM matrix ``W' [K, N]`` of `jaxlowfp.ptq.layers` (contracted axes first): what is
stored is the format's array of ``W'^T [N, K]``, blocks along the reduction axis K, which is also the operand layout
of ``jax.nn.scaled_matmul`` (``[B, N, K]``) and of PyTorch / serving checkpoints (``[out, in]``)::

    nvfp4   NVFP4Array: uint8 [N, K/2] (two E2M1 codes a byte), float8_e4m3fn scales [N, K/16] (or [N/16, K/16] for
            16x16 tiles), float32 S_dec                     W^T = (q * s) * S_dec
            convention "compressed-tensors" decodes q * (s / g) with g = s_enc (jaxlowfp.ptq.serving)
    mxfp4   MXArray: uint8 [N, K/2], float8_e8m0fnu scales [N, K/32]        W^T = q * 2^e
    mxfp8   MXArray: uint8 E4M3 codes [N, K], float8_e8m0fnu scales [N, K/32]
    fp8     ScaledArray: float8_e4m3fn [N, K], float32 scale s = amax / 448  W^T = f32(q) * s
    hif8    ScaledArray: uint8 HiF8 codes [N, K], float32 scale s = amax / 15 W^T = HiF8(q) * s
    if4     IFArray: uint8 [N, K/2], flagged float8_e4m3fn scales, float32 S_dec

Every ``dequantize`` is bit for bit the fake-quant function of the same format (``nvfp4.fake_quantize``,
``mx.fake_quantize``, ``if4.fake_quantize``, ``qat.scaled_round`` with a current per-tensor scale), because it *is*
that function's decode step applied to the codes it rounded to.

:class:`PackedParam` is the ``nnx.Variable`` type that holds a :class:`PackedWeight`, so ``nnx.split(model,
PackedParam, ...)``, ``nnx.state``, ``jax.jit``, ``jax.device_put`` with shardings and orbax see codes and scales as
ordinary leaves. It is not an ``nnx.Param``: an optimizer over ``nnx.Param`` leaves packed weights alone.

>>> import jax, jax.numpy as jnp
>>> from jaxlowfp import packed
>>> w = jax.random.normal(jax.random.key(0), (64, 32))          # W' [K, N]
>>> p = packed.pack(w, "nvfp4-mse")
>>> p.k, p.n, p.array.codes.shape, p.nbytes      # 64*32/2 code bytes, 64*32/16 scales, S_dec and S_enc
(64, 32, (32, 32), 1160)
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlowfp import formats, if4, mx, nvfp4
from jaxlowfp._core import ct_nvfp4
from jaxlowfp._core.checks import float_dtype, float_input, one_of
from jaxlowfp._core.nvfp4_blocks import BLOCK_SHAPES
from jaxlowfp._core.pytree import pytree_dataclass
from jaxlowfp._core.scaled import scaled_round_mask
from jaxlowfp.scaling import CurrentScaling

__all__ = ["FORMATS", "CONVENTIONS", "PackedFormat", "as_format", "ScaledArray", "PackedWeight", "PackedParam",
           "pack", "from_nvfp4", "scaled_quantize", "fake_quantize"]

FORMATS = ("nvfp4", "mxfp4", "mxfp8", "fp8", "hif8", "if4")
CONVENTIONS = ("jaxlowfp", "compressed-tensors")
TWO_LEVEL = ("nvfp4", "if4")
# per-tensor 8-bit formats: (element format, target the amax maps to = clip bound)
PER_TENSOR = {"fp8": ("e4m3", 448.0), "hif8": ("hif8", 15.0)}
GROUP = {"nvfp4": 16, "if4": 16, "mxfp4": mx.BLOCK, "mxfp8": mx.BLOCK}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedFormat:
    """What a tensor is packed (or, for activations, quantized at run time) to.

    Attributes:
      kind: "nvfp4", "mxfp4", "mxfp8" (MX E4M3), "fp8" (E4M3, one float32 scale amax / 448), "hif8" (one float32
        scale amax / 15, as `jaxlowfp.ptq`'s HiF8) or "if4".
      rule: NVFP4 / IF4 only: the block-scale rule (default "mse", Four Over Six), as `jaxlowfp.nvfp4.quantize`.
      block_shape: NVFP4 / IF4 only: (1, 16) (default) or (16, 16) tiles (weights).
      convention: NVFP4 only: "jaxlowfp" (default) or "compressed-tensors", the decode arithmetic of the weights
        (`jaxlowfp.ptq.serving`).
    """

    kind: str
    rule: str | None = None
    block_shape: tuple[int, int] | None = None
    convention: str | None = None

    def __post_init__(self) -> None:
        one_of(self.kind, FORMATS, "kind")
        if self.kind in TWO_LEVEL:
            rule = "mse" if self.rule is None else self.rule
            one_of(rule, tuple(nvfp4.RULES) if self.kind == "nvfp4" else tuple(if4.RULES), "rule")
            bs = (1, 16) if self.block_shape is None else tuple(self.block_shape)
            one_of(bs, tuple(BLOCK_SHAPES), "block_shape")
            object.__setattr__(self, "rule", rule)
            object.__setattr__(self, "block_shape", bs)
        else:
            for f in ("rule", "block_shape"):
                if getattr(self, f) is not None:
                    raise ValueError(f"{f}={getattr(self, f)!r} applies to kind 'nvfp4' or 'if4' only; got "
                                     f"kind={self.kind!r}")
        if self.kind == "nvfp4":
            conv = "jaxlowfp" if self.convention is None else self.convention
            one_of(conv, CONVENTIONS, "convention")
            if conv == "compressed-tensors" and (self.rule != "static_6" or self.block_shape != (1, 16)):
                raise ValueError(f"convention='compressed-tensors' is NVFP4 static_6 with 1x16 blocks "
                                 f"(llm-compressor's RTN); got rule={self.rule!r}, block_shape={self.block_shape}")
            object.__setattr__(self, "convention", conv)
        elif self.convention is not None:
            raise ValueError(f"convention={self.convention!r} applies to kind 'nvfp4' only; got kind={self.kind!r}")

    @property
    def group(self) -> int | None:
        """Elements per scale along K (None: one scale per tensor)."""
        return GROUP.get(self.kind)

    @property
    def rows(self) -> int:
        """Rows (along N) per scale tile: 16 for 16x16 tiles, else 1."""
        return self.block_shape[0] if self.kind in TWO_LEVEL else 1

    @property
    def name(self) -> str:
        if self.kind in TWO_LEVEL:
            return f"{self.kind}-{self.rule}" + ("-16x16" if self.rows == 16 else "") + (
                "-ct" if self.convention == "compressed-tensors" else "")
        return self.kind

    @property
    def bits(self) -> float:
        """Storage bits per element, scales included (global scales left out)."""
        elem = 4 if self.kind in ("nvfp4", "mxfp4", "if4") else 8
        return elem + (8 / (self.group * self.rows) if self.group else 0.0)


def as_format(fmt: Any, what: str = "format") -> PackedFormat:
    """A :class:`PackedFormat` from itself, from an object with the same fields (``jaxlowfp.ptq.TensorFormat``), or from
    a name: "nvfp4" / "nvfp4-<rule>" (also "-16x16"), "if4-<rule>", "mxfp4", "mxfp8", "fp8", "hif8"."""
    if isinstance(fmt, PackedFormat):
        return fmt
    if isinstance(fmt, str):
        kind, _, rest = fmt.partition("-")
        bs = None
        if rest.endswith("-16x16") or rest == "16x16":
            bs, rest = (16, 16), rest[:-len("16x16")].rstrip("-")
        return PackedFormat(kind=kind, rule=rest or None, block_shape=bs)
    kind = getattr(fmt, "kind", None)
    if isinstance(kind, str):
        return PackedFormat(kind=kind, rule=getattr(fmt, "rule", None), block_shape=getattr(fmt, "block_shape", None))
    raise TypeError(f"{what} must be a PackedFormat, a TensorFormat or a format name such as 'nvfp4-mse'; got "
                    f"{type(fmt).__name__}")


# ---- per-tensor 8-bit: FP8 E4M3 and HiF8


@pytree_dataclass(data=("codes", "scale"), meta=("elem", "dtype", "shape"))
class ScaledArray:
    """A per-tensor scaled 8-bit tensor (pytree).

    Attributes:
      codes: float8_e4m3fn (elem "e4m3") or uint8 HiF8 codes (elem "hif8"), the shape of the tensor.
      scale: float32 scalar decode multiplier ``amax / target`` (448 for E4M3, 15 for HiF8).
      elem, dtype, shape: static metadata.
    """

    codes: jax.Array
    scale: jax.Array
    elem: str
    dtype: Any
    shape: tuple[int, ...]

    def values(self) -> jax.Array:
        """The element values ``f32(q)`` (exact)."""
        if self.elem == "hif8":
            return formats.HIF8.decode(self.codes, jnp.float32)
        return self.codes.astype(jnp.float32)

    def dequantize(self, dtype: Any = None) -> jax.Array:
        """``f32(q) * scale`` cast to `dtype` (default: the original dtype): `qat.scaled_round`'s decode step."""
        return (self.values() * self.scale).astype(float_dtype(self.dtype if dtype is None else dtype))


def _per_tensor_scale(x: jax.Array, target: float) -> jax.Array:
    return CurrentScaling(target_max=target).scale(jnp.max(jnp.abs(x.astype(jnp.float32))))


@functools.partial(jax.jit, static_argnames=("kind",))
def _scaled_codes(x: jax.Array, kind: str, scale: Any = None):
    elem, target = PER_TENSOR[kind]
    scale = _per_tensor_scale(x, target) if scale is None else jnp.asarray(scale, jnp.float32)
    fmt = formats.get(elem)
    v = fmt.round(jnp.clip(x.astype(jnp.float32) * (1.0 / scale), -target, target))  # scaled_round_mask's values
    codes = fmt.encode(v) if elem == "hif8" else v.astype(jnp.float8_e4m3fn)  # exact: v is representable
    return codes, scale


def scaled_quantize(x: Any, kind: str, *, scale: Any = None) -> ScaledArray:
    """FP8 E4M3 (``kind="fp8"``) or HiF8 (``"hif8"``) codes of `x` with the per-tensor scale `scale` (default the
    current one, ``s = amax / target``): ``q = round(clip(x * (1 / s), +-target))``, exactly the values
    `qat.scaled_round` rounds to (``dequantize`` is its output bit for bit)."""
    one_of(kind, tuple(PER_TENSOR), "kind")
    x = float_input(x, "x")
    codes, scale = _scaled_codes(x, kind, scale)
    return ScaledArray(codes=codes, scale=scale, elem=PER_TENSOR[kind][0], dtype=x.dtype, shape=x.shape)


@functools.partial(jax.jit, static_argnames=("fmt",))
def _fake(x: jax.Array, fmt: PackedFormat) -> jax.Array:
    if fmt.kind == "nvfp4":
        return nvfp4.fake_quantize(x, rule=fmt.rule, block_shape=fmt.block_shape)  # type: ignore[arg-type]
    if fmt.kind == "if4":
        return if4.fake_quantize(x, rule=fmt.rule, block_shape=fmt.block_shape)  # type: ignore[arg-type]
    if fmt.kind in ("mxfp4", "mxfp8"):
        return mx.fake_quantize(x, format="e2m1" if fmt.kind == "mxfp4" else "e4m3")
    elem, target = PER_TENSOR[fmt.kind]
    scale = _per_tensor_scale(x, target)
    return scaled_round_mask(x, scale, target, formats.get(elem), scale)[0]


def fake_quantize(x: Any, fmt: Any) -> jax.Array:
    """Quantize-dequantize `x` (blocks along the last axis) to `fmt` with its current amax, in x's dtype: the
    activation quantizer of the fake-quant path (`jaxlowfp.ptq.TensorFormat.fake_quantize` for the PTQ kinds)."""
    fmt = as_format(fmt)
    if fmt.kind == "nvfp4" and fmt.convention != "jaxlowfp":
        raise ValueError("activations are quantized in jaxlowfp's NVFP4 arithmetic; convention applies to weights")
    return _fake(float_input(x, "x"), fmt)


# ---- the packed weight


@pytree_dataclass(data=("array", "s_enc"), meta=("format", "k", "n"))
class PackedWeight:
    """A packed weight (pytree): the format's array of ``W'^T [N, K]`` for the GEMM matrix ``W' [K, N]``.

    Attributes:
      array: `nvfp4.NVFP4Array`, `mx.MXArray`, `if4.IFArray` or :class:`ScaledArray` of shape [N, K].
      s_enc: NVFP4 only: the float32 encode scale ``g`` the weights were quantized with (the compressed-tensors
        convention decodes with it; ``array.global_scale == 1 / g``); None for the other formats.
      format: the :class:`PackedFormat` (static).
      k, n: the GEMM matrix's shape (static).
    """

    array: Any
    s_enc: jax.Array | None
    format: PackedFormat
    k: int
    n: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.k, self.n)

    @property
    def nbytes(self) -> int:
        """Bytes of every leaf (codes, scales, global scales)."""
        return int(sum(np.dtype(a.dtype).itemsize * int(np.prod(a.shape)) for a in jax.tree.leaves(self)))

    @property
    def bits_per_param(self) -> float:
        return 8.0 * self.nbytes / (self.k * self.n)

    def dequantize_t(self, dtype: Any = jnp.float32) -> jax.Array:
        """``W'^T [N, K]`` in `dtype` (float32 arithmetic, then one cast)."""
        return _dequantize_t(self).astype(float_dtype(dtype))

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        """The GEMM matrix ``W' [K, N]`` in `dtype`: bit for bit the fake-quantized weight of this format."""
        return self.dequantize_t(dtype).T


def _dequantize_t(w: PackedWeight) -> jax.Array:
    a, fmt = w.array, w.format
    if fmt.kind == "nvfp4" and fmt.convention == "compressed-tensors":  # q * (s / g), jaxlowfp.ptq.serving.decode
        q = formats.E2M1.decode(nvfp4.unpack_nibbles(a.codes))
        s = a.scales.astype(jnp.float32)
        return ct_nvfp4.dequantize(q.reshape(w.n, w.k // 16, 16), s, w.s_enc).reshape(w.n, w.k)
    return a.dequantize(jnp.float32)


def _check_matrix(w: Any, fmt: PackedFormat, where: str) -> jax.Array:
    w = float_input(w, where)
    if w.ndim != 2:
        raise ValueError(f"{where}: pack takes the GEMM matrix W' [K, N] (2-D, the contracted axis first; "
                         f"jaxlowfp.ptq.layers.Layout.to_matrix gives it for any layer); got shape {tuple(w.shape)}")
    k, n = (int(d) for d in w.shape)
    if fmt.group is not None and k % fmt.group:
        raise ValueError(f"{where}: format {fmt.name} has blocks of {fmt.group} along K; K = {k} (W' shape "
                         f"{(k, n)}) is not a multiple of {fmt.group}. Keep this layer in high precision")
    if fmt.rows > 1 and n % fmt.rows:
        raise ValueError(f"{where}: format {fmt.name} (16x16 tiles) needs N to be a multiple of 16; got N = {n}")
    return w


def pack(w: Any, fmt: Any, *, global_amax: Any = None, where: str = "w") -> PackedWeight:
    """Pack the GEMM matrix `w` ``[K, N]`` (float32/bfloat16/float16) to `fmt` (a :class:`PackedFormat`, a
    ``jaxlowfp.ptq.TensorFormat`` or a name, see :func:`as_format`), blocks along K.

    `global_amax` (NVFP4 / IF4): the tensor amax the global scale is made from (a fused group's shared one); default
    ``max |w|``. ``pack(w, f).dequantize()`` equals the fake-quantized weight of `f` bit for bit."""
    fmt = as_format(fmt)
    wt = _check_matrix(w, fmt, where).T
    k, n = wt.shape[1], wt.shape[0]
    if global_amax is not None and fmt.kind not in TWO_LEVEL:
        raise ValueError(f"global_amax applies to the two-level formats nvfp4 and if4; got {fmt.name}")
    s_enc = None
    if fmt.kind == "nvfp4":
        if fmt.convention == "compressed-tensors":
            return _pack_ct(wt, fmt, global_amax)
        amax = jnp.max(jnp.abs(wt.astype(jnp.float32))) if global_amax is None else jnp.asarray(global_amax,
                                                                                               jnp.float32)
        arr = nvfp4.quantize(wt, rule=fmt.rule, block_shape=fmt.block_shape, global_amax=amax)
        s_enc = nvfp4.global_scales(amax, fmt.rule)[0]
    elif fmt.kind == "if4":
        arr = if4.quantize(wt, rule=fmt.rule, block_shape=fmt.block_shape, global_amax=global_amax)  # type: ignore[assignment]
    elif fmt.kind in ("mxfp4", "mxfp8"):
        arr = mx.quantize(wt, format="e2m1" if fmt.kind == "mxfp4" else "e4m3")  # type: ignore[assignment]
    else:
        arr = scaled_quantize(wt, fmt.kind)  # type: ignore[assignment]
    return PackedWeight(array=arr, s_enc=s_enc, format=fmt, k=k, n=n)


def _pack_ct(wt: jax.Array, fmt: PackedFormat, global_amax: Any) -> PackedWeight:
    """compressed-tensors' RTN NVFP4 (`jaxlowfp._core.ct_nvfp4`): codes, E4M3 scales and the encode scale g."""
    amax = jnp.max(jnp.abs(wt.astype(jnp.float32))) if global_amax is None else jnp.asarray(global_amax, jnp.float32)
    g = ct_nvfp4.global_scale(amax)
    q, s = ct_nvfp4.quantize_tensor(wt, g)
    codes = nvfp4.NVFP4Array(codes=_pack_e2m1(q), scales=s.astype(jnp.float8_e4m3fn), global_scale=1.0 / g,
                             rule=fmt.rule, block_shape=fmt.block_shape, dtype=wt.dtype, shape=wt.shape)
    return PackedWeight(array=codes, s_enc=g, format=fmt, k=wt.shape[1], n=wt.shape[0])


def _pack_e2m1(q: jax.Array) -> jax.Array:
    c = formats.E2M1.encode(q)
    return c[..., 0::2] | (c[..., 1::2] << 4)  # element 2j in the low nibble, as NVFP4Array stores them


def from_nvfp4(arr: nvfp4.NVFP4Array, s_enc: Any = None, *, convention: str = "jaxlowfp") -> PackedWeight:
    """A :class:`PackedWeight` from an `nvfp4.NVFP4Array` of ``W'^T [N, K]`` (what ``PTQResult.packed[path][0]``
    holds for an ``nnx.Linear``: its ``kernel.T``) and its encode scale (``PTQResult.packed[path][1]``, needed for
    ``convention="compressed-tensors"``). No requantization: the codes are taken as they are."""
    if not isinstance(arr, nvfp4.NVFP4Array):
        raise TypeError(f"from_nvfp4 takes an nvfp4.NVFP4Array; got {type(arr).__name__}")
    if len(arr.shape) != 2:
        raise ValueError(f"from_nvfp4 takes the array of W'^T [N, K] (2-D); got shape {arr.shape}")
    fmt = PackedFormat(kind="nvfp4", rule=arr.rule, block_shape=arr.block_shape, convention=convention)
    if convention == "compressed-tensors" and s_enc is None:
        raise ValueError("convention='compressed-tensors' decodes q * (s / g): give s_enc (g)")
    s = None if s_enc is None else jnp.asarray(s_enc, jnp.float32)
    return PackedWeight(array=arr, s_enc=s, format=fmt, k=int(arr.shape[1]), n=int(arr.shape[0]))


class PackedParam(nnx.Variable):
    """An ``nnx.Variable`` holding a :class:`PackedWeight` (read it with ``.get_value()``): packed weights are state
    of their own kind, not ``nnx.Param`` (``nnx.split(model, PackedParam, ...)`` takes them apart)."""
