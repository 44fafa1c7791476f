"""Input validation shared by the quantizers: clear errors instead of silent high precision."""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

FLOAT_INPUTS = (jnp.float32, jnp.bfloat16, jnp.float16)
_ALLOWED = "float32, bfloat16 or float16"


def float_input(x: Any, what: str = "x") -> jnp.ndarray:
    """Return `x` as a jnp array if it is float32/bfloat16/float16, else raise a TypeError.

    float64 is refused rather than cast: a float64 -> float32 -> 8-bit conversion rounds twice (see
    specs/hif8.md section 5), so the caller must choose the cast (`x.astype(jnp.float32)`) explicitly.
    Python scalars are weakly typed and taken as float32.
    """
    if isinstance(x, (bool, int)) and not isinstance(x, float):
        raise TypeError(f"{what} must be a floating array ({_ALLOWED}); got the Python {type(x).__name__} {x!r}")
    if isinstance(x, float):
        return jnp.asarray(x, jnp.float32)
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        x = np.asarray(x)
        dtype = x.dtype
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        raise TypeError(
            f"{what} is float64; jaxlowfp does not cast it silently (float64 -> float32 -> 8 bit rounds twice). "
            f"Cast explicitly with x.astype(jnp.float32) first. Allowed dtypes: {_ALLOWED}."
        )
    if dtype not in [np.dtype(d) for d in FLOAT_INPUTS]:
        raise TypeError(f"{what} has dtype {dtype}; allowed dtypes: {_ALLOWED}")
    return jnp.asarray(x)


def one_of(value: Any, allowed: tuple, what: str) -> Any:
    if value not in allowed:
        raise ValueError(f"{what}={value!r} is not supported; allowed: {', '.join(map(repr, allowed))}")
    return value
