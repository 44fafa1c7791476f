"""Packed low-precision weights: the codes and scales themselves, as pytrees and as an ``nnx.Variable`` of their own.

A weight is packed as the GEMM matrix ``W' [K, N]`` of `jaxlowfp.ptq.layers` (contracted axes first): what is
stored is the format's array of ``W'^T [N, K]``, blocks along the reduction axis K, which is also the operand layout
of ``jax.nn.scaled_matmul`` (``[B, N, K]``) and of PyTorch / serving checkpoints (``[out, in]``)::

    nvfp4   QArray: uint8 [N, K/2] (two E2M1 codes a byte), float8_e4m3fn scales [N, K/16] (or [N/16, K/16] for
            16x16 tiles), float32 S_dec                     W^T = (q * s) * S_dec
            arithmetic "compressed-tensors" decodes q * (s / g) with g = s_enc (jaxlowfp.ptq.serving)
    mxfp4   QArray: uint8 [N, K/2], float8_e8m0fnu scales [N, K/32]        W^T = q * 2^e
    mxfp8   QArray: uint8 E4M3 codes [N, K], float8_e8m0fnu scales [N, K/32]
    fp8     QArray: float8_e4m3fn [N, K], float32 scale s = amax / 448  W^T = f32(q) * s
    hif8    QArray: uint8 HiF8 codes [N, K], float32 scale s = amax / 15 W^T = HiF8(q) * s
    if4     QArray: uint8 [N, K/2], flagged float8_e4m3fn scales, float32 S_dec

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

from jaxlowfp._core.surface import public_dir as _public_dir

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from jaxlowfp import formats, if4, mx, nvfp4
from jaxlowfp._core import ct_nvfp4
from jaxlowfp._core.checks import float_dtype, float_input, one_of
from jaxlowfp._core.deprecation import deprecated_getattr, renamed_kwarg
from jaxlowfp._core.format import ARITHMETICS, IF_KINDS, KINDS, MX_ELEMENT, PER_TENSOR, TWO_LEVEL, Format, as_format
from jaxlowfp._core.pytree import pytree_dataclass
from jaxlowfp._core.qarray import QArray, block_scales
from jaxlowfp._core.qarray import ScaledArray as _ScaledArray
from jaxlowfp._core.scaled import scaled_round_mask
from jaxlowfp.scaling import CurrentScaling

__all__ = ["FORMATS", "Format", "as_format", "PackedWeight", "PackedParam", "pack", "from_nvfp4",
           "scaled_quantize", "quantize", "dequantize", "fake_quantize"]

FORMATS = KINDS  # the format kinds (jaxlowfp.Format.kind)


def _legacy_packed_format(*, kind: str, rule: str | None = None, block_shape: tuple[int, int] | None = None,
                          convention: str | None = None) -> Format:
    """``PackedFormat(kind=..., rule=..., block_shape=..., convention=...)`` of jaxlowfp <= 0.1: a :class:`Format`
    (``convention`` is its ``arithmetic``; NVFP4's rule defaulted to "mse" under this name)."""
    if kind == "nvfp4" and rule is None:
        rule = "mse"
    return Format(kind=kind, rule=rule, block_shape=block_shape, arithmetic=convention)


# ---- per-tensor 8-bit: FP8 E4M3 and HiF8


def per_tensor_scale(x: jax.Array, target: float) -> jax.Array:
    """The current per-tensor decode scale ``s = max|x| / target`` (`CurrentScaling`), as FP8 / HiF8 pack it."""
    return CurrentScaling(target_max=target).scale(jnp.max(jnp.abs(x.astype(jnp.float32))))


@functools.partial(jax.jit, static_argnames=("kind",))
def _scaled_codes(x: jax.Array, kind: str, scale: Any = None):
    elem, target = PER_TENSOR[kind]
    scale = per_tensor_scale(x, target) if scale is None else jnp.asarray(scale, jnp.float32)
    fmt = formats.get(elem)
    v = fmt.round(jnp.clip(x.astype(jnp.float32) * (1.0 / scale), -target, target))  # scaled_round_mask's values
    codes = fmt.encode(v) if elem == "hif8" else v.astype(jnp.float8_e4m3fn)  # exact: v is representable
    return codes, scale


def scaled_quantize(x: Any, kind: str, *, scale: Any = None) -> QArray:
    """FP8 E4M3 (``kind="fp8"``) or HiF8 (``"hif8"``) codes of `x` with the per-tensor scale `scale` (default the
    current one, ``s = amax / target``): ``q = round(clip(x * (1 / s), +-target))``, exactly the values
    `qat.scaled_round` rounds to (``dequantize`` is its output bit for bit)."""
    one_of(kind, tuple(PER_TENSOR), "kind")
    x = float_input(x, "x")
    codes, scale = _scaled_codes(x, kind, scale)
    return QArray(codes=codes, scales=None, global_scale=scale, format=Format(kind=kind), dtype=x.dtype, shape=x.shape)


@functools.partial(jax.jit, static_argnames=("fmt",))
def _fake(x: jax.Array, fmt: Format) -> jax.Array:
    if fmt.kind == "nvfp4":
        return nvfp4.fake_quantize(x, rule=fmt.rule, block_shape=fmt.block_shape)  # type: ignore[arg-type]
    if fmt.kind in IF_KINDS:
        return if4.fake_quantize(x, format=fmt.kind, rule=fmt.rule, block_shape=fmt.block_shape)  # type: ignore[arg-type]
    if fmt.kind in MX_ELEMENT:
        return mx.fake_quantize(x, format=MX_ELEMENT[fmt.kind], rule=fmt.rule)  # type: ignore[arg-type]
    elem, target = PER_TENSOR[fmt.kind]
    scale = per_tensor_scale(x, target)
    return scaled_round_mask(x, scale, target, formats.get(elem), scale)[0]


def fake_quantize(x: ArrayLike, format: Format | str) -> jax.Array:  # noqa: A002 (a Format, as QuantSpec.format)
    """``dequantize(quantize(x, format))`` in x's dtype, bit for bit, without building codes: `x` quantized to
    `format` (a :class:`~jaxlowfp.Format` or its name) with its current amax, blocks along the last axis. This is
    the activation quantizer of the fake-quant path and RTN's weight quantizer.

    >>> import jax.numpy as jnp, jaxlowfp
    >>> x = jnp.asarray([[0.3, 1.0, 5.0, 6.0] * 4])
    >>> bool((jaxlowfp.fake_quantize(x, "nvfp4") == jaxlowfp.dequantize(jaxlowfp.quantize(x, "nvfp4"))).all())
    True
    """
    fmt = as_format(format)
    if fmt.kind == "nvfp4" and fmt.arithmetic != "jaxlowfp":
        raise ValueError("activations are quantized in jaxlowfp's NVFP4 arithmetic; arithmetic= applies to weights")
    return _fake(float_input(x, "x"), fmt)


def quantize(x: ArrayLike, format: Format | str, *, global_amax: ArrayLike | None = None  # noqa: A002
             ) -> QArray:
    """The :class:`~jaxlowfp.QArray` of `x` in `format` (a :class:`~jaxlowfp.Format` or its name), blocks along
    the last axis (every kind of ``jaxlowfp.Format``, IF6 / IF3 and MXFP8 E5M2 included).
    `global_amax` (NVFP4 / IF4; FP8 / HiF8: the amax the one scale is made from): the tensor amax to scale with,
    default ``max |x|``. The per-format modules (`jaxlowfp.nvfp4`, `jaxlowfp.if4`, `jaxlowfp.mx`) take their
    rounding and kernel options.

    >>> import jax.numpy as jnp, jaxlowfp
    >>> q = jaxlowfp.quantize(jnp.ones((2, 32)), "nvfp4-mse")
    >>> q.codes.shape, q.rule, jaxlowfp.dequantize(q)[0, 0].item()
    ((2, 16), 'mse', 1.0)
    """
    fmt = as_format(format)
    x = float_input(x, "x")
    if fmt.kind == "nvfp4" and fmt.arithmetic == "compressed-tensors":
        return _pack_ct(x, fmt, global_amax).array
    if fmt.kind == "nvfp4":
        return nvfp4.quantize(x, rule=fmt.rule, block_shape=fmt.block_shape,  # type: ignore[arg-type]
                              global_amax=global_amax)
    if fmt.kind in IF_KINDS:
        return if4.quantize(x, format=fmt.kind, rule=fmt.rule, block_shape=fmt.block_shape,  # type: ignore[arg-type]
                            global_amax=global_amax)
    if global_amax is not None and not fmt.per_tensor:
        raise ValueError(f"global_amax applies to formats with a tensor scale (nvfp4, if4, fp8, hif8); got {fmt.name}")
    if fmt.is_mx:
        return mx.quantize(x, format=MX_ELEMENT[fmt.kind], rule=fmt.rule)  # type: ignore[arg-type]
    scale = None if global_amax is None else per_tensor_scale(jnp.asarray(global_amax, jnp.float32), fmt.target)
    return scaled_quantize(x, fmt.kind, scale=scale)


def dequantize(q: QArray, dtype: DTypeLike | None = None) -> jax.Array:
    """The values of quantized `q` (a :class:`~jaxlowfp.QArray`, what :func:`quantize` returns) in `dtype`
    (default: the dtype it was quantized from), computed in float32: bit for bit :func:`fake_quantize` of the same
    format."""
    if isinstance(q, PackedWeight):
        raise TypeError("dequantize takes a jaxlowfp.QArray; a PackedWeight's is its .array (W'^T), and "
                        "PackedWeight.dequantize() gives the GEMM matrix W' [K, N]")
    if not isinstance(q, QArray):
        raise TypeError(f"dequantize takes a jaxlowfp.QArray (what jaxlowfp.quantize returns); got "
                        f"{type(q).__name__}")
    return q.dequantize(q.dtype if dtype is None else dtype)


# ---- the packed weight


@pytree_dataclass(data=("array", "s_enc"), meta=("format", "k", "n"))
class PackedWeight:
    """A packed weight (pytree): the :class:`~jaxlowfp.QArray` of ``W'^T [N, K]`` for the GEMM matrix ``W' [K, N]``,
    with what the GEMM needs beside it. Not a second array type: the quantized values are ``.array``.

    Attributes:
      array: the :class:`~jaxlowfp.QArray` of ``W'^T``, shape [N, K].
      s_enc: NVFP4 only: the float32 encode scale ``g`` the weights were quantized with (the compressed-tensors
        arithmetic decodes with it; ``array.global_scale == 1 / g``); None for the other formats.
      format: the :class:`~jaxlowfp.Format` (static).
      k, n: the GEMM matrix's shape (static).
    """

    array: QArray
    s_enc: jax.Array | None
    format: Format
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
    if fmt.kind == "nvfp4" and fmt.arithmetic == "compressed-tensors":  # q * (s / g), jaxlowfp.ptq.serving.decode
        q = formats.E2M1.decode(nvfp4.unpack_nibbles(a.codes))
        s = block_scales(a).astype(jnp.float32)
        if w.s_enc is None:
            raise ValueError("a compressed-tensors NVFP4 weight decodes with its encode scale s_enc; it has none")
        return ct_nvfp4.dequantize(q.reshape(w.n, w.k // 16, 16), s, w.s_enc).reshape(w.n, w.k)
    return a.dequantize(jnp.float32)


def _check_matrix(w: Any, fmt: Format, where: str) -> jax.Array:
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
    """Pack the GEMM matrix `w` ``[K, N]`` (float32/bfloat16/float16) to `fmt` (a :class:`~jaxlowfp.Format`, a
    ``jaxlowfp.ptq.TensorFormat`` or a name, see :func:`as_format`), blocks along K.

    `global_amax` (NVFP4 / IF4): the tensor amax the global scale is made from (a fused group's shared one); default
    ``max |w|``. ``pack(w, f).dequantize()`` equals the fake-quantized weight of `f` bit for bit, for finite `w`.
    A NaN or Inf in `w` is never stored as a finite weight: with NVFP4, IF4, FP8 and HiF8 (a tensor scale) every
    value dequantizes to NaN, with MX the blocks holding one do."""
    fmt = as_format(fmt)
    if fmt.kind not in KINDS:
        raise ValueError(f"{where}: pack takes the formats of a packed GEMM weight (kinds {', '.join(KINDS)}); got "
                         f"{fmt.name} (jaxlowfp.quantize gives its QArray)")
    wt = _check_matrix(w, fmt, where).T
    k, n = wt.shape[1], wt.shape[0]
    if global_amax is not None and fmt.kind not in TWO_LEVEL:
        raise ValueError(f"global_amax applies to the two-level formats nvfp4 and if4; got {fmt.name}")
    s_enc = None
    if fmt.kind == "nvfp4":
        if fmt.arithmetic == "compressed-tensors":
            return _pack_ct(wt, fmt, global_amax)
        amax = jnp.max(jnp.abs(wt.astype(jnp.float32))) if global_amax is None else jnp.asarray(global_amax,
                                                                                               jnp.float32)
        arr = nvfp4.quantize(wt, rule=fmt.rule, block_shape=fmt.block_shape, global_amax=amax)
        s_enc = nvfp4.global_scales(amax, fmt.rule)[0]
    elif fmt.kind == "if4":
        arr = if4.quantize(wt, rule=fmt.rule, block_shape=fmt.block_shape, global_amax=global_amax)  # type: ignore[arg-type]
    elif fmt.kind in ("mxfp4", "mxfp8"):
        arr = mx.quantize(wt, format=MX_ELEMENT[fmt.kind], rule=fmt.rule)  # type: ignore[arg-type]
    else:  # FP8 / HiF8: the current scale is 1 for a non-finite amax (training's guard), which would store a weight
        # holding +-Inf as finite, saturated codes; a weight's NaN scale poisons the whole tensor, as NVFP4's does
        amax = jnp.max(jnp.abs(wt.astype(jnp.float32)))
        scale = jnp.where(jnp.isfinite(amax), per_tensor_scale(wt, PER_TENSOR[fmt.kind][1]), jnp.nan)
        arr = scaled_quantize(wt, fmt.kind, scale=scale)
    return PackedWeight(array=arr, s_enc=s_enc, format=fmt, k=k, n=n)


def _pack_ct(wt: jax.Array, fmt: Format, global_amax: Any) -> PackedWeight:
    """compressed-tensors' RTN NVFP4 (`jaxlowfp._core.ct_nvfp4`): codes, E4M3 scales and the encode scale g."""
    amax = jnp.max(jnp.abs(wt.astype(jnp.float32))) if global_amax is None else jnp.asarray(global_amax, jnp.float32)
    g = ct_nvfp4.global_scale(amax)
    q, s = ct_nvfp4.quantize_tensor(wt, g)
    codes = QArray(codes=_pack_e2m1(q), scales=s.astype(jnp.float8_e4m3fn), global_scale=1.0 / g, format=fmt,
                   dtype=wt.dtype, shape=wt.shape)
    return PackedWeight(array=codes, s_enc=g, format=fmt, k=wt.shape[1], n=wt.shape[0])


def _pack_e2m1(q: jax.Array) -> jax.Array:
    c = formats.E2M1.encode(q)
    return c[..., 0::2] | (c[..., 1::2] << 4)  # element 2j in the low nibble, as QArray stores them


def from_nvfp4(arr: QArray, s_enc: Any = None, *, arithmetic: str = "jaxlowfp",
               convention: str | None = None) -> PackedWeight:
    """A :class:`PackedWeight` from the NVFP4 :class:`~jaxlowfp.QArray` of ``W'^T [N, K]`` (what
    ``PTQResult.packed[path][0]`` holds for an ``nnx.Linear``: its ``kernel.T``) and its encode scale
    (``PTQResult.packed[path][1]``, needed for ``arithmetic="compressed-tensors"``). No
    requantization: the codes are taken as they are."""
    if not isinstance(arr, QArray) or arr.format.kind != "nvfp4":
        got = f"a QArray of {arr.format!r}" if isinstance(arr, QArray) else type(arr).__name__
        raise TypeError(f"from_nvfp4 takes an NVFP4 jaxlowfp.QArray; got {got}")
    if len(arr.shape) != 2:
        raise ValueError(f"from_nvfp4 takes the array of W'^T [N, K] (2-D); got shape {arr.shape}")
    arithmetic = renamed_kwarg("packed.from_nvfp4", "convention", convention, "arithmetic", arithmetic, "jaxlowfp")
    fmt = Format(kind="nvfp4", rule=arr.format.rule, block_shape=arr.format.block_shape, arithmetic=arithmetic)
    if arithmetic == "compressed-tensors" and s_enc is None:
        raise ValueError("arithmetic='compressed-tensors' decodes q * (s / g): give s_enc (g)")
    s = None if s_enc is None else jnp.asarray(s_enc, jnp.float32)
    return PackedWeight(array=arr, s_enc=s, format=fmt, k=int(arr.shape[1]), n=int(arr.shape[0]))


class PackedParam(nnx.Variable):
    """An ``nnx.Variable`` holding a :class:`PackedWeight` (read it with ``.get_value()``): packed weights are state
    of their own kind, not ``nnx.Param`` (``nnx.split(model, PackedParam, ...)`` takes them apart)."""


# old names (one release): PackedFormat and ptq.TensorFormat are both jaxlowfp.Format now
__getattr__ = deprecated_getattr(__name__, {
    "PackedFormat": ("jaxlowfp.Format", lambda: _legacy_packed_format),
    "CONVENTIONS": ("jaxlowfp.packed.ARITHMETICS", lambda: ARITHMETICS),
    "ScaledArray": ("jaxlowfp.QArray", lambda: _ScaledArray),
})


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
