"""Quantization-aware training ops: scaled fake-quant with straight-through gradients, quantized matmuls, recipes.

One quantized tensor, per step (``spec`` a :class:`QuantSpec`, ``state`` its :class:`~jaxlowfp.scaling.AmaxHistory`)::

    amax  = max |x|                                  (NaN-propagating)
    est   = spec.scaling.amax_estimate(state, amax)  (delayed: from earlier steps; current: amax)
    scale = est / target_max                         (1 when est is 0, NaN or Inf)
    y     = fmt.round(clip(x * (1 / scale), +-c)) * scale     c = target_max ("target") or fmt.max_finite ("format")
    dy/dx = 1  (ste="identity")   or   [|x / scale| <= c]  (ste="masked")
    state' = spec.scaling.update(state, amax)

``observe_only`` (the high-precision warmup) returns ``y = x`` bit for bit and still updates the state and the
statistics, so the amax history is warm when quantization starts.

A matmul (:func:`dot_general`, :func:`linear`) fake-quantizes its activation (lhs) and weight (rhs) operands per a
:class:`Recipe`. If the recipe quantizes gradients, the backward pass quantizes the output gradient with current
scaling (no state in the backward), optionally with stochastic rounding and a 16-point Hadamard transform on both
weight-gradient operands; block-scaled (NVFP4) operands are re-quantized from high precision along the axis the
backward GEMM contracts, never reusing forward block scales.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxlowfp import dispatch, formats, nvfp4
from jaxlowfp._checks import float_input, one_of
from jaxlowfp._reduce import abs_max
from jaxlowfp.scaling import AmaxHistory, CurrentScaling, DelayedScaling, Scaling

__all__ = [
    "QuantSpec",
    "QuantStats",
    "Recipe",
    "RecipeState",
    "RecipeStats",
    "Warmup",
    "scaled_round",
    "saturation_bound",
    "observe_flag",
    "fake_quant",
    "dot_general",
    "linear",
    "hif8_w8a8",
    "nvfp4_w4a4",
    "nvfp4_training",
]

FORMATS = ("hif8", "e4m3", "e5m2", "nvfp4")
CLIPS = ("target", "format")
STES = ("identity", "masked")
ROUNDINGS = ("nearest", "stochastic")
NVFP4_RULES = nvfp4.RULES
NVFP4_BLOCKS = nvfp4.BLOCK_SHAPES
NVFP4_ELEMENT_MAX = 6.0  # E2M1
_KERNELS = {"hif8": "hif8.scaled_fake_quant", "nvfp4": "nvfp4.fake_quantize"}  # kernel names in jaxlowfp.dispatch


# ----------------------------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """How one tensor is quantized.

    Attributes:
      format: "hif8" (default), "e4m3", "e5m2" (per-tensor scaled 8-bit) or "nvfp4" (E2M1 with E4M3 block scales
        and a float32 per-tensor scale; the two-level scale is computed by :mod:`jaxlowfp.nvfp4`, and `scaling`
        only supplies its global amax when delayed).
      scaling: a :class:`~jaxlowfp.scaling.DelayedScaling` or :class:`~jaxlowfp.scaling.CurrentScaling`; default
        ``CurrentScaling(target_max=<format default>)`` (15 for HiF8, 6 for NVFP4).
      target_max: clip bound for ``clip="target"``; default ``scaling.target_max`` (the value amax maps to), so
        the paper's HiF8 setting clips the scaled tensor at 15. Must not exceed the format's max. NVFP4: must be
        6 (its two-level scale is fixed by the rule; the scaling supplies only the global amax).
      clip: "target" clips ``x / scale`` at ``+-target_max`` before rounding; "format" at the format's max.
      ste: "identity" (gradient passes unchanged) or "masked" (zero gradient where the value was clipped).
      rule, block_shape: NVFP4 only: the block-scale rule ("mse" = Four Over Six with MSE selection, ...) and the
        block, (1, 16) or (16, 16) (2D, weights). Default "mse" and (1, 16); must stay None for 8-bit formats.
      rounding: "nearest" or "stochastic" (NVFP4 only; needs a PRNG key).
      hadamard: gradient spec only: apply the 16-point randomized Hadamard transform to both operands of the
        weight-gradient GEMM before quantizing them (NVFP4 training recipe).
      impl: "auto" (Pallas kernel on a GPU that supports it, XLA elsewhere), "xla" (the jnp code) or "pallas"
        (the kernel, or a clear error where it cannot run; see :mod:`jaxlowfp.dispatch`). Kernels exist for
        "hif8" and "nvfp4" (round to nearest).
    """

    format: Literal["hif8", "e4m3", "e5m2", "nvfp4"] = "hif8"
    scaling: Scaling | None = None
    target_max: float | None = None
    clip: Literal["target", "format"] = "target"
    ste: Literal["identity", "masked"] = "identity"
    rule: str | None = None
    block_shape: tuple[int, int] | None = None
    rounding: Literal["nearest", "stochastic"] = "nearest"
    hadamard: bool = False
    impl: Literal["auto", "xla", "pallas"] = "auto"

    def __post_init__(self) -> None:
        one_of(self.format, FORMATS, "format")
        one_of(self.impl, dispatch.IMPLS, "impl")
        if self.impl == "pallas" and (self.format not in _KERNELS or self.rounding == "stochastic"):
            raise ValueError(
                f"impl='pallas' has kernels for format 'hif8' and for 'nvfp4' with rounding='nearest'; got "
                f"format={self.format!r}, rounding={self.rounding!r} (use impl='xla' or 'auto')"
            )
        one_of(self.clip, CLIPS, "clip")
        one_of(self.ste, STES, "ste")
        one_of(self.rounding, ROUNDINGS, "rounding")
        if not isinstance(self.hadamard, bool):
            raise TypeError(f"hadamard must be a bool; got {self.hadamard!r}")
        fmt_max = NVFP4_ELEMENT_MAX if self.is_nvfp4 else self.element_format.max_finite
        if self.scaling is None:
            default = NVFP4_ELEMENT_MAX if self.is_nvfp4 else self.element_format.default_target_max
            object.__setattr__(self, "scaling", CurrentScaling(target_max=default))
        if not isinstance(self.scaling, (DelayedScaling, CurrentScaling)):
            raise TypeError(
                f"scaling must be a DelayedScaling or CurrentScaling; got {type(self.scaling).__name__}"
            )
        if self.is_nvfp4:
            self._check_nvfp4()
            if self.scaling.target_max != NVFP4_ELEMENT_MAX or self.target_max not in (None, NVFP4_ELEMENT_MAX):
                raise ValueError(
                    f"format='nvfp4' maps the global amax to 6 * E inside jaxlowfp.nvfp4, so target_max (and "
                    f"scaling.target_max) must be 6.0, the E2M1 max; got target_max={self.target_max!r}, "
                    f"scaling.target_max={self.scaling.target_max!r}"
                )
        else:
            for field in ("rule", "block_shape"):
                if getattr(self, field) is not None:
                    raise ValueError(f"{field}={getattr(self, field)!r} applies to format='nvfp4' only; got "
                                     f"format={self.format!r}")
            if self.rounding == "stochastic":
                raise ValueError(f"rounding='stochastic' is implemented for format='nvfp4' only; got "
                                 f"format={self.format!r} (use rounding='nearest')")
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

    def _check_nvfp4(self) -> None:
        if self.rule is None:
            object.__setattr__(self, "rule", "mse")
        one_of(self.rule, NVFP4_RULES, "rule")
        if self.block_shape is None:
            object.__setattr__(self, "block_shape", (1, 16))
        if isinstance(self.block_shape, list):
            object.__setattr__(self, "block_shape", tuple(self.block_shape))
        one_of(self.block_shape, NVFP4_BLOCKS, "block_shape")

    @property
    def is_nvfp4(self) -> bool:
        return self.format == "nvfp4"

    @property
    def element_format(self) -> formats.Format:
        """The element format descriptor (E2M1 for NVFP4)."""
        return formats.E2M1 if self.is_nvfp4 else formats.get(self.format)

    @property
    def clip_bound(self) -> float:
        """c in ``clip(x / scale, +-c)``: target_max, or the format max for ``clip="format"``."""
        return self.target_max if self.clip == "target" else self.element_format.max_finite

    def init(self) -> AmaxHistory:
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
    """Scale state of one quantized matmul: amax histories of the weight (rhs) and activation (lhs) operands."""

    weight: AmaxHistory | None
    activation: AmaxHistory | None


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
        the operands' precision). Must use :class:`~jaxlowfp.scaling.CurrentScaling`: the backward has no state.
        ``grad.hadamard`` applies the 16-point Hadamard transform to both weight-gradient operands.
      name: a label for reports.
    """

    weight: QuantSpec | None = None
    activation: QuantSpec | None = None
    grad: QuantSpec | None = None
    name: str = "custom"

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
        if self.grad is not None and not isinstance(self.grad.scaling, CurrentScaling):
            raise ValueError(f"grad must use CurrentScaling (the backward pass carries no state); got "
                             f"{type(self.grad.scaling).__name__}")
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str; got {self.name!r}")

    def init(self) -> RecipeState:
        """Fresh state: one amax history per quantized forward operand."""
        return RecipeState(
            weight=None if self.weight is None else self.weight.init(),
            activation=None if self.activation is None else self.activation.init(),
        )


def hif8_w8a8(
    *, algorithm: str = "max_window", history_len: int = 64, target_max: float = 15.0, margin: float = 0.0
) -> Recipe:
    """The Max-Window paper's HiF8 W8A8 QAT: per-tensor delayed scaling (max over 64 steps), clip at 15,
    straight-through backward, gradients not quantized."""
    scaling = DelayedScaling(algorithm=algorithm, history_len=history_len, target_max=target_max, margin=margin)
    spec = QuantSpec(format="hif8", scaling=scaling, clip="target", ste="identity")
    return Recipe(weight=spec, activation=spec, grad=None, name="hif8_w8a8")


def nvfp4_w4a4(rule: str = "mse") -> Recipe:
    """NVFP4 W4A4 (fouroversix PTQ / fake-quant): 1x16 blocks, current per-tensor amax, round to nearest."""
    spec = QuantSpec(format="nvfp4", rule=rule, block_shape=(1, 16))
    return Recipe(weight=spec, activation=spec, grad=None, name=f"nvfp4_w4a4_{rule}")


def nvfp4_training(rule: str = "mse") -> Recipe:
    """NVFP4 training (NVIDIA recipe, fouroversix's FourOverSixLinearFunction): 16x16 weight blocks, 1x16
    activation and gradient blocks, stochastic rounding on gradients, Hadamard on both wgrad operands."""
    return Recipe(
        weight=QuantSpec(format="nvfp4", rule=rule, block_shape=(16, 16)),
        activation=QuantSpec(format="nvfp4", rule=rule, block_shape=(1, 16)),
        grad=QuantSpec(format="nvfp4", rule=rule, block_shape=(1, 16), rounding="stochastic", hadamard=True),
        name=f"nvfp4_training_{rule}",
    )


# ----------------------------------------------------------------------------------------------------------------
# The scaled quantizer


def _scaled_round_mask(x: jax.Array, scale: jax.Array, clip: float, fmt: formats.Format, bound: jax.Array):
    inv = 1.0 / scale  # one scalar IEEE division; the array sees only a multiply (what XLA would emit anyway)
    xf = x.astype(jnp.float32)
    y = (fmt.round(jnp.clip(xf * inv, -clip, clip)) * scale).astype(x.dtype)
    return y, jnp.abs(xf) > bound


def saturation_bound(scale: jax.Array, clip: float, estimate: jax.Array | None = None) -> jax.Array:
    """The float32 magnitude above which an input counts as saturated (clipped): the amax estimate itself when the
    clip is the target (``scale = estimate / target``; comparing ``|x| > estimate`` avoids the one-ulp noise of
    ``|x / scale| > target`` for ``x == estimate``), else ``clip * scale``."""
    bound = jnp.float32(clip) * scale
    if estimate is None:
        return bound
    return jnp.where(jnp.isfinite(estimate) & (estimate > 0), estimate.astype(jnp.float32), bound)


def _check_clip(clip: Any, fmt: formats.Format) -> float:
    if isinstance(clip, bool) or not isinstance(clip, (int, float, np.floating)):
        raise TypeError(f"clip must be a Python number (static); got {type(clip).__name__}")
    if not (0 < float(clip) <= fmt.max_finite):
        raise ValueError(f"clip={clip!r} must be in (0, {fmt.max_finite}], the range of {fmt.name}")
    return float(clip)


def scaled_round(
    x: Any, scale: Any, clip: float, fmt: formats.Format | str, *, bound: Any = None
) -> tuple[jax.Array, jax.Array]:
    """Scaled quantize-dequantize, in float32 (the exact form the Pallas kernel twins)::

        inv = 1 / scale;  xs = f32(x) * inv;  y = dtype_x(fmt.round(clip(xs, -clip, clip)) * scale)

    Returns ``(y, saturated_count)`` with ``saturated_count = #{|f32(x)| > bound}`` (int32; +-Inf counts, NaN
    not); `bound` defaults to ``clip * scale`` (see :func:`saturation_bound`). `scale` is a positive finite float32
    scalar, `clip` a static number in (0, fmt.max_finite].
    """
    fmt = formats.get(fmt)
    x = float_input(x, "x")
    clip = _check_clip(clip, fmt)
    scale = jnp.asarray(jnp.float32(scale) if isinstance(scale, float) else scale)
    if scale.dtype != jnp.float32 or scale.shape != ():
        raise TypeError(f"scale must be a float32 scalar; got dtype {scale.dtype} and shape {scale.shape}")
    bound = saturation_bound(scale, clip) if bound is None else jnp.asarray(bound, jnp.float32)
    y, sat = _scaled_round_mask(x, scale, clip, fmt, bound)
    return y, jnp.sum(sat, dtype=jnp.int32)


def observe_flag(observe_only: Any) -> bool | jax.Array:
    """A Python bool stays static; anything else must be a boolean scalar array (traced is fine)."""
    if isinstance(observe_only, (bool, np.bool_)):
        return bool(observe_only)
    a = jnp.asarray(observe_only)
    if a.dtype != jnp.bool_ or a.shape != ():
        raise TypeError(f"observe_only must be a Python bool or a boolean scalar array; got dtype {a.dtype} and "
                        f"shape {a.shape}")
    return a


def _select(observe: bool | jax.Array, hp: jax.Array, q: jax.Array) -> jax.Array:
    """`hp` where observing (the warmup), else `q`; bitwise, with no arithmetic on either."""
    if isinstance(observe, bool):
        return hp if observe else q
    return jnp.where(observe, hp, q)


def _nvfp4_quantize(x: jax.Array, spec: QuantSpec, global_amax: jax.Array | None, key: jax.Array | None,
                    axis: int = -1) -> jax.Array:
    """NVFP4 fake-quant of `x` with blocks along `axis` (moved last for :func:`jaxlowfp.nvfp4.fake_quantize`)."""
    xt = jnp.moveaxis(x, axis, -1)
    yt = nvfp4.fake_quantize(xt, rule=spec.rule, block_shape=spec.block_shape, global_amax=global_amax,
                             rounding=spec.rounding, key=key if spec.rounding == "stochastic" else None,
                             impl=spec.impl)
    return jnp.moveaxis(yt.astype(x.dtype), -1, axis)


def _need_key(spec: QuantSpec, key: Any, what: str) -> None:
    if spec.rounding == "stochastic" and key is None:
        raise ValueError(f"{what} uses rounding='stochastic' and needs a PRNG key; pass key=jax.random.key(...)")


class _Quantized(NamedTuple):
    y: jax.Array  # forward value: x when observing, else the fake-quantized x (no gradient attached)
    keep: jax.Array | None  # masked STE: where the gradient passes; None for the identity STE
    state: AmaxHistory
    stats: QuantStats
    estimate: jax.Array


def _quantize(x: jax.Array, state: AmaxHistory, spec: QuantSpec, observe: bool | jax.Array,
              key: Any, axis: int = -1) -> _Quantized:
    """Quantize `x` (no gradient): value, STE mask, new state and stats. NVFP4 blocks run along `axis`."""
    if x.size == 0:
        raise ValueError(f"cannot quantize an empty array (shape {x.shape})")
    xs = lax.stop_gradient(x)
    fused = spec.format == "hif8" and dispatch.resolve_impl(spec.impl, kernel=_KERNELS["hif8"]) == "pallas"
    if fused and isinstance(spec.scaling, DelayedScaling):
        # The kernel returns amax from its own pass; a delayed estimate needs this step's amax only while the
        # history is empty (its fallback), so the separate reduction runs only then.
        amax = lax.cond(state.count > 0, lambda: jnp.zeros((), jnp.float32),
                        lambda: abs_max(xs).astype(jnp.float32))
    else:
        amax = abs_max(xs).astype(jnp.float32)
    est = spec.scaling.amax_estimate(state, amax)
    if spec.is_nvfp4:
        _need_key(spec, key, "QuantSpec(format='nvfp4')")
        delayed = isinstance(spec.scaling, DelayedScaling)
        yq = _nvfp4_quantize(xs, spec, est if delayed else None, key, axis)
        sat = (jnp.abs(xs) > est) if delayed else jnp.zeros(xs.shape, jnp.bool_)
        scale = nvfp4.global_scales(est, spec.rule)[1]  # S_dec = 1 / S_enc
        n_sat, n_under = jnp.sum(sat, dtype=jnp.int32), jnp.sum((xs != 0) & (yq == 0), dtype=jnp.int32)
    else:
        scale = spec.scaling.scale(est)
        bound = saturation_bound(scale, spec.clip_bound, est if spec.clip == "target" else None)
        if fused:
            from pallas_kernels import hif8 as hif8_kernel  # one pass: y, amax, saturated and underflow counts

            r = hif8_kernel.scaled_fake_quant(xs, scale, spec.clip_bound, bound=bound)
            yq, amax, n_sat, n_under = r.y, r.amax, r.saturated_count, r.underflow_count
            sat = (jnp.abs(xs.astype(jnp.float32)) > bound) if spec.ste == "masked" else None
        else:
            yq, sat = _scaled_round_mask(xs, scale, spec.clip_bound, spec.element_format, bound)
            n_sat, n_under = jnp.sum(sat, dtype=jnp.int32), jnp.sum((xs != 0) & (yq == 0), dtype=jnp.int32)
    new_state = spec.scaling.update(state, amax)
    n = float(x.size)
    stats = QuantStats(
        amax=amax,
        amax_estimate=est,
        scale=scale,
        saturated_fraction=n_sat.astype(jnp.float32) / n,
        underflow_fraction=n_under.astype(jnp.float32) / n,
        nonfinite_count=jnp.sum(~jnp.isfinite(xs), dtype=jnp.int32),
    )
    keep = None  # identity STE, or masked but observing (nothing was clipped)
    if spec.ste == "masked" and observe is not True:
        keep = ~sat if observe is False else jnp.logical_or(observe, ~sat)
    return _Quantized(_select(observe, xs, yq), keep, new_state, stats, est)


@jax.custom_vjp
def _straight_through(x: jax.Array, y: jax.Array, keep: jax.Array | None) -> jax.Array:
    """Value `y`, gradient w.r.t. `x`: identity (keep None) or masked by `keep`."""
    return y


def _st_fwd(x, y, keep):
    return y, keep


def _st_bwd(keep, g):
    return (g if keep is None else jnp.where(keep, g, jnp.zeros((), g.dtype))), None, None


_straight_through.defvjp(_st_fwd, _st_bwd)


def fake_quant(
    x: Any,
    state: AmaxHistory,
    spec: QuantSpec,
    *,
    observe_only: bool | jax.Array = False,
    key: jax.Array | None = None,
) -> tuple[jax.Array, AmaxHistory, QuantStats]:
    """Scaled quantize-dequantize of `x` with a straight-through gradient.

    Args:
      x: float32/bfloat16/float16 array.
      state: its amax history (``spec.init()``).
      spec: the :class:`QuantSpec`.
      observe_only: Python bool or boolean scalar (traced is fine): return `x` unchanged (bitwise) but still
        record the amax and compute the statistics.
      key: PRNG key, needed for ``rounding="stochastic"``.

    Returns:
      ``(y, new_state, stats)``: `y` in `x`'s dtype; `new_state` has this step's amax recorded; `stats` a
      :class:`QuantStats`.
    """
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec must be a QuantSpec; got {type(spec).__name__}")
    x = float_input(x, "x")
    q = _quantize(x, state, spec, observe_flag(observe_only), key)
    return _straight_through(x, q.y, q.keep), q.state, q.stats


# ----------------------------------------------------------------------------------------------------------------
# Quantized matmul

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def _normalize_dn(dn: Any) -> tuple:
    try:
        (lc, rc), (lb, rb) = dn
        return (tuple(int(i) for i in lc), tuple(int(i) for i in rc)), (tuple(int(i) for i in lb),
                                                                         tuple(int(i) for i in rb))
    except (TypeError, ValueError) as e:
        raise ValueError(f"dimension_numbers must be ((lhs_contract, rhs_contract), (lhs_batch, rhs_batch)); "
                         f"got {dn!r}") from e


def _is_linear(lhs: jax.Array, rhs: jax.Array, dn: tuple) -> bool:
    """lhs [..., K] . rhs [K, M], contracting K, no batch dims: the layout whose backward we re-quantize."""
    return rhs.ndim == 2 and dn == (((lhs.ndim - 1,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class _DotConfig:
    dn: tuple
    precision: Any
    preferred_element_type: Any
    recipe: Recipe
    observe: bool | None  # a static observe_only flag; None: traced, passed as an argument


def _dot(cfg: _DotConfig, a: jax.Array, b: jax.Array) -> jax.Array:
    return lax.dot_general(a, b, cfg.dn, precision=cfg.precision, preferred_element_type=cfg.preferred_element_type)


def _quantize_grad(g: jax.Array, spec: QuantSpec, key: Any, axis: int) -> jax.Array:
    """Current-scaling quantization of a backward operand (no state, no stats); NVFP4 blocks along `axis`."""
    return _quantize(g, spec.init(), spec, False, key, axis).y


def _maybe_hadamard(x: jax.Array, on: bool) -> jax.Array:
    if not on:
        return x
    return nvfp4.hadamard16(x, axis=0).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _qdot(cfg: _DotConfig, lhs, rhs, lhs_q, rhs_q, est_l, est_r, keep_l, keep_r, key, observe):
    return _dot(cfg, lhs_q, rhs_q)


def _qdot_fwd(cfg, lhs, rhs, lhs_q, rhs_q, est_l, est_r, keep_l, keep_r, key, observe):
    out = _dot(cfg, lhs_q, rhs_q)
    return out, (lhs, rhs, lhs_q, rhs_q, est_l, est_r, keep_l, keep_r, key, observe)


def _qdot_bwd(cfg, res, g):
    lhs, rhs, lhs_q, rhs_q, est_l, est_r, keep_l, keep_r, key, observe = res
    observe = cfg.observe if cfg.observe is not None else observe
    r = cfg.recipe
    gs = r.grad
    k_d, k_w = (None, None) if key is None else tuple(jax.random.split(key))
    block_scaled = gs.is_nvfp4 or gs.hadamard or any(s is not None and s.is_nvfp4 for s in (r.weight, r.activation))

    # dgrad = g . rhs^T (contracts rhs's free axis M, the last axis of g and of rhs [K, M])
    g_d = _quantize_grad(g, gs, k_d, axis=-1)
    w_d = rhs_q
    if r.weight is not None and r.weight.is_nvfp4:
        w_d = _nvfp4_quantize(rhs, r.weight, _global_amax(r.weight, est_r), None, axis=1)
    w_d = _select(observe, rhs, w_d)
    g_d = _select(observe, g, g_d)
    _, vjp_l = jax.vjp(lambda a: _dot(cfg, a, w_d), lhs_q)
    (dl,) = vjp_l(g_d)

    # wgrad = lhs^T . g, contracting the token axes: flatten lhs to [N, K] and g to [N, M] for the transform and
    # the blocks (along N), then restore the layout so the GEMM itself is the one autodiff of the plain op runs.
    if block_scaled:
        x2 = lhs.reshape(-1, lhs.shape[-1])
        x_w = _maybe_hadamard(x2, gs.hadamard)
        if r.activation is not None:
            if r.activation.is_nvfp4:
                amax = None if gs.hadamard else _global_amax(r.activation, est_l)  # after the RHT: recomputed
                x_w = _nvfp4_quantize(x_w, r.activation, amax, None, axis=0)
            elif gs.hadamard:
                current = dataclasses.replace(r.activation, scaling=CurrentScaling(
                    target_max=r.activation.scaling.target_max))
                x_w = _quantize_grad(x_w, current, None, axis=0)
            else:
                x_w = lhs_q.reshape(x2.shape)
        x_w = x_w.reshape(lhs.shape)
        g_w = _quantize_grad(_maybe_hadamard(g.reshape(-1, g.shape[-1]), gs.hadamard), gs, k_w, axis=0)
        g_w = g_w.reshape(g.shape)
    else:  # per-tensor formats: quantization commutes with the transpose; reuse the forward operand and g_d
        x_w, g_w = lhs_q, g_d
    x_w = _select(observe, lhs, x_w)
    g_w = _select(observe, g, g_w)
    _, vjp_r = jax.vjp(lambda b: _dot(cfg, x_w, b), rhs_q)
    (dr,) = vjp_r(g_w)

    if keep_l is not None:
        dl = jnp.where(keep_l, dl, jnp.zeros((), dl.dtype))
    if keep_r is not None:
        dr = jnp.where(keep_r, dr, jnp.zeros((), dr.dtype))
    return dl.astype(lhs.dtype), dr.astype(rhs.dtype), None, None, None, None, None, None, None, None


_qdot.defvjp(_qdot_fwd, _qdot_bwd)


def _global_amax(spec: QuantSpec, est: jax.Array) -> jax.Array | None:
    """The global amax an NVFP4 operand was quantized with in the forward (None: recomputed from the tensor)."""
    return est if isinstance(spec.scaling, DelayedScaling) else None


def dot_general(
    lhs: Any,
    rhs: Any,
    dimension_numbers: DimensionNumbers,
    *,
    recipe: Recipe,
    state: RecipeState,
    observe_only: bool | jax.Array = False,
    key: jax.Array | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> tuple[jax.Array, RecipeState, RecipeStats]:
    """``lax.dot_general`` with `lhs` (activation) and `rhs` (weight) fake-quantized per `recipe`.

    Forward: ``dot_general(Q_a(lhs), Q_w(rhs))``; the new state records both amaxes. Backward: straight-through
    for both operands (masked per ``ste``). With ``recipe.grad`` set, the output gradient is quantized (current
    scaling; stochastic rounding with a key split from `key`) before the dgrad and wgrad GEMMs; NVFP4 operands are
    re-quantized from high precision with blocks along the GEMM's contraction axis, and ``grad.hadamard`` rotates
    both wgrad operands along the token axis. NVFP4 and Hadamard need the linear layout ``lhs [..., K]``,
    ``rhs [K, M]``; the per-tensor 8-bit formats accept any dimension numbers. ``observe_only`` makes forward and
    backward exactly the high-precision ones.

    Returns ``(out, new_state, stats)`` with a :class:`RecipeState` and :class:`RecipeStats`.
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a Recipe; got {type(recipe).__name__}")
    if not isinstance(state, RecipeState):
        raise TypeError(f"state must be a RecipeState (recipe.init()); got {type(state).__name__}")
    lhs = float_input(lhs, "lhs")
    rhs = float_input(rhs, "rhs")
    dn = _normalize_dn(dimension_numbers)
    observe = observe_flag(observe_only)
    linear_layout = _is_linear(lhs, rhs, dn)
    needs_layout = recipe.grad is not None and recipe.grad.hadamard
    needs_layout |= any(s is not None and s.is_nvfp4 for s in (recipe.weight, recipe.activation, recipe.grad))
    if needs_layout and not linear_layout:
        raise NotImplementedError(
            f"recipe {recipe.name!r} uses NVFP4 blocks or the Hadamard transform, which need the linear layout "
            f"lhs [..., K] . rhs [K, M] (dimension_numbers (((lhs.ndim-1,), (0,)), ((), ()))); got "
            f"dimension_numbers={dn}, lhs {lhs.shape}, rhs {rhs.shape}"
        )
    keys = [None, None, None] if key is None else list(jax.random.split(key, 3))
    for role, spec in (("activation", recipe.activation), ("weight", recipe.weight), ("grad", recipe.grad)):
        if spec is not None:
            _need_key(spec, key, f"recipe.{role}")
    if recipe.activation is not None:
        qa = _quantize(lhs, state.activation, recipe.activation, observe, keys[0], axis=-1)
        lhs_q, keep_l, st_a, stats_a, est_l = qa
    else:
        lhs_q, keep_l, st_a, stats_a, est_l = lax.stop_gradient(lhs), None, state.activation, None, None
    if recipe.weight is not None:
        qw = _quantize(rhs, state.weight, recipe.weight, observe, keys[1], axis=0)  # rhs [K, M]: blocks along K
        rhs_q, keep_r, st_w, stats_w, est_r = qw
    else:
        rhs_q, keep_r, st_w, stats_w, est_r = lax.stop_gradient(rhs), None, state.weight, None, None
    static_obs = observe if isinstance(observe, bool) else None
    cfg = _DotConfig(dn, precision, preferred_element_type, recipe, static_obs)
    if recipe.grad is None:
        out = _dot(cfg, _straight_through(lhs, lhs_q, keep_l), _straight_through(rhs, rhs_q, keep_r))
    else:
        traced_obs = None if static_obs is not None else observe
        out = _qdot(cfg, lhs, rhs, lhs_q, rhs_q, est_l, est_r, keep_l, keep_r, keys[2], traced_obs)
    return out, RecipeState(weight=st_w, activation=st_a), RecipeStats(weight=stats_w, activation=stats_a)


def linear(
    x: Any,
    w: Any,
    *,
    recipe: Recipe,
    state: RecipeState,
    observe_only: bool | jax.Array = False,
    key: jax.Array | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> tuple[jax.Array, RecipeState, RecipeStats]:
    """``x @ w`` quantized per `recipe`: x [..., in], w [in, out] (``nnx.Linear``'s kernel layout).

    Same as :func:`dot_general` with ``dimension_numbers=(((x.ndim - 1,), (0,)), ((), ()))``.
    """
    x = float_input(x, "x")
    return dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), recipe=recipe, state=state,
                       observe_only=observe_only, key=key, precision=precision,
                       preferred_element_type=preferred_element_type)


# ----------------------------------------------------------------------------------------------------------------
# Warmup schedule

Schedule = Callable[[Any], Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Warmup:
    """High precision (observe-only) for the first `steps` steps, then quantized (the Max-Window paper: 500).

    >>> w = Warmup(steps=500)
    >>> bool(w.observe_only(499)), bool(w.observe_only(500))
    (True, False)
    """

    steps: int

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, (int, np.integer)):
            raise TypeError(f"steps must be an int >= 0; got {self.steps!r}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0; got {self.steps}")
        object.__setattr__(self, "steps", int(self.steps))

    def observe_only(self, step: Any) -> jax.Array:
        """bool[] ``step < steps``: pass as ``observe_only=`` (traced steps do not retrace)."""
        return jnp.asarray(step) < self.steps

    def quantize(self, step: Any) -> jax.Array:
        """bool[] ``step >= steps``."""
        return jnp.logical_not(self.observe_only(step))

    def lr_schedule(self, high_precision: Schedule | float, quantized: Schedule | float) -> Schedule:
        """An optax schedule: `high_precision` for steps < `steps`, then `quantized` (counting from 0 again).

        ``optax.join_schedules([high_precision, quantized], [steps])``; floats become constant schedules.
        """
        parts = [optax.constant_schedule(s) if isinstance(s, (int, float)) else s for s in (high_precision,
                                                                                             quantized)]
        for p in parts:
            if not callable(p):
                raise TypeError(f"schedules must be callables or numbers; got {p!r}")
        return optax.join_schedules(parts, [self.steps])

