"""Flattening QuantStats pytrees into ``{"path/tensor/field": float}`` dicts for loggers (NNX and Linen)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np


def _key_name(k: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def named_leaves(tree: Any) -> Iterator[tuple[tuple[str, ...], jax.Array]]:
    """(key names, leaf) for every leaf of a pytree (NamedTuple fields, dict keys, sequence indices)."""
    for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        yield tuple(_key_name(k) for k in kp), leaf


def flatten_floats(pairs: Iterator[tuple[tuple[str, ...], Any]]) -> dict[str, float]:
    """{"a/b/c": float} from (names, leaf) pairs; a non-scalar leaf gets one "/i" entry per element."""
    out: dict[str, float] = {}
    for names, leaf in pairs:
        name = "/".join(n for n in names if n)
        arr = np.asarray(jax.device_get(leaf))
        if arr.ndim == 0:
            out[name] = float(arr)
        else:
            out.update({f"{name}/{i}": float(v) for i, v in enumerate(arr.reshape(-1))})
    return out


