"""Post-training quantization (PTQ) of Flax NNX models (``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum``
layers): round-to-nearest, GPTQ, SmoothQuant and AWQ to NVFP4 (with
Four Over Six block scaling), MXFP4 and HiF8, and export of NVFP4 weights in the compressed-tensors layout.

The Four Over Six paper's PTQ setting: W4A4, weights quantized once (here: offline, by the chosen method), activations
fake-quantized at run time with their current per-tensor amax, NVFP4 blocks of 16 along the GEMM reduction axis::

    rules  = [ptq.Rule(path=r"blocks/\\d+/(attn|mlp)/\\w+_proj", scheme=ptq.scheme("nvfp4-mse"))]
    result = ptq.quantize_model(model, rules, method="gptq", calibration=tokens)   # tokens: int [n, seq]
    print(result.report)                                  # what was quantized, kept, unmatched; unused rules
    ptq.export(model, result, "out/")                      # safetensors + config.json (compressed-tensors NVFP4)
    ptq.export_gguf(model, result, "m.gguf", source_gguf=path)   # llama.cpp NVFP4 / MXFP4
    ptq.load(model2, "out/")                               # the same weights (high precision: F16 by default)

Exports ask the model what to write (`protocol`: ``export_tensors(target)``, ``export_config(target)``), check
every tensor first and refuse what would change the file's meaning (docs/exports.md).

Methods (see `gptq`, `smooth`): ``RTN()``, ``GPTQ(damp_percent=1.0, block_size=128, act_order=False,
scales="as-reached")``, ``SmoothQuant(alpha=0.5, alphas=None)`` and ``AWQ(grid=20, duo_scaling=True, clip=False)``
(both folded into the preceding RMSNorm or Linear, then RTN), with llm-compressor's meaning of the options.
Calibration is sequential by default for a model that says its blocks (``ptq_blocks()``, `sequential`): each block
calibrated on the outputs of the blocks already quantized, one block's statistics held at a time;
``pipeline="one-pass"`` takes every layer's statistics from one pass over the unquantized model.
Schemes (`formats`): ``"nvfp4-static_6"``, ``"nvfp4-static_4"``, ``"nvfp4-abs_max"``, ``"nvfp4-mae"``,
``"nvfp4-mse"``, ``"mxfp4"``, ``"mxfp8"``, ``"hif8"``, ``"fp8"`` (E4M3, scale amax / 448 per tensor);
``weights_only=True`` for W4A16; ``weight_block=(16, 16)`` for NVFP4 16x16 weight tiles.

>>> import jax.numpy as jnp, numpy as np
>>> from flax import nnx
>>> from jaxlowfp import ptq
>>> class MLP(nnx.Module):
...     def __init__(self, rngs):
...         self.up_proj, self.down_proj = nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 32, rngs=rngs)
...     def __call__(self, x):
...         return self.down_proj(nnx.relu(self.up_proj(x)))
>>> model = MLP(nnx.Rngs(0))
>>> x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16, 32)), jnp.float32)
>>> res = ptq.quantize_model(model, [ptq.Rule(path="up_proj", scheme=ptq.scheme("nvfp4-mse")),
...                            ptq.Rule(path="gate_proj", scheme=None)],
...                    method="gptq", calibration=[x], forward=lambda m, b: m(b), progress=False)
>>> res.report.quantized, res.report.unmatched, res.report.unused_rules
((('up_proj', 'nvfp4-mse'),), ('down_proj',), ('gate_proj',))
"""
from jaxlowfp._core.surface import public_dir as _public_dir
from jaxlowfp.ptq.api import METHODS, RTN, PTQResult, Rule, method_from_name, smooth_model
from jaxlowfp.ptq.api import quantize as quantize_model
from jaxlowfp.ptq.layers import ActQuant, EinsumActQuant
from jaxlowfp.ptq.calibrate import LayerStats, collect
from jaxlowfp.ptq.checkpoint import ExportReport, export, load
from jaxlowfp.ptq.formats import SCHEMES, Scheme, activation_spec, rtn_weight, scheme
from jaxlowfp.ptq.gguf_export import GGUFReport, export_gguf
from jaxlowfp.ptq.packing import PackedExperts, PackedLinear, PackReport
from jaxlowfp.ptq.packing import pack as pack_model
from jaxlowfp.ptq.packed_checkpoint import restore_packed, save_packed
from jaxlowfp.ptq.gptq import GPTQ, gptq_weight
from jaxlowfp.ptq.protocol import ExportTensor
from jaxlowfp.ptq.smooth import AWQ, Fold, SmoothQuant

__all__ = [
    "METHODS", "SCHEMES", "RTN", "GPTQ", "SmoothQuant", "AWQ", "Rule", "Scheme", "activation_spec", "Fold",
    "ActQuant", "EinsumActQuant", "PTQResult", "LayerStats", "quantize_model", "scheme",
    "method_from_name",
    "rtn_weight", "gptq_weight", "smooth_model", "collect", "export", "load", "ExportReport",
    "export_gguf",
    "GGUFReport", "ExportTensor",
    "pack_model", "PackedLinear", "PackedExperts", "PackReport", "save_packed", "restore_packed",
]

# old names (one release): `quantize` means x -> codes in the format modules, `pack` a tensor; these act on a model.
# TensorFormat is jaxlowfp.Format
from jaxlowfp._core.deprecation import deprecated_getattr  # noqa: E402

def _tensor_format() -> type:
    from jaxlowfp.ptq import formats

    return formats.LegacyTensorFormat


def _quantized_weight() -> type:
    from jaxlowfp.ptq import formats

    return formats.QuantizedWeight


__getattr__ = deprecated_getattr(__name__, {
    "quantize": ("jaxlowfp.ptq.quantize_model", lambda: quantize_model),
    "pack": ("jaxlowfp.ptq.pack_model", lambda: pack_model),
    "TensorFormat": ("jaxlowfp.Format", _tensor_format),
    # the result record of rtn_weight / gptq_weight, not a second array type: its .packed is a jaxlowfp.QArray
    "QuantizedWeight": ("jaxlowfp.ptq.rtn_weight", lambda: _quantized_weight()),
    # a model built from an export is the models package's side (ptq imports nothing of jaxlowfp.models)
    "load_model": ("jaxlowfp.models.load_export", "jaxlowfp.models:load_export"),
})


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
