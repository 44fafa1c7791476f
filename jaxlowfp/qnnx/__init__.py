"""Flax NNX integration: `QuantLinear`, `QuantEinsum`, `QuantLinearGeneral`, path rules that swap `nnx.Linear`,
`nnx.Einsum` and `nnx.LinearGeneral` modules in place, telemetry.

Named ``qnnx`` so that it sits beside ``from flax import nnx`` in user code (``jaxlowfp.nnx``, its old name, still
imports for one release with a DeprecationWarning). `Rule` and `QuantizeReport` are those of `jaxlowfp.rules`, the same
types `jaxlowfp.ptq` uses.

State categories (typed `nnx.Variable` subclasses, so `nnx.split` separates them)::

    AmaxState        the layer's RecipeState (amax histories): functional state, threaded through the train step
    QuantStatsState  the QuantStats of the last call (amax, scale, saturated / underflow fractions, ...)
    QuantPhase       a bool scalar: True = observe only (warmup: y = x @ w exactly, histories still recorded)

    graphdef, params, qstate, rest = nnx.split(model, nnx.Param, AmaxState, ...)
    nnx.Optimizer(model, tx, wrt=nnx.Param)          # amax histories never reach optax

`quantize(model, rules)` replaces matching modules in their parent (attribute, list item or dict entry); nothing is
cloned, and the new `QuantLinear` holds the very same `nnx.Param` objects as the `nnx.Linear` it replaces.

>>> from flax import nnx
>>> from jaxlowfp import qnnx, qat
>>> class MLP(nnx.Module):
...     def __init__(self, rngs):
...         self.up_proj, self.down_proj = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 16, rngs=rngs)
>>> model = MLP(nnx.Rngs(0))
>>> report = qnnx.quantize_model(model, [qnnx.Rule(path="up_proj", recipe=qat.hif8_w8a8()),
...                                qnnx.Rule(path="gate_proj", recipe=qat.hif8_w8a8())])   # a typo'd rule
>>> type(model.up_proj).__name__, report.unmatched, report.unused_rules
('QuantLinear', ('down_proj',), ('gate_proj',))
"""
from jaxlowfp._core.surface import public_dir as _public_dir
from jaxlowfp.qnnx.layer import (AmaxState, QuantEinsum, QuantLinear, QuantLinearGeneral, QuantOp, QuantPhase,
                                 QuantRaggedOp, QuantStatsState)
from jaxlowfp.qnnx.rules import iter_quant_linears, iter_quant_ops, paper_rules
from jaxlowfp.qnnx.rules import quantize as quantize_model
from jaxlowfp.rules import QuantizeReport, Rule
from jaxlowfp.qnnx.telemetry import collect_stats, max_saturated_fraction, set_observe_only

__all__ = [
    "AmaxState",
    "QuantStatsState",
    "QuantPhase",
    "QuantLinear",
    "QuantEinsum",
    "QuantLinearGeneral",
    "QuantOp",
    "QuantRaggedOp",
    "Rule",
    "QuantizeReport",
    "quantize_model",
    "paper_rules",
    "set_observe_only",
    "collect_stats",
    "max_saturated_fraction",
    "iter_quant_linears",
    "iter_quant_ops",
]

# old names (one release): `quantize` means x -> codes in the format modules; this one quantizes a model
from jaxlowfp._core.deprecation import deprecated_getattr  # noqa: E402

__getattr__ = deprecated_getattr(__name__, {"quantize": ("jaxlowfp.qnnx.quantize_model", lambda: quantize_model)})


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
