"""Quantization-aware training ops (``jaxlowfp.qat``, one flat namespace over ``spec``, ``fake_quant``, ``matmul``,
``warmup``): scaled fake-quant with straight-through gradients, quantized matmuls, recipes.

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

>>> import jax.numpy as jnp
>>> from jaxlowfp import qat, scaling
>>> spec = qat.QuantSpec(format="hif8", scaling=scaling.DelayedScaling(algorithm="max_window", target_max=15.0))
>>> state = spec.init()
>>> y, state, stats = qat.fake_quant(jnp.asarray([1.0, -2.0, 3.0]), state, spec)   # empty history: current amax
>>> y, state, stats = qat.fake_quant(jnp.asarray([1.0, -2.0, 6.0]), state, spec)   # estimate 3 lags: 6 clips to 3
>>> y.tolist(), float(stats.amax_estimate), round(float(stats.saturated_fraction), 3)
([1.0, -2.0, 3.0], 3.0, 0.333)
"""
from jaxlowfp.qat.fake_quant import fake_quant, scaled_round
from jaxlowfp.qat.matmul import dot_general, linear
from jaxlowfp.qat.spec import (
    CLIPS,
    FORMATS,
    ROUNDINGS,
    STES,
    QuantSpec,
    QuantStats,
    Recipe,
    RecipeState,
    RecipeStats,
    hif8_w8a8,
    nvfp4_training,
    nvfp4_w4a4,
)
from jaxlowfp.qat.warmup import Warmup

__all__ = [
    "QuantSpec",
    "QuantStats",
    "Recipe",
    "RecipeState",
    "RecipeStats",
    "Warmup",
    "scaled_round",
    "fake_quant",
    "dot_general",
    "linear",
    "hif8_w8a8",
    "nvfp4_w4a4",
    "nvfp4_training",
]
