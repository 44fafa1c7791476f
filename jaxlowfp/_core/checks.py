"""Argument validation shared by every quantizer and config: clear errors instead of silent high precision."""
from __future__ import annotations

import importlib
import math
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_INPUTS = (jnp.float32, jnp.bfloat16, jnp.float16)
_ALLOWED = "float32, bfloat16 or float16"


def float_input(x: Any, what: str = "x") -> jnp.ndarray:
    """Return `x` as a jnp array if it is float32/bfloat16/float16, else raise a TypeError.

    float64 is refused rather than cast: a float64 -> float32 -> 8-bit conversion rounds twice (see
    docs/formats/hif8.md section 5), so the caller must choose the cast (`x.astype(jnp.float32)`) explicitly.
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


def float_dtype(dtype: Any, what: str = "dtype") -> jnp.dtype:
    """`dtype` as a jnp dtype if it is float32/bfloat16/float16 (every value of our formats fits), else TypeError."""
    dtype = jnp.dtype(dtype)
    if dtype not in [jnp.dtype(d) for d in FLOAT_INPUTS]:
        raise TypeError(f"{what} must be {_ALLOWED}; got {dtype}")
    return dtype


def uint8_codes(codes: Any, what: str = "codes") -> jnp.ndarray:
    codes = jnp.asarray(codes)
    if codes.dtype != jnp.uint8:
        raise TypeError(f"{what} must be a uint8 array; got dtype {codes.dtype}")
    return codes


def one_of(value: Any, allowed: tuple, what: str) -> Any:
    if value not in allowed:
        raise ValueError(f"{what}={value!r} is not supported; allowed: {', '.join(map(repr, allowed))}")
    return value


def _is_real(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def number(value: Any, what: str, *, lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False,
           hi_open: bool = False, allowed: str | None = None) -> float:
    """`value` as a float if it is a real number (not a bool) in the interval; TypeError / ValueError naming
    `what`, the value and the interval (or `allowed`, a phrase, e.g. "a positive finite number")."""
    interval = allowed or (f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}")
    if not _is_real(value):
        raise TypeError(f"{what} must be {allowed or 'a number in ' + interval}; got {value!r} "
                        f"({type(value).__name__})")
    v = float(value)
    if not ((v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)):
        raise ValueError(f"{what} must be {allowed or 'in ' + interval}; got {value!r}")
    return v


def positive_finite(value: Any, what: str) -> float:
    return number(value, what, lo=0.0, hi=math.inf, lo_open=True, hi_open=True,
                  allowed="a positive finite number")


def integer(value: Any, what: str, *, minimum: int = 0) -> int:
    """`value` as an int if it is an integer (not a bool) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int >= {minimum}; got {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}; got {value}")
    return int(value)


def positive_int(value: Any, what: str) -> int:
    """`value` as an int >= 1: an int (not a bool) or a string of digits (a command-line argument such as lm-eval's
    ``--model_args batch_size=8``); a ValueError naming `what` and the value otherwise."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what} must be a positive int; got {value!r}")
    return int(value)


def flag(value: Any, what: str) -> bool:
    """`value` as a bool: a bool, the int 0 or 1, or the strings true / false / 1 / 0 (any case) that a command line
    passes (``--model_args progress=false``: ``bool("false")`` would be True); a ValueError naming `what` and the
    value otherwise."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise ValueError(f"{what} must be true or false; got {value!r}")


def dimension_numbers_of(dn: Any) -> tuple:
    """``dot_general`` dimension numbers ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))`` as tuples of
    ints (hashable: usable as static configuration); a ValueError naming what was given otherwise."""
    try:
        (lc, rc), (lb, rb) = dn
        return (tuple(int(i) for i in lc), tuple(int(i) for i in rc)), (tuple(int(i) for i in lb),
                                                                         tuple(int(i) for i in rb))
    except (TypeError, ValueError) as e:
        raise ValueError(f"dimension_numbers must be ((lhs_contract, rhs_contract), (lhs_batch, rhs_batch)); "
                         f"got {dn!r}") from e


def bool_flag(flag: Any, what: str = "observe_only") -> bool | jax.Array:
    """A Python bool stays static; anything else must be a boolean scalar array (traced is fine)."""
    if isinstance(flag, (bool, np.bool_)):
        return bool(flag)
    a = jnp.asarray(flag)
    if a.dtype != jnp.bool_ or a.shape != ():
        raise TypeError(f"{what} must be a Python bool or a boolean scalar array; got dtype {a.dtype} and "
                        f"shape {a.shape}")
    return a


def optional_module(name: str, *, extra: str, feature: str) -> ModuleType:
    """Import an optional dependency, or raise an ImportError that names the extra which installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"{feature} needs the optional package {name!r}, which is not installed; install it with "
                          f"`pip install 'jaxlowfp[{extra}]'`") from e
