"""Quantization-aware training ops (``jaxlowfp.qat``, one flat namespace over ``spec``, ``fake_quant``, ``matmul``,
``warmup``): scaled fake-quant with straight-through gradients, quantized matmuls, recipes.

One quantized tensor, per step (``spec`` a :class:`QuantSpec`, ``state`` its :class:`~jaxlowfp.scaling.AmaxHistory`)::

    amax  = max |x|                                  (NaN-propagating)
    est   = spec.scaling.amax_estimate(state, amax)  (delayed: from earlier steps; current: amax)
    scale = est / target_max                         (1 when est is 0, NaN or Inf)
    y     = fmt.round(clip(x * (1 / scale), +-c)) * scale     c = target_max ("target") or fmt.max_finite ("format")
    y     = where(isfinite(x), y, x)                 (non-finite elements pass through: see below)
    dy/dx = 1  (ste="identity")   or   [|x / scale| <= c]  (ste="masked")
    state' = spec.scaling.update(state, amax)

``observe_only`` (the high-precision warmup) returns ``y = x`` bit for bit and still updates the state and the
statistics, so the amax history is warm when quantization starts.

``Recipe(gemm=...)`` chooses where the forward product runs (:mod:`jaxlowfp.qat.gemm`): "dequant" (default: the
dequantized operands in high precision), "fp8" (cuBLASLt's FP8 GEMM on the E4M3 codes), "scaled_matmul"
(``jax.nn.scaled_matmul`` on the NVFP4 / MX codes and block scales) or "auto"; the backward pass is the same.

A matmul (:func:`linear`; any contraction: :func:`jaxlowfp.dot_general`) fake-quantizes its activation (lhs) and
weight (rhs) operands per a
:class:`Recipe`. If the recipe quantizes gradients, the backward pass quantizes the output gradient, optionally with
stochastic rounding and a 16-point Hadamard transform on both weight-gradient operands; block-scaled (NVFP4) operands
are re-quantized from high precision along the axis the backward GEMM contracts, never reusing forward block scales.
The backward pass recomputes the quantized forward operands from the high-precision ones (same estimates and keys,
so bit for bit) instead of keeping both copies alive.

Delayed scaling of the output gradient (``fp8_delayed``: E4M3 forward, E5M2 gradients, as Transformer Engine and
Flax's ``fp8_ops``) keeps the gradient's :class:`~jaxlowfp.scaling.AmaxHistory` in ``RecipeState.grad``: explicit
state, no hidden collection. The backward pass reads it, and reports the gradient's amax as the *gradient* of the
loss w.r.t. ``RecipeState.grad_pending``; the step keeps that gradient as the new ``grad_pending``
(:func:`jaxlowfp.scaling.pending_amaxes`, done by :func:`jaxlowfp.training.make_step`), and the next call records it
into ``grad`` before its backward pass uses it.

Non-finite values, one policy for every format and path (jnp, Pallas kernel, NVFP4): a NaN or +-Inf element of a
quantized tensor comes out of the fake-quantizer unchanged (``y = where(isfinite(x), y_q, x)``, as high precision
would carry it), so it reaches the loss instead of being clipped to a finite value; ``QuantStats.nonfinite_count``
counts it (``nonfinite_quantized`` in the train metrics, a step with a non-zero count is skipped like a non-finite
loss). The other elements of such a tensor are quantized with whatever scale the non-finite amax leaves (delayed
scaling: the history's, except that an NVFP4 16-element block holding a NaN/Inf becomes NaN; current scaling: the
fallback scale 1 for the 8-bit formats, NaN for NVFP4, whose scales come from the global amax): the step is skipped
anyway. The int32 counters are exact: tensors of 2**31 elements or more are refused with an error.

>>> import jax.numpy as jnp
>>> from jaxlowfp import qat, scaling
>>> spec = qat.QuantSpec(format="hif8", scaling=scaling.DelayedScaling(algorithm="max_window", target_max=15.0))
>>> state = spec.init()
>>> y, state, stats = qat.fake_quant(jnp.asarray([1.0, -2.0, 3.0]), state, spec)   # empty history: current amax
>>> y, state, stats = qat.fake_quant(jnp.asarray([1.0, -2.0, 6.0]), state, spec)   # estimate 3 lags: 6 clips to 3
>>> y.tolist(), float(stats.amax_estimate), round(float(stats.saturated_fraction), 3)
([1.0, -2.0, 3.0], 3.0, 0.333)
"""
from jaxlowfp._core.deprecation import deprecated_getattr as _deprecated_getattr
from jaxlowfp._core.surface import public_dir as _public_dir
from jaxlowfp.qat.scaled_quant import fake_quant, scaled_round
from jaxlowfp.qat import gemm
from jaxlowfp.qat.matmul import linear
from jaxlowfp.qat.spec import (
    CLIPS,
    GEMMS,
    FORMATS,
    ROUNDINGS,
    STES,
    QuantSpec,
    QuantStats,
    Recipe,
    RecipeState,
    RecipeStats,
    fp8_delayed,
    hif8_w8a8,
    if4_training,
    if4_w4a4,
    named_recipe,
    nvfp4_training,
    nvfp4_w4a4,
)
from jaxlowfp.qat.warmup import Warmup

__all__ = [
    "gemm",
    "GEMMS",
    "QuantSpec",
    "QuantStats",
    "Recipe",
    "RecipeState",
    "RecipeStats",
    "Warmup",
    "scaled_round",
    "fake_quant",
    "linear",
    "hif8_w8a8",
    "fp8_delayed",
    "nvfp4_w4a4",
    "nvfp4_training",
    "if4_w4a4",
    "if4_training",
    "named_recipe",
]



def _batched_dot_general():  # the old qat.dot_general: the op layer runs it for contractions with batch axes
    from jaxlowfp.qat import matmul

    return matmul.dot_general


# old name (one release): the quantized dot_general of the API is the op layer's, jaxlowfp.dot_general
__getattr__ = _deprecated_getattr(__name__, {"dot_general": ("jaxlowfp.dot_general", _batched_dot_general)})

__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
