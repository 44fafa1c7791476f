"""What PTQ quantizes a tensor to (a :class:`~jaxlowfp.Format`), a layer's weight + activation pair (:class:`Scheme`),
and the quantizers: fake quantization with a current per-tensor amax, and round-to-nearest weight quantization.

Every quantizer here is a public ``jaxlowfp`` function (``nvfp4``, ``mx``, ``qat.scaled_round``); blocks run along
the last axis, the GEMM reduction axis. A ``nnx.Linear`` kernel is ``[in, out]``, so weights are quantized as
``kernel.T`` (``[out, in]``, PyTorch's layout, blocks along ``in``) and transposed back::

    nvfp4  x̂ = (q * s_b) * S_dec      E2M1 q, E4M3 s_b per 16 values (rule: static_6, static_4, abs_max, mae, mse,
                                     search)
    if4    x̂ = (q * s_b) * S_dec, or ((q * s_b) * 6/7) * S_dec   E2M1 or INT4 q per block of 16 (rule: mse, mae,
                                     abs_max; jaxlowfp.if4)
    mxfp4  x̂ = q * 2^e_b              E2M1 q, E8M0 2^e_b per 32 values (OCP floor rule)
    mxfp8  x̂ = q * 2^e_b              E4M3 q, E8M0 2^e_b per 32 values (OCP floor rule)
    hif8   x̂ = HiF8(clip(x / s, +-15)) * s,   s = amax / 15   (per tensor; the Max-Window paper's target)
    fp8    x̂ = E4M3(clip(x / s, +-448)) * s,  s = amax / 448  (per tensor, as FP8 W8A8 checkpoints store it)
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from jaxlowfp import formats, if4, mx, nvfp4, qat, registry
from jaxlowfp._core.deprecation import deprecated_getattr
from jaxlowfp._core.placement import commit_tree
from jaxlowfp._core.format import PER_TENSOR, TWO_LEVEL, Format, two_level_of
from jaxlowfp._core.qarray import QArray, block_scales
from jaxlowfp.scaling import CurrentScaling, StaticScaling

KINDS = registry.PTQ_KINDS
# how a W4A4 / W8A8 layer's run-time activation gets its amax: the whole input tensor's (the batch's: the Four Over
# Six paper's PTQ setting; a score then depends on the other requests of its batch), each token's own (dynamic), or
# the calibrated input amax (static: what the export writes as input_global_scale and vLLM applies)
ACTIVATION_SCALES = ("tensor", "token", "static")
NVFP4_RULES = registry.NVFP4_RULES
IF4_RULES = registry.IF_RULES
NVFP4_BLOCK_SHAPES = tuple(nvfp4.BLOCK_SHAPES)
HIF8_TARGET = PER_TENSOR["hif8"][1]
MX_ELEMENTS = {"mxfp4": "e2m1", "mxfp8": "e4m3"}
_FLT_MAX = float(np.finfo(np.float32).max)


def _one_of(value: Any, allowed: tuple, what: str) -> None:
    if value not in allowed:
        raise ValueError(f"{what}={value!r} is not supported; allowed: {', '.join(map(repr, allowed))}")


def fake_quantize(x: jax.Array, fmt: Format) -> jax.Array:
    """Quantize-dequantize `x` (blocks along the last axis) to `fmt` with the current per-tensor amax, in x's
    dtype: the activation quantizer of the PTQ'd model, and RTN's weight quantizer."""
    if fmt.kind == "nvfp4":
        rule, block = two_level_of(fmt)
        return nvfp4.fake_quantize(x, rule=cast(nvfp4.NVFP4Rule, rule), block_shape=block)
    if fmt.kind == "if4":
        rule, block = two_level_of(fmt)
        return if4.fake_quantize(x, rule=cast(if4.IFRule, rule), block_shape=block)
    if fmt.kind in MX_ELEMENTS:
        return mx.fake_quantize(x, format=MX_ELEMENTS[fmt.kind], rule=fmt.rule)  # type: ignore[arg-type]
    return per_tensor_fake_quantize(x, fmt.kind)


def activation_spec(fmt: Format, activation_scale: str = "tensor", amax: float | tuple[float, ...] | None = None
                    ) -> qat.QuantSpec:
    """The `jaxlowfp.qat.QuantSpec` that quantizes a run-time activation in `fmt` (the one op layer's description,
    `jaxlowfp.ops`): its amax per tensor ("tensor", the batch's), per token ("token") or the calibrated `amax`
    ("static"). MX formats have block scales only: every mode is the same quantizer."""
    _one_of(activation_scale, ACTIVATION_SCALES, "activation_scale")
    if activation_scale == "static" and amax is None:
        raise ValueError(f"activation_scale='static' needs the calibrated amax of the layer's input ({fmt.name})")
    if fmt.kind in MX_ELEMENTS:
        return qat.QuantSpec(format=fmt.kind)  # type: ignore[arg-type]
    target = PER_TENSOR[fmt.kind][1] if fmt.per_tensor else 6.0
    if activation_scale == "static":
        scaling: Any = StaticScaling(amax=tuple(map(float, amax)) if isinstance(amax, (tuple, list)) else
                                     float(amax), target_max=target)  # type: ignore[arg-type]
    else:
        scaling = CurrentScaling(target_max=target, granularity=activation_scale)  # type: ignore[arg-type]
    if fmt.per_tensor:
        return qat.QuantSpec(format=PER_TENSOR[fmt.kind][0], scaling=scaling, clip="target")  # type: ignore[arg-type]
    return qat.QuantSpec(format=fmt.kind, rule=fmt.rule, block_shape=fmt.block_shape,  # type: ignore[arg-type]
                         scaling=scaling)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class LegacyTensorFormat(Format):
    """``ptq.Format`` of jaxlowfp <= 0.1 (deprecated): a :class:`~jaxlowfp.Format` whose NVFP4 rule defaults
    to "mse", with the old methods ``fake_quantize(x)`` (:func:`fake_quantize`) and ``quant_spec(...)``
    (:func:`activation_spec`)."""

    def __post_init__(self) -> None:
        if self.kind == "nvfp4" and self.rule is None:
            object.__setattr__(self, "rule", "mse")
        super().__post_init__()

    def fake_quantize(self, x: jax.Array) -> jax.Array:
        return fake_quantize(x, self)

    def quant_spec(self, activation_scale: str = "tensor", amax: float | tuple[float, ...] | None = None
                   ) -> qat.QuantSpec:
        return activation_spec(self, activation_scale, amax)


def per_tensor_scale(amax: jax.Array, kind: str = "hif8") -> jax.Array:
    """Per-tensor dequant multiplier ``amax / target`` (HiF8 15, FP8 448; 1 when amax is 0 or not finite)."""
    return CurrentScaling(target_max=PER_TENSOR[kind][1]).scale(amax)


def per_tensor_fake_quantize(x: jax.Array, kind: str = "hif8", scale: jax.Array | None = None) -> jax.Array:
    """``F(clip(x / s, +-target)) * s`` (`qat.scaled_round`) for F = HiF8 (target 15) or E4M3 (448), s =
    `per_tensor_scale(max|x|)` unless given."""
    elem, target = PER_TENSOR[kind]
    if scale is None:
        scale = per_tensor_scale(jnp.max(jnp.abs(x.astype(jnp.float32))), kind)
    return qat.scaled_round(x, scale, target, elem)[0]


def hif8_scale(amax: jax.Array) -> jax.Array:
    """`per_tensor_scale` of HiF8: ``amax / 15``."""
    return per_tensor_scale(amax, "hif8")


def hif8_fake_quantize(x: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """`per_tensor_fake_quantize` of HiF8: ``HiF8(clip(x / s, +-15)) * s``."""
    return per_tensor_fake_quantize(x, "hif8", scale)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scheme:
    """A layer's PTQ target: the weight format and the activation format (None: weights only, e.g. W4A16).

    Activations are fake-quantized at run time with the current per-tensor amax; NVFP4 activations use 1x16
    blocks.
    """

    weight: Format
    activation: Format | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.weight, Format):
            raise TypeError(f"weight must be a Format; got {type(self.weight).__name__}")
        if self.activation is not None:
            if not isinstance(self.activation, Format):
                raise TypeError(f"activation must be a Format or None; got {type(self.activation).__name__}")
            if self.activation.rows != 1:
                raise ValueError(f"activations are quantized in 1x16 blocks; got block_shape="
                                 f"{self.activation.block_shape} (16x16 tiles are for weights)")

    @property
    def name(self) -> str:
        w = self.weight.name
        if self.activation is None:
            return f"{w} W-only"
        a = self.activation.name
        same = self.weight.kind in TWO_LEVEL and self.activation.kind == self.weight.kind and (
            self.activation.rule == self.weight.rule)
        return w if a == w or same else f"{w} / a {a}"

    def check_layer(self, in_features: int, out_features: int, where: str) -> None:
        """Block-scaled formats need whole blocks along `in` (and whole 16-row tiles along `out`)."""
        for role, f in (("weight", self.weight), ("activation", self.activation)):
            if f is None or f.group is None:
                continue
            if in_features % f.group:
                raise ValueError(f"{where}: {role} format {f.name} needs in_features to be a multiple of {f.group}; "
                                 f"got {in_features}. Keep this layer in high precision (a Rule with scheme=None).")
            if role == "weight" and f.rows > 1 and out_features % f.rows:
                raise ValueError(f"{where}: weight format {f.name} (16x16 tiles) needs out_features to be a multiple "
                                 f"of 16; got {out_features}")


SCHEMES = registry.PTQ_FORMATS


def scheme(name: str, *, weights_only: bool = False, weight_block: tuple[int, int] = (1, 16)) -> Scheme:
    """A named scheme (a name of :data:`SCHEMES`): ``"nvfp4"`` (W4A4 standard NVFP4, static_6), ``"nvfp4-<rule>"``
    (W4A4 NVFP4 with another rule, Four Over Six's ``"nvfp4-mse"`` among them; weights and activations with the
    same rule, except
    ``"nvfp4-search"``: the per-block scale search calibrates the weights, and the activations, quantized at run
    time, use 4/6 ``mse``, the search being a weight calibration as llm-compressor's observer), ``"if4-<rule>"``
    (W4A4 IF4), ``"mxfp4"`` / ``"mxfp8"`` (W4A4 MXFP4, W8A8 MXFP8), ``"hif8"`` or ``"fp8"`` (W8A8 HiF8 / FP8 E4M3,
    per-tensor scales). ``weights_only``: no activation quantization (W4A16 / W8A16). ``weight_block``:
    NVFP4 / IF4 weight blocks, (1, 16) or (16, 16)."""
    try:
        f = Format.parse(name)
    except (ValueError, TypeError):
        f = None
    if f is None or f.rows != 1 or f.arithmetic not in (None, "jaxlowfp") or f.name not in SCHEMES:
        raise ValueError(f"scheme={name!r} is not supported; allowed: {', '.join(map(repr, SCHEMES))} "
                         f"(\"nvfp4\" is standard NVFP4, static_6; \"nvfp4-static_6\" parses too)")
    if f.kind in TWO_LEVEL:
        w = Format(kind=f.kind, rule=f.rule, block_shape=cast(tuple[int, int], tuple(weight_block)))
        a = Format(kind=f.kind, rule="mse" if f.rule == "search" else f.rule)
    else:
        if tuple(weight_block) != (1, 16):
            raise ValueError(f"weight_block applies to NVFP4 / IF4 schemes only; got {weight_block!r} with {name!r}")
        w = a = f
    return Scheme(weight=w, activation=None if weights_only else a)


# ---------------------------------------------------------------------------------------------------------------
# weights


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """What `rtn_weight` / `gptq_weight` return (a PTQ result record, not an array type): `kernel` [in, out] float32
    (the dequantized values the model computes with) and, for NVFP4, `packed`, the `jaxlowfp.QArray` of
    ``kernel.T`` ([out, in]: codes, E4M3 scales, global scale) whose ``dequantize().T`` is `kernel` bit for bit, and
    `s_enc`, the encode scale ``M*E / amax`` it was made with (``packed.global_scale == 1 / s_enc``)."""

    kernel: jax.Array
    packed: QArray | None = None
    s_enc: jax.Array | None = None


@functools.partial(jax.jit, static_argnames=("fmt",))
def _rtn(kernel: jax.Array, fmt: Format, global_amax: jax.Array | None = None):
    wt = kernel.astype(jnp.float32).T
    if fmt.kind != "nvfp4":
        return fake_quantize(wt, fmt).T, None, None
    amax = jnp.max(jnp.abs(wt)) if global_amax is None else global_amax
    rule, block = two_level_of(fmt)
    arr = nvfp4.quantize(wt, rule=cast(nvfp4.NVFP4Rule, rule), block_shape=block, global_amax=amax)
    s_enc = nvfp4.global_scales(amax, rule)[0]
    return arr.dequantize(jnp.float32).T, arr, s_enc


def whole_blocks(kernel: jax.Array, group: int | None) -> jax.Array:
    """`kernel` [K, N] as it is, or, when it lies on a mesh whose K shards would split blocks of `group` values
    across devices (K / shards not a multiple of `group`), resharded with K whole and its N sharding kept: each
    block's reduction then stays on one device (XLA:CPU cannot partition the NaN-keeping block max)."""
    sh = getattr(kernel, "sharding", None)
    if group is None or not isinstance(sh, jax.sharding.NamedSharding) or kernel.ndim != 2:
        return kernel
    spec = tuple(sh.spec) + (None,) * (2 - len(tuple(sh.spec)))
    axes = spec[0] if isinstance(spec[0], tuple) else (() if spec[0] is None else (spec[0],))
    shards = int(np.prod([sh.mesh.shape[a] for a in axes]))
    if shards == 1 or (kernel.shape[0] // shards) % group == 0:
        return kernel
    return jax.device_put(kernel, jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(None, spec[1])))


def rtn_weight(kernel: jax.Array, fmt: Format, global_amax: jax.Array | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of a kernel [in, out] (blocks along `in`), with its own amax or, for NVFP4,
    `global_amax` (a fused group's shared amax: every block's scale and 4/6 choice made under that global scale).
    A kernel on a mesh is quantized where it lives (`whole_blocks`: K gathered only where shards split blocks)."""
    # committed (`placement.commit_tree`): one compiled function per shape, whether the kernel came committed
    kernel = commit_tree(whole_blocks(jnp.asarray(kernel), fmt.group))
    if fmt.kind != "nvfp4":
        return QuantizedWeight(*_rtn(kernel, fmt, None))
    # the amax passed in either way (the same value _rtn would take), committed with the kernel
    g = jnp.max(jnp.abs(kernel.astype(jnp.float32))) if global_amax is None else jnp.asarray(global_amax, jnp.float32)
    kernel, g = commit_tree((kernel, g))
    return QuantizedWeight(*_rtn(kernel, fmt, g))


# ---------------------------------------------------------------------------------------------------------------
# column quantizers with fixed scales (GPTQ): quantize one input channel of W^T [out, in] at a time


def nvfp4_fix(cols: jax.Array, fmt: Format, global_amax: jax.Array) -> jax.Array:
    """E4M3 block scales (float32 values, one per row [out]) of the 16 columns `cols` [out, 16] as they stand,
    with the tensor's global amax: the block scale and the 4-or-6 choice of `nvfp4.quantize`."""
    rule, block = two_level_of(fmt)
    arr = nvfp4.quantize(cols, rule=cast(nvfp4.NVFP4Rule, rule), block_shape=block, global_amax=global_amax)
    s = block_scales(arr).astype(jnp.float32).reshape(-1)  # [out] (1x16) or [out / 16] (16x16 tiles)
    return jnp.repeat(s, fmt.rows) if fmt.rows > 1 else s


def nvfp4_column(col: jax.Array, s: jax.Array, s_dec: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(E2M1 value q, dequantized (q * s) * S_dec) of a column with fixed block scales `s` (the NVFP4 element step:
    ``q = E2M1_RNE_satfinite(x * min(1 / (s * S_dec), FLT_MAX))``, +0 where s == 0)."""
    inv = jnp.minimum(1.0 / (s * s_dec), _FLT_MAX)
    q = formats.E2M1.round(col * jnp.where(s == 0, 0.0, inv), saturate=True)
    q = jnp.where(s == 0, 0.0, q)
    return q, (q * s) * s_dec


def block_global_scales(fmt: Format, amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(S_enc, S_dec) of a two-level format (NVFP4 by its rule, IF4: M*448 / amax)."""
    return if4.global_scales(amax, "if4") if fmt.kind == "if4" else nvfp4.global_scales(amax, two_level_of(fmt)[0])


def if4_fix(cols: jax.Array, fmt: Format, global_amax: jax.Array) -> jax.Array:
    """IF4's block scale and grid choice (float32 per row [out]) of the 16 columns `cols` [out, 16] as they stand:
    the E4M3 scale value, negated for an INT block (fouroversix's sign-bit flag, as a float)."""
    rule, block = two_level_of(fmt)
    arr = if4.quantize(cols, rule=cast(if4.IFRule, rule), block_shape=block, global_amax=global_amax)
    s = block_scales(arr).astype(jnp.float32).reshape(-1)
    return jnp.repeat(s, fmt.rows) if fmt.rows > 1 else s


def if4_column(col: jax.Array, p: jax.Array, s_dec: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(grid value q, dequantized) of a column with fixed flagged scales `p` (:func:`if4_fix`): E2M1 q and
    ``(q * s) * S_dec`` where p >= 0, else the INT4 q = round_half_even(min(|y| * 7/6, 7)) and
    ``((q * s) * 6/7) * S_dec``; y = x * min(1 / (s * S_dec), FLT_MAX), +0 where s == 0."""
    s = jnp.abs(p)
    inv = jnp.where(s == 0, 0.0, jnp.minimum(1.0 / (s * s_dec), _FLT_MAX))
    y = col * inv
    g = if4.GRIDS["if4"]
    qi = jnp.sign(y) * jnp.round(jnp.minimum(jnp.abs(y) * np.float32(g.rcp), np.float32(g.int_max)))
    qi = jnp.where(qi == 0, 0.0, qi)  # an integer 0 has no sign (as jaxlowfp.if4 decodes it)
    is_int = p < 0
    q = jnp.where(is_int, qi, formats.E2M1.round(y, saturate=True))
    q = jnp.where(s == 0, 0.0, q)
    return q, jnp.where(is_int, ((q * s) * np.float32(g.step)) * s_dec, (q * s) * s_dec)


def mx_fix(cols: jax.Array, kind: str = "mxfp4") -> jax.Array:
    """The E8M0 block scale 2^e (float32, per row [out]) of 32 columns `cols` [out, 32] as they stand."""
    return block_scales(mx.quantize(cols, format=MX_ELEMENTS[kind])).astype(  # type: ignore[arg-type]
        jnp.float32).reshape(-1)


def mx_column(col: jax.Array, x: jax.Array, kind: str = "mxfp4") -> tuple[jax.Array, jax.Array]:
    """(element value q, q * 2^e) of a column with fixed power-of-two scales `x` = 2^e (1 / x is exact); E2M1
    (MXFP4) or E4M3 (MXFP8), round to nearest even, saturating, as `jaxlowfp.mx`."""
    q = formats.get(MX_ELEMENTS[kind]).round(col * (1.0 / x), saturate=True)
    return q, q * x


def pack_nvfp4(q: jax.Array, scales: jax.Array, s_dec: jax.Array, fmt: Format) -> QArray:
    """The NVFP4 `jaxlowfp.QArray` of [out, in] from E2M1 values `q` [out, in], per-row block scales `scales`
    [out, in / 16] (float32 E4M3 values) and the decode scale."""
    out, k = q.shape
    codes = formats.E2M1.encode(q)  # sign << 3 | magnitude index, as QArray stores them
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # element 2j in the low nibble
    if fmt.rows > 1:
        scales = scales[:: fmt.rows]
    return QArray(codes=packed, scales=scales.astype(jnp.float8_e4m3fn), global_scale=s_dec, format=fmt,
                  dtype=jnp.dtype(jnp.float32), shape=(out, k))


# old names (one release): ptq.TensorFormat is jaxlowfp.Format (its NVFP4 rule defaulted to "mse")
__getattr__ = deprecated_getattr(__name__, {"TensorFormat": ("jaxlowfp.Format", lambda: LegacyTensorFormat)})
