"""What a QAT matmul quantizes: :class:`QuantSpec` (one tensor), :class:`Recipe` (weights, activations, gradients),
their state and statistics pytrees, and the recipe factories (``hif8_w8a8``, ``nvfp4_w4a4``, ``nvfp4_training``,
``if4_w4a4``, ``if4_training``, ``fp8_delayed``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple, cast

import jax
import numpy as np

from jaxlowfp import dispatch, formats, registry
from jaxlowfp._core import format as _format
from jaxlowfp._core.checks import one_of
from jaxlowfp._core.deprecation import renamed_kwarg
from jaxlowfp._core.if4_blocks import IFConfig, IFRule
from jaxlowfp._core.nvfp4_blocks import NVFP4Config, NVFP4Rule, Rounding
from jaxlowfp.scaling import (Algorithm, AmaxHistory, Convention, CurrentScaling, DelayedScaling, PendingAmax,
                              Scaling, StaticScaling)

FORMATS = registry.QAT_FORMATS
GEMMS = ("dequant", "auto", "scaled_matmul", "fp8")  # jaxlowfp.backends.BACKENDS
MX_ELEMENTS = {"mxfp4": "e2m1", "mxfp8": "e4m3"}  # OCP MX: E8M0 scale per 32 values along K
CLIPS = ("target", "format")
STES = ("identity", "masked")
ROUNDINGS = registry.ROUNDINGS
NVFP4_RULES = registry.NVFP4_RULES
IF4_RULES = registry.IF_RULES
NVFP4_BLOCKS = registry.NVFP4_BLOCK_SHAPES
NVFP4_ELEMENT_MAX = 6.0  # E2M1
KERNELS = {"hif8": "hif8.scaled_fake_quant", "nvfp4": "nvfp4.fake_quantize"}  # kernel names in jaxlowfp.dispatch
MAX_ELEMENTS = 2**31 - 1  # the int32 counters of QuantStats (sums over the tensor) are exact up to here


def convention(spec: QuantSpec) -> str:
    """The scaling convention of `spec` ("default" for current scaling)."""
    return getattr(spec.scaling, "convention", "default")


def two_level(spec: QuantSpec) -> tuple[NVFP4Rule, tuple[int, int]]:
    """An NVFP4 / IF4 spec's block rule and block shape (``__post_init__`` sets both for these formats only)."""
    if spec.rule is None or spec.block_shape is None:
        raise ValueError(f"format={spec.format!r} has no block rule or block shape (NVFP4 and IF4 have them)")
    return spec.rule, spec.block_shape


def check_size(shape: tuple, what: str) -> None:
    """Refuse tensors whose element count the int32 counters cannot hold (a trace-time check of the shape)."""
    n = 1
    for d in shape:
        n *= int(d)
    if n > MAX_ELEMENTS:
        raise ValueError(f"{what} has {n} elements (shape {tuple(shape)}); the quantizer's int32 counters "
                         f"(QuantStats) hold at most 2**31 - 1 = {MAX_ELEMENTS}: split the tensor (e.g. the matmul "
                         f"along its rows) into parts below that")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """How one tensor is quantized.

    Attributes:
      format: "hif8" (default), "e4m3", "e5m2" (per-tensor scaled 8-bit), "nvfp4" (E2M1 with E4M3 block scales
        and a float32 per-tensor scale; the two-level scale is computed by :mod:`jaxlowfp.nvfp4`, and `scaling`
        only supplies its global amax when delayed) or "if4" (the same two-level scale, each block on the E2M1 or
        the INT4 grid: :mod:`jaxlowfp.if4`; everything said about NVFP4 below applies to it), "mxfp4" / "mxfp8"
        (OCP MX: E2M1 / E4M3 elements with an E8M0 scale per 32 values along the contraction axis, OCP floor
        rule, :mod:`jaxlowfp.mx`; no tensor scale, so only current scaling, round to nearest).
      scaling: a :class:`~jaxlowfp.scaling.DelayedScaling`, :class:`~jaxlowfp.scaling.CurrentScaling` (per tensor
        or per token) or :class:`~jaxlowfp.scaling.StaticScaling` (a calibrated amax); default
        ``CurrentScaling(target_max=<format default>)`` (15 for HiF8, 6 for NVFP4).
      target_max: clip bound for ``clip="target"``; default ``scaling.target_max`` (the value amax maps to), so
        the paper's HiF8 setting clips the scaled tensor at 15. Must not exceed the format's max. NVFP4: must be
        6 (its two-level scale is fixed by the rule; the scaling supplies only the global amax).
      clip: "target" clips ``x / scale`` at ``+-target_max`` before rounding; "format" at the format's max.
      ste: "identity" (gradient passes unchanged) or "masked" (zero gradient where the value was clipped).
      rule, block_shape: NVFP4 / IF4 only: the block-scale rule (NVFP4: "static_6" = standard NVFP4, "mse" = Four
        Over Six with MSE selection,
        ..., "search"; IF4: the grid choice "mse", "mae" or "abs_max") and the block, (1, 16) or (16, 16) (2D,
        weights). Default: NVFP4 "static_6", IF4 "mse", and (1, 16); must stay None for 8-bit formats.
        ``format`` may also be a :class:`~jaxlowfp.Format` or a format name ("nvfp4-mse", "fp8"): it then gives
        the kind, rule and block shape.
      rounding: "nearest", "stochastic", "stochastic_unbiased" or "ms_eden" (NVFP4 / IF4 only; all but "nearest"
        need a PRNG key; see :mod:`jaxlowfp.nvfp4` for the unbiased variants; "ms_eden" needs rule "static_6"
        for NVFP4, "mse" for IF4, and 1x16 blocks).
      hadamard: gradient spec only: apply the 16-point randomized Hadamard transform to both operands of the
        weight-gradient GEMM before quantizing them (NVFP4 training recipe).
      impl: "auto" (Pallas kernel on a GPU that supports it, XLA elsewhere), "xla" (the jnp code) or "pallas"
        (the kernel, or a clear error where it cannot run; see :mod:`jaxlowfp.dispatch`). Kernels exist for
        "hif8" and "nvfp4" (round to nearest).
      pallas_backend: the Pallas backend of ``impl="pallas"``/``"auto"``: "triton" or "mosaic" (Mosaic GPU,
        sm_90+); ``backend=`` is its deprecated name.
    """

    format: Literal["hif8", "e4m3", "e5m2", "nvfp4", "if4", "mxfp4", "mxfp8"] = "hif8"  # or a Format: see above
    # None is accepted and replaced in __post_init__ (the format's default), so a built spec always holds a value
    scaling: Scaling = None  # type: ignore[assignment]
    target_max: float = None  # type: ignore[assignment]
    clip: Literal["target", "format"] = "target"
    ste: Literal["identity", "masked"] = "identity"
    rule: NVFP4Rule | None = None  # NVFP4's rules; IF4 takes the 4/6 ones (IFRule)
    block_shape: tuple[int, int] | None = None
    rounding: Rounding = "nearest"
    hadamard: bool = False
    impl: Literal["auto", "xla", "pallas"] = "auto"
    pallas_backend: Literal["triton", "mosaic"] = "triton"
    backend: dataclasses.InitVar[str | None] = None  # deprecated name of pallas_backend

    def __post_init__(self, backend: str | None = None) -> None:
        if backend is not None:
            object.__setattr__(self, "pallas_backend", renamed_kwarg(
                "QuantSpec", "backend", backend, "pallas_backend", self.pallas_backend, "triton", stacklevel=5))
        self._take_format()
        one_of(self.format, FORMATS, "format")
        one_of(self.impl, dispatch.IMPLS, "impl")
        one_of(self.pallas_backend, dispatch.PALLAS_BACKENDS, "pallas_backend")
        if self.impl == "pallas" and (self.format not in KERNELS or self.rounding != "nearest"):
            raise ValueError(
                f"impl='pallas' has kernels for format 'hif8' and for 'nvfp4' with rounding='nearest'; got "
                f"format={self.format!r}, rounding={self.rounding!r} (use impl='xla' or 'auto')"
            )
        one_of(self.clip, CLIPS, "clip")
        one_of(self.ste, STES, "ste")
        if self.impl == "pallas" and getattr(self.scaling, "convention", "default") != "default":
            raise ValueError(f"impl='pallas': the kernel scales by 1 / scale, not the way convention="
                             f"{getattr(self.scaling, 'convention', 'default')!r} does; use impl='xla' or 'auto'")
        one_of(self.rounding, ROUNDINGS, "rounding")
        if not isinstance(self.hadamard, bool):
            raise TypeError(f"hadamard must be a bool; got {self.hadamard!r}")
        fmt_max = NVFP4_ELEMENT_MAX if self.is_nvfp4 else self.element_format.max_finite
        if self.scaling is None:
            default = NVFP4_ELEMENT_MAX if self.is_nvfp4 else self.element_format.default_target_max
            object.__setattr__(self, "scaling", CurrentScaling(target_max=default))
        if not isinstance(self.scaling, (DelayedScaling, CurrentScaling, StaticScaling)):
            raise TypeError(
                f"scaling must be a DelayedScaling, CurrentScaling or StaticScaling; got {type(self.scaling).__name__}"
            )
        if self.is_mx and not (isinstance(self.scaling, CurrentScaling) and self.scaling.granularity == "tensor"):
            raise ValueError(f"format={self.format!r} has no tensor scale (its E8M0 block scales come from each "
                             f"block of 32), so it takes the default CurrentScaling only; got {self.scaling!r}")
        if self.is_nvfp4:
            self._check_nvfp4()
            if self.scaling.target_max != NVFP4_ELEMENT_MAX or self.target_max not in (None, NVFP4_ELEMENT_MAX):
                raise ValueError(
                    f"format={self.format!r} maps the global amax to 6 * E inside jaxlowfp.{self.format}, so "
                    f"target_max (and scaling.target_max) must be 6.0, the E2M1 max; got "
                    f"target_max={self.target_max!r}, "
                    f"scaling.target_max={self.scaling.target_max!r}"
                )
        else:
            for field in ("rule", "block_shape"):
                if getattr(self, field) is not None:
                    raise ValueError(f"{field}={getattr(self, field)!r} applies to format='if4' or "
                                     f"format='nvfp4' only; got format={self.format!r}")
            if self.rounding != "nearest":
                raise ValueError(f"rounding={self.rounding!r} is implemented for format='if4' and format='nvfp4' "
                                 f"only; got format={self.format!r} (use rounding='nearest')")
            if self.scaling.target_max > fmt_max:
                raise ValueError(
                    f"scaling.target_max={self.scaling.target_max} exceeds the {self.format} max finite value "
                    f"{fmt_max}; allowed: (0, {fmt_max}]"
                )
        if self.target_max is None:
            object.__setattr__(self, "target_max", self.scaling.target_max)
        if isinstance(self.target_max, bool) or not isinstance(self.target_max, (int, float, np.floating)):
            raise TypeError(f"target_max must be a positive number; got {self.target_max!r}")
        if not (0 < float(self.target_max) <= fmt_max):
            raise ValueError(f"target_max={self.target_max!r} is outside (0, {fmt_max}], the range of "
                             f"format={self.format!r}")
        object.__setattr__(self, "target_max", float(self.target_max))

    def _take_format(self) -> None:
        """``format=`` as a :class:`~jaxlowfp.Format` or one of its names ("nvfp4-mse", "fp8", ...) becomes its
        kind, rule and block shape here (a rule or block shape given as well must agree with it)."""
        fmt: Any = self.format
        if isinstance(fmt, str):
            if fmt in FORMATS or fmt not in _format.FORMATS and "-" not in fmt:
                return  # a kind ("hif8", "e4m3", "nvfp4", ...), with rule= and block_shape= as given
            try:
                fmt = _format.Format.parse(fmt)
            except ValueError:
                return  # refused by the caller with the list of allowed names
        if not isinstance(fmt, _format.Format):
            raise TypeError(f"format must be a jaxlowfp.Format or a format name; got {type(fmt).__name__}: {fmt!r}")
        if fmt.arithmetic not in (None, "jaxlowfp") or (fmt.is_mx and fmt.rule != "floor"):
            raise ValueError(f"QuantSpec quantizes in jaxlowfp's arithmetic, MX with OCP's floor rule; got {fmt!r}")
        if fmt.two_level:
            for field, value in (("rule", fmt.rule), ("block_shape", fmt.block_shape)):
                given = getattr(self, field)
                given = tuple(given) if isinstance(given, list) else given
                if given is not None and given != value:
                    raise ValueError(f"format={fmt!r} has {field}={value!r}; got {field}={given!r} as well")
                object.__setattr__(self, field, value)
        object.__setattr__(self, "format", {"fp8": "e4m3"}.get(fmt.kind, fmt.kind))

    def _check_nvfp4(self) -> None:
        # "nvfp4" is standard NVFP4; IF4's default is its paper's mse choice
        rule: NVFP4Rule = self.rule if self.rule is not None else ("static_6" if self.format == "nvfp4" else "mse")
        object.__setattr__(self, "rule", rule)
        one_of(rule, NVFP4_RULES if self.format == "nvfp4" else IF4_RULES, "rule")
        block: Any = (1, 16) if self.block_shape is None else self.block_shape
        if isinstance(block, list):
            block = tuple(block)
        object.__setattr__(self, "block_shape", block)
        one_of(block, NVFP4_BLOCKS, "block_shape")
        if block[0] > 1 and getattr(self.scaling, "granularity", "tensor") == "token":
            raise ValueError(f"block_shape={block} tiles span {block[0]} rows, which one scale "
                             f"per token cannot give them; per-token scaling takes (1, 16) blocks")
        if self.format == "nvfp4":  # the combinations the quantizer accepts (e.g. ms_eden: static_6, 1x16)
            NVFP4Config(rule=rule, block_shape=block, rounding=self.rounding)
        else:
            IFConfig(format="if4", rule=cast(IFRule, rule), block_shape=block, rounding=self.rounding)

    @property
    def is_nvfp4(self) -> bool:
        """Whether the tensor is two-level block-scaled ("nvfp4" or "if4": E4M3 scales per 16, an FP32 tensor
        scale, blocks along the GEMM's contraction axis)."""
        return self.format in ("nvfp4", "if4")

    @property
    def is_mx(self) -> bool:
        """Whether the tensor is OCP MX block-scaled ("mxfp4", "mxfp8": E8M0 scales per 32 along the contraction)."""
        return self.format in MX_ELEMENTS

    @property
    def is_block_scaled(self) -> bool:
        """Whether the tensor has per-block scales along the contraction axis (NVFP4, IF4, MX): it then needs the
        linear layout and whole blocks."""
        return self.is_nvfp4 or self.is_mx

    @property
    def blocks(self) -> tuple[int, int] | None:
        """The scale block (rows, values along K): NVFP4 / IF4 its block_shape, MX (1, 32); None per tensor."""
        return self.block_shape if self.is_nvfp4 else ((1, 32) if self.is_mx else None)

    @property
    def element_format(self) -> formats.ElementFormat:
        """The element format descriptor (E2M1 for NVFP4 and MXFP4, E4M3 for MXFP8)."""
        if self.is_mx:
            return formats.get(MX_ELEMENTS[self.format])
        return formats.E2M1 if self.is_nvfp4 else formats.get(self.format)

    @property
    def clip_bound(self) -> float:
        """c in ``clip(x / scale, +-c)``: target_max, or the format max for ``clip="format"``."""
        assert self.target_max is not None  # set by __post_init__
        return self.target_max if self.clip == "target" else self.element_format.max_finite

    def init(self) -> AmaxHistory:
        assert self.scaling is not None  # set by __post_init__
        return self.scaling.init()


class QuantStats(NamedTuple):
    """Telemetry of one quantized tensor at one step (all scalars; cheap enough to leave on).

    Attributes:
      amax: f32[] max |x| (NaN if x has a NaN).
      amax_estimate: f32[] the estimate the scale came from.
      scale: f32[] dequant multiplier (NVFP4: the per-tensor decode scale ``est / (M * E)``).
      saturated_fraction: f32[] fraction of elements clipped (``|x| / scale > c``; NVFP4: ``|x| > est``).
      underflow_fraction: f32[] fraction of elements that are nonzero but quantize to zero.
      nonfinite_count: i32[] number of NaN/Inf elements.
    """

    amax: jax.Array
    amax_estimate: jax.Array
    scale: jax.Array
    saturated_fraction: jax.Array
    underflow_fraction: jax.Array
    nonfinite_count: jax.Array


class RecipeState(NamedTuple):
    """Scale state of one quantized matmul: amax histories of the weight (rhs) and activation (lhs) operands and,
    when the output gradient uses delayed scaling, its history and the amax the last backward pass reported.

    ``grad_pending`` is the part of the state a backward pass writes: differentiate the loss w.r.t. it too and
    keep that gradient as its new value (:func:`jaxlowfp.scaling.pending_amaxes`); the next call records it into
    ``grad`` before the backward pass reads ``grad``. Both are None for recipes without delayed gradient scaling
    (and then the pytree has the leaves of the two-field state of earlier versions, so old checkpoints load).
    """

    weight: AmaxHistory | None
    activation: AmaxHistory | None
    grad: AmaxHistory | None = None
    grad_pending: PendingAmax | None = None


def _recipe_state_flatten(rs: RecipeState) -> tuple[list, tuple[str, ...]]:
    # The gradient fields are children only when set: a state without them has exactly the key paths of the
    # two-field RecipeState of earlier versions, so orbax restores their checkpoints into it.
    names = ("weight", "activation") + tuple(f for f in ("grad", "grad_pending") if getattr(rs, f) is not None)
    return [(jax.tree_util.GetAttrKey(n), getattr(rs, n)) for n in names], names


jax.tree_util.register_pytree_with_keys(
    RecipeState, _recipe_state_flatten, lambda names, children: RecipeState(**dict(zip(names, children))))


class RecipeStats(NamedTuple):
    """:class:`QuantStats` of the weight and activation operands of one quantized matmul (None: not quantized)."""

    weight: QuantStats | None
    activation: QuantStats | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """What a quantized matmul quantizes: weights, activations and (backward) output gradients.

    Attributes:
      weight, activation: :class:`QuantSpec` of the rhs / lhs operand, or None (kept in high precision).
      grad: :class:`QuantSpec` of the output gradient in the backward pass, or None (straight-through backward in
        the operands' precision). :class:`~jaxlowfp.scaling.CurrentScaling`, or (8-bit formats without Hadamard)
        :class:`~jaxlowfp.scaling.DelayedScaling`: its history is ``RecipeState.grad``, fed through
        ``RecipeState.grad_pending``. ``grad.hadamard`` applies the 16-point Hadamard transform to both
        weight-gradient operands.
      name: a label for reports.
      gemm: where the forward product runs (`jaxlowfp.qat.gemm`): "dequant" (default: the dequantized operands in
        high precision), "fp8" (cuBLASLt's FP8 GEMM on the E4M3 codes), "scaled_matmul" (``jax.nn.scaled_matmul``
        on the NVFP4 / MX codes and block scales) or "auto" (the device's native GEMM, else dequant). The backward
        pass is the same for all.
    """

    weight: QuantSpec | None = None
    activation: QuantSpec | None = None
    grad: QuantSpec | None = None
    name: str = "custom"
    gemm: Literal["dequant", "auto", "scaled_matmul", "fp8"] = "dequant"

    def __post_init__(self) -> None:
        for role in ("weight", "activation", "grad"):
            spec = getattr(self, role)
            if spec is not None and not isinstance(spec, QuantSpec):
                raise TypeError(f"{role} must be a QuantSpec or None; got {type(spec).__name__}")
            if role != "grad" and spec is not None and spec.hadamard:
                raise ValueError(f"{role}.hadamard=True: the Hadamard transform applies to the weight-gradient "
                                 f"operands; set hadamard=True on recipe.grad instead")
        if self.weight is None and self.activation is None and self.grad is None:
            raise ValueError("a Recipe that quantizes nothing would run in high precision; set weight, activation "
                             "or grad (or call the plain op without a recipe)")
        token = [r for r in ("weight", "activation", "grad") if getattr(self, r) is not None
                 and getattr(getattr(self, r).scaling, "granularity", "tensor") == "token"]
        if token and self.grad is not None:
            raise ValueError(f"recipe {self.name!r}: per-token scaling ({', '.join(token)}) is implemented for the "
                             f"forward product with a straight-through backward (grad=None): the quantized backward "
                             f"re-quantizes operands per tensor")
        mx = [r for r in ("weight", "activation", "grad") if getattr(self, r) is not None and getattr(self, r).is_mx]
        if mx and self.grad is not None:
            raise ValueError(f"recipe {self.name!r}: MX formats ({', '.join(mx)}) are implemented for the forward "
                             f"product with a straight-through backward (grad=None); quantized gradients with MX "
                             f"operands are not (use NVFP4 for a quantized backward)")
        if self.grad is not None and self.delayed_grad and (self.grad.is_nvfp4 or self.grad.hadamard):
            raise ValueError(f"delayed scaling of the output gradient is implemented for the per-tensor 8-bit "
                             f"formats without Hadamard; got grad format={self.grad.format!r}, hadamard="
                             f"{self.grad.hadamard} (use CurrentScaling for grad)")
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str; got {self.name!r}")
        one_of(self.gemm, GEMMS, "gemm")

    @property
    def delayed_grad(self) -> bool:
        """Whether the output gradient uses delayed scaling (the state then has ``grad`` and ``grad_pending``)."""
        return self.grad is not None and isinstance(self.grad.scaling, DelayedScaling)

    @property
    def needs_key(self) -> bool:
        """Whether some operand uses stochastic rounding (the op then needs a PRNG key per call)."""
        return any(s is not None and s.rounding != "nearest" for s in (self.weight, self.activation, self.grad))

    def init(self) -> RecipeState:
        """Fresh state: one amax history per quantized forward operand (and the output gradient's, if delayed)."""
        return RecipeState(
            weight=None if self.weight is None else self.weight.init(),
            activation=None if self.activation is None else self.activation.init(),
            grad=self.grad.init() if self.grad is not None and self.delayed_grad else None,
            grad_pending=PendingAmax.none() if self.delayed_grad else None,
        )


def hif8_w8a8(
    *, algorithm: Algorithm = "max_window", history_len: int = 64, target_max: float = 15.0, margin: float = 0.0
) -> Recipe:
    """The Max-Window paper's HiF8 W8A8 QAT: per-tensor delayed scaling (max over 64 steps), clip at 15,
    straight-through backward, gradients not quantized."""
    scaling = DelayedScaling(algorithm=algorithm, history_len=history_len, target_max=target_max, margin=margin)
    spec = QuantSpec(format="hif8", scaling=scaling, clip="target", ste="identity")
    return Recipe(weight=spec, activation=spec, grad=None, name="hif8_w8a8")


def nvfp4_w4a4(rule: NVFP4Rule = "mse") -> Recipe:
    """NVFP4 W4A4 (fouroversix PTQ / fake-quant): 1x16 blocks, current per-tensor amax, round to nearest."""
    spec = QuantSpec(format="nvfp4", rule=rule, block_shape=(1, 16))
    return Recipe(weight=spec, activation=spec, grad=None, name=f"nvfp4_w4a4_{rule}")


def nvfp4_training(rule: NVFP4Rule = "mse", grad_rounding: Rounding = "stochastic") -> Recipe:
    """NVFP4 training (NVIDIA recipe, fouroversix's FourOverSixLinearFunction): 16x16 weight blocks, 1x16
    activation and gradient blocks, stochastic rounding on gradients, Hadamard on both wgrad operands.
    ``grad_rounding``: "stochastic" (default), "stochastic_unbiased" or "ms_eden" (Quartet II; its gradients use
    the static_6 block scale, the EDEN correction replacing 4/6)."""
    grad_rule = "static_6" if grad_rounding == "ms_eden" else rule
    suffix = "" if grad_rounding == "stochastic" else f"_{grad_rounding}"
    return Recipe(
        weight=QuantSpec(format="nvfp4", rule=rule, block_shape=(16, 16)),
        activation=QuantSpec(format="nvfp4", rule=rule, block_shape=(1, 16)),
        grad=QuantSpec(format="nvfp4", rule=grad_rule, block_shape=(1, 16), rounding=grad_rounding, hadamard=True),
        name=f"nvfp4_training_{rule}{suffix}",
    )


def if4_w4a4(rule: IFRule = "mse") -> Recipe:
    """IF4 W4A4 (fouroversix ``DataType.if4`` PTQ / fake-quant): 1x16 blocks, current per-tensor amax, round to
    nearest, each block on the E2M1 or INT4 grid by `rule`."""
    spec = QuantSpec(format="if4", rule=rule, block_shape=(1, 16))
    return Recipe(weight=spec, activation=spec, grad=None, name=f"if4_w4a4_{rule}")


def if4_training(rule: IFRule = "mse", grad_rounding: Rounding = "stochastic_unbiased") -> Recipe:
    """IF4 training as fouroversix's ``transformer_340M_if4.json`` (IF4 with ``scale_rule`` mse,
    ``gradient_round_style`` stochastic_unbiased) on the layout of :func:`nvfp4_training` (16x16 weight tiles,
    Hadamard on both wgrad operands); ``grad_rounding="ms_eden"`` is its ``_mseden`` variant's gradient rounding
    (fouroversix applies MS-EDEN to both operands of both backward GEMMs; here to the output gradient)."""
    grad_rule = "mse" if grad_rounding == "ms_eden" else rule
    return Recipe(
        weight=QuantSpec(format="if4", rule=rule, block_shape=(16, 16)),
        activation=QuantSpec(format="if4", rule=rule, block_shape=(1, 16)),
        grad=QuantSpec(format="if4", rule=grad_rule, block_shape=(1, 16), rounding=grad_rounding, hadamard=True),
        name=f"if4_training_{rule}_{grad_rounding}",
    )




def fp8_delayed(
    *, history_len: int = 1024, margin: int = 0, algorithm: Algorithm = "max_window", convention: Convention = "default"
) -> Recipe:
    """FP8 with delayed scaling, as in Transformer Engine and Flax ``fp8_ops``: E4M3 weights and activations, E5M2
    output gradients, each with its own amax history (max over the last `history_len` = 1024 steps), the amax
    mapped to the format's max (448, 57344) and values clipped there; straight-through backward.

    ``convention="flax"`` reproduces ``flax.linen.fp8_ops.Fp8DotGeneralOp`` bit for bit (outputs, gradients,
    histories), ``"te"`` Transformer Engine's scales and codes; see ``docs/from_flax_fp8_and_te.md``."""
    def spec(fmt: Literal["e4m3", "e5m2"], target: float) -> QuantSpec:
        s = DelayedScaling(algorithm=algorithm, history_len=history_len, target_max=target, margin=margin,
                           convention=convention)
        return QuantSpec(format=fmt, scaling=s, clip="format", ste="identity")

    fwd = spec("e4m3", formats.E4M3.max_finite)
    return Recipe(weight=fwd, activation=fwd, grad=spec("e5m2", formats.E5M2.max_finite),
                  name=f"fp8_delayed_{convention}" if convention != "default" else "fp8_delayed")


def named_recipe(name: str) -> Recipe:
    """The W-A recipe of a name in :data:`jaxlowfp.registry.EVAL_QUANTIZE` (what the lm-eval backend's
    ``quantize=`` and ``python -m train eval --quantize`` take): ``hif8`` (:func:`hif8_w8a8`), ``fp8``
    (:func:`fp8_delayed`), ``nvfp4`` (:func:`nvfp4_w4a4` with standard NVFP4's ``static_6``), ``nvfp4-<rule>``
    (Four Over Six: ``nvfp4-mse``, ...), ``if4-<rule>``
    (:func:`if4_w4a4`)."""
    if name not in registry.EVAL_QUANTIZE or name == "none":
        raise ValueError(f"recipe name {name!r}; allowed: {', '.join(registry.EVAL_QUANTIZE[1:])}")
    if name == "hif8":
        return hif8_w8a8()
    if name == "fp8":
        return fp8_delayed()
    if name == "nvfp4":
        return nvfp4_w4a4("static_6")
    kind, rule = name.split("-", 1)
    return if4_w4a4(cast(IFRule, rule)) if kind == "if4" else nvfp4_w4a4(cast(NVFP4Rule, rule))
