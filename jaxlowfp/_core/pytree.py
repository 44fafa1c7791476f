"""Frozen dataclasses registered as pytrees: array fields are leaves, the rest static metadata."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax


def pytree_dataclass(*, data: Sequence[str], meta: Sequence[str]) -> Callable[[type], type]:
    """Class decorator: ``@dataclass(frozen=True)`` plus ``jax.tree_util.register_dataclass`` with the `data`
    fields as leaves and the `meta` fields as static (hashable) metadata."""

    def wrap(cls: type) -> type:
        cls = dataclasses.dataclass(frozen=True)(cls)
        return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))

    return wrap
