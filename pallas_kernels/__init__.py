"""Pallas kernels for jaxlowfp's hot path, each bit-exact with a pure-jnp twin in ``jaxlowfp``.

- :func:`pallas_kernels.hif8.scaled_fake_quant`: HiF8 scaled fake-quant with amax and counters in one pass
  (twin: ``jaxlowfp.qat.scaled_round``).
- :func:`pallas_kernels.nvfp4.quantize` / :func:`pallas_kernels.nvfp4.fake_quantize`: NVFP4 with every rule of
  ``jaxlowfp.nvfp4`` (static_6, static_4 and the Four Over Six rules), 1x16 blocks and 16x16 tiles.

On a GPU they compile with Pallas-Triton (compute capability >= 8.0); elsewhere they run only in interpret mode,
asked for explicitly (``interpret=True`` or ``JAXLOWFP_PALLAS_INTERPRET=1``). ``jaxlowfp.dispatch`` decides
between these kernels and the twins for ``impl="auto" | "xla" | "pallas"``. Submodules are imported on use, so
``import pallas_kernels`` stays cheap.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["hif8", "nvfp4"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
