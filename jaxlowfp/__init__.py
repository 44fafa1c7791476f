"""jaxlowfp: 8-bit and 4-bit floating point for JAX/Flax.

Element formats and block-scaled formats as pure functions (`hif8`, `formats`, `nvfp4`, `mx`), delayed scaling as a
functional state (`scaling`), straight-through QAT ops and recipes (`qat`), Flax integration (`jaxlowfp.nnx`,
`jaxlowfp.linen`, imported on first use) and the kernel dispatch (`dispatch`, kernels in `pallas_kernels`).

    >>> import jax.numpy as jnp, jaxlowfp
    >>> jaxlowfp.hif8.round(jnp.float32(17.0)).item()   # 3-bit mantissa up to 15, 2 bits up to 224
    16.0
"""
from __future__ import annotations

import importlib
from typing import Any

from jaxlowfp import dispatch, formats, hif8, mx, nvfp4, qat, scaling
from jaxlowfp.formats import E2M1, E4M3, E5M2, HIF8, Format
from jaxlowfp.nvfp4 import NVFP4Array
from jaxlowfp.qat import (
    QuantSpec,
    QuantStats,
    Recipe,
    RecipeState,
    RecipeStats,
    Warmup,
    dot_general,
    fake_quant,
    hif8_w8a8,
    linear,
    nvfp4_training,
    nvfp4_w4a4,
    scaled_round,
)
from jaxlowfp.scaling import AmaxHistory, CurrentScaling, DelayedScaling, merge

__version__ = "0.1.0"

__all__ = [
    # modules
    "dispatch", "formats", "hif8", "mx", "nvfp4", "qat", "scaling", "nnx", "linen",
    # formats
    "Format", "HIF8", "E4M3", "E5M2", "E2M1", "NVFP4Array",
    # scaling state
    "AmaxHistory", "DelayedScaling", "CurrentScaling", "merge",
    # QAT
    "QuantSpec", "QuantStats", "Recipe", "RecipeState", "RecipeStats", "Warmup", "fake_quant", "scaled_round",
    "dot_general", "linear", "hif8_w8a8", "nvfp4_w4a4", "nvfp4_training",
]

_LAZY = ("nnx", "linen")  # Flax is imported only when these are used


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"jaxlowfp.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'jaxlowfp' has no attribute {name!r}")
