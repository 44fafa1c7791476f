"""The 16-point random Hadamard transform of the NVFP4 training recipe (docs/formats/nvfp4.md 5.2).

``H = (1/4) diag(s) H16`` with H16 the Sylvester matrix and s the recipe's fixed signs: orthogonal, so rotating both
GEMM operands along the reduction axis leaves the product unchanged while spreading outliers across each block of 16.

>>> import numpy as np
>>> from jaxlowfp.hadamard import hadamard_matrix
>>> h = hadamard_matrix()
>>> bool(np.allclose(h @ h.T, np.eye(16)))
True
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from jaxlowfp._core.checks import float_input
from jaxlowfp._core.nvfp4_blocks import BLOCK

__all__ = ["hadamard16", "hadamard_matrix"]

_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def hadamard_matrix() -> np.ndarray:
    """``H = (1/4) diag(s) H16`` (float32, orthogonal): H16 the Sylvester matrix, s the recipe's fixed signs."""
    h = np.ones((1, 1), np.float32)
    for _ in range(4):
        h = np.block([[h, h], [h, -h]])
    return (0.25 * np.asarray(_RHT_SIGNS, np.float32)[:, None] * h).astype(np.float32)


def hadamard16(x: ArrayLike, axis: int = -1) -> jax.Array:
    """``x.reshape(..., 16) @ H`` along `axis` (size a multiple of 16), in float32, returned in x's dtype.

    H is orthogonal, so ``hadamard16(y) @ H.T`` undoes it; apply it to both GEMM operands along the reduction axis.
    """
    x = float_input(x, "x")
    if x.ndim == 0:
        raise ValueError("hadamard16 needs an array with at least one axis")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis out of range for x of shape {x.shape}")
    axis = axis % x.ndim
    if x.shape[axis] % BLOCK:
        raise ValueError(f"hadamard16 needs axis {axis} of x (shape {x.shape}) to be a multiple of 16")
    xm = jnp.moveaxis(x, axis, -1).astype(jnp.float32)
    xb = xm.reshape(*xm.shape[:-1], xm.shape[-1] // BLOCK, BLOCK)
    y = jnp.matmul(xb, jnp.asarray(hadamard_matrix()), precision=lax.Precision.HIGHEST)
    return jnp.moveaxis(y.reshape(xm.shape), -1, axis).astype(x.dtype)


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
