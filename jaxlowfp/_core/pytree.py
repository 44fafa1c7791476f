"""Frozen dataclasses registered as pytrees: array fields are leaves, the rest static metadata."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeVar, cast, dataclass_transform

import jax

T = TypeVar("T", bound=type)


@dataclass_transform(frozen_default=True)  # type checkers see the generated __init__ (PEP 681)
def pytree_dataclass(*, data: Sequence[str], meta: Sequence[str]) -> Callable[[T], T]:
    """Class decorator: ``@dataclass(frozen=True)`` plus ``jax.tree_util.register_dataclass`` with the `data`
    fields as leaves and the `meta` fields as static (hashable) metadata."""

    def wrap(cls: T) -> T:
        frozen: type = dataclasses.dataclass(frozen=True)(cls)
        return cast(T, jax.tree_util.register_dataclass(frozen, data_fields=list(data), meta_fields=list(meta)))

    return wrap
