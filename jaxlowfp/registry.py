"""The names of every format and rule, in one place: the quantizers, the QAT recipes, the PTQ schemes, the lm-eval
backend (`jaxlowfp.harness`), the command lines of `python -m train` and the docs read their lists from here.

Importing it loads no jax (the command lines read it for ``--help``). The vocabulary (one verb per meaning, the same
keyword for the same meaning in every format module):

- ``quantize(x, ...)`` returns codes (a :class:`jaxlowfp.QArray`; HiF8 ``encode``: uint8),
  ``dequantize(q)`` their values, ``fake_quantize(x, ...)`` the values of ``dequantize(quantize(x))`` in x's dtype.
- Model-level calls say so: ``qnnx.quantize_model(model, rules)`` (QAT layers in place), ``ptq.quantize_model(model,
  rules)`` (PTQ) and ``harness.fake_quantize_model`` (the lm-eval backend's recipes on a whole model).
- ``format=``: which format of a module's family (``if4.quantize(format="if6_e2m3")``, ``mx.quantize(format="e4m3")``,
  ``QuantSpec(format="nvfp4")``); ``rule=``: how each block picks its scale or grid (NVFP4: :data:`NVFP4_RULES`, IF:
  :data:`IF_RULES`, MX: :data:`MX_RULES`); ``rounding=``, ``block_shape=``, ``global_amax=``, ``key=`` likewise.
- ``Rule`` is one type, :class:`jaxlowfp.Rule` (a path regex and what the matched layers get); the rule *names*
  are typed :data:`jaxlowfp.nvfp4.NVFP4Rule` / :data:`jaxlowfp.if4.IFRule`, the IF format names
  :data:`jaxlowfp.if4.IFFormat` (``jaxlowfp.formats.ElementFormat`` is the element-format descriptor class,
  :class:`jaxlowfp.Format` the tensor format).

Format names of the command lines (:data:`FORMATS`, from :class:`jaxlowfp.Format`): ``nvfp4`` (standard NVFP4,
static_6), ``nvfp4-<rule>`` (every other rule, Four Over Six's ``nvfp4-mse`` among them), ``if4-<rule>``, ``mxfp4``,
``mxfp8``, ``hif8``, ``fp8`` (the names of :func:`jaxlowfp.ptq.scheme` and of the ``quantize=`` argument of the
lm-eval backend).
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

from jaxlowfp._core import format as _format
from jaxlowfp._core import names as _names

__all__ = [
    "ELEMENT_FORMATS", "NVFP4_RULES", "NVFP4_KERNEL_RULES", "NVFP4_FOUR_OVER_SIX", "NVFP4_BLOCK_SHAPES", "ROUNDINGS",
    "IF_FORMATS", "IF_RULES", "MX_FORMATS", "MX_RULES", "QAT_FORMATS", "PTQ_KINDS", "FORMATS", "PTQ_FORMATS",
    "EVAL_QUANTIZE",
]

ELEMENT_FORMATS = ("hif8", "e4m3", "e5m2", "e2m1")  # jaxlowfp.formats descriptors (encode / decode / round)

NVFP4_RULES = _names.NVFP4_RULES  # every rule jaxlowfp.nvfp4 accepts: static_6 (standard), static_4, 4/6, search
NVFP4_KERNEL_RULES = _names.NVFP4_KERNEL_RULES  # the ones the Pallas kernels implement (all but "search")
NVFP4_FOUR_OVER_SIX = _names.NVFP4_FOUR_OVER_SIX  # the Four Over Six selection rules
NVFP4_BLOCK_SHAPES = _names.NVFP4_BLOCK_SHAPES  # (1, 16) blocks, (16, 16) tiles
ROUNDINGS = _names.ROUNDINGS  # NVFP4 and IF: nearest, stochastic, stochastic_unbiased, ms_eden

IF_FORMATS = _names.IF_FORMATS  # jaxlowfp.if4: if4, if6_e2m3, if6_e3m2, if3
IF_RULES = _names.IF_RULES  # the FP-or-INT grid choice per block

MX_FORMATS = _names.MX_FORMATS  # jaxlowfp.mx element formats: MXFP4, MXFP8 (E4M3), MXFP8 (E5M2)
MX_RULES = _names.MX_RULES  # the shared exponent: OCP's floor rule, or round-up (RCEIL)

QAT_FORMATS = ("hif8", "e4m3", "e5m2", "nvfp4", "if4", "mxfp4", "mxfp8")  # jaxlowfp.qat.QuantSpec(format=...)
PTQ_KINDS = _format.KINDS  # jaxlowfp.Format(kind=...)

# every named tensor format (jaxlowfp.Format.parse / jaxlowfp.FORMATS): "nvfp4" is standard NVFP4 (static_6); the
# other NVFP4 rules, Four Over Six among them, are always named ("nvfp4-mse"); "nvfp4-static_6" parses too
FORMATS = tuple(_format.FORMATS)

# jaxlowfp.ptq.scheme(name) and `python -m train ptq --formats`: one name per weight + activation format
PTQ_FORMATS = (*(f for f in FORMATS if not f.endswith("-ceil")),)

# the lm-eval backend's quantize= (jaxlowfp.harness) and `python -m train eval --quantize`: a QAT recipe each
# ("nvfp4" is standard NVFP4 (static_6), "nvfp4-<rule>" names every other rule, "fp8" the delayed E4M3 / E5M2 recipe)
EVAL_QUANTIZE = ("none", "hif8", "nvfp4", *(f"nvfp4-{r}" for r in NVFP4_RULES if r != "static_6"),
                 *(f"if4-{r}" for r in IF_RULES), "fp8")


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
