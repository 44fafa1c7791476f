"""jaxlowfp: 8-bit and 4-bit floating point for JAX/Flax.

Element formats and block-scaled formats as pure functions (`hif8`, `formats`, `nvfp4`, `mx`, `hadamard`), delayed
scaling as a functional state (`scaling`), straight-through QAT ops and recipes (`qat`), module-path rules shared by
QAT and PTQ (`rules`), Flax integration (`qnnx`, `qlinen`: named so they sit beside ``flax.nnx`` / ``flax.linen``),
the functional train step (`training`), the Llama-family model and checkpoint loaders (`models`), evaluation with
lm-eval's conventions (`evaluation`), post-training quantization and NVFP4 export (`ptq`) and the kernel dispatch
(`dispatch`, kernels in `pallas_kernels`).
Submodules load on first use, so ``import jaxlowfp`` is cheap and importing the leaf layer (``jaxlowfp._core``,
which the kernels use) does not pull in optax or Flax.

    >>> import jax.numpy as jnp, jaxlowfp
    >>> jaxlowfp.hif8.round(jnp.float32(17.0)).item()   # 3-bit mantissa up to 15, 2 bits up to 224
    16.0
    >>> jaxlowfp.Format.parse("nvfp4-mse")                 # "nvfp4" is standard NVFP4; Four Over Six is named
    Format('nvfp4-mse')
    >>> q = jaxlowfp.quantize(jnp.ones((2, 32)), "mxfp4")   # one quantized array type for every format
    >>> type(q).__name__, q.format, q.codes.shape, jaxlowfp.dequantize(q)[0, 0].item()
    ('QArray', Format('mxfp4'), (2, 16), 1.0)
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# packed, backends: packed low-precision weights and their GEMM backends (docs/backends.md); sharding: meshes and
# path rules to PartitionSpecs (docs/sharding.md)
_MODULES: tuple[str, ...] = ("dispatch", "formats", "hadamard", "hif8", "mx", "nvfp4", "qat", "ops", "execution",
                             "scaling", "rules", "qnnx", "qlinen", "training", "models", "evaluation", "ptq",
                             "packed", "backends", "sharding")

# old names, importable for one release with a DeprecationWarning (they shadowed flax.nnx / flax.linen)
_DEPRECATED_MODULES = ("nnx", "linen")

# flat names -> the submodule that defines them
_NAMES = {
    "Format": "_core.format", "FORMATS": "_core.format", "quantize": "packed", "dequantize": "packed",
    "fake_quantize": "packed",
    "ElementFormat": "formats", "HIF8": "formats", "E4M3": "formats", "E5M2": "formats", "E2M1": "formats",
    "QArray": "_core.qarray",
    "AmaxHistory": "scaling", "PendingAmax": "scaling", "DelayedScaling": "scaling", "CurrentScaling": "scaling",
    "StaticScaling": "scaling",
    "merge": "scaling",
    "QuantSpec": "qat", "QuantStats": "qat", "Recipe": "qat", "RecipeState": "qat", "RecipeStats": "qat",
    "Warmup": "qat", "fake_quant": "qat", "scaled_round": "qat", "linear": "qat",
    "dot_general": "ops", "einsum": "ops", "ragged_dot": "ops",  # the one op layer
    "hif8_w8a8": "qat", "nvfp4_w4a4": "qat", "nvfp4_training": "qat", "fp8_delayed": "qat",
    "Rule": "rules", "QuantizeReport": "rules",
}

__all__ = [*_MODULES, *_NAMES]


def __getattr__(name: str) -> Any:
    if name in _MODULES or name in _DEPRECATED_MODULES:
        value = importlib.import_module(f"jaxlowfp.{name}")
    elif name in _NAMES:
        value = getattr(importlib.import_module(f"jaxlowfp.{_NAMES[name]}"), name)
    else:
        raise AttributeError(f"module 'jaxlowfp' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
