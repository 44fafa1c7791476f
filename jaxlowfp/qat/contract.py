"""Moved: the quantized contraction is `jaxlowfp.ops` (the one op layer); this module re-exports its names for code
written against jaxlowfp 0.1 (``contract`` is `jaxlowfp.ops.dot_general`)."""
from jaxlowfp.ops import (Einsum, check_blocks, contract, contraction_sizes, needs_linear_layout,  # noqa: F401
                          parse_einsum)

__all__ = ["Einsum", "parse_einsum", "contract", "check_blocks", "needs_linear_layout", "contraction_sizes"]
