"""Deprecated names: old names keep working for one release with a DeprecationWarning (CHANGELOG.md lists them).

A module lists its old attribute names in ``_DEPRECATED = {old: (new, getter)}`` and sets
``__getattr__ = deprecated_getattr(__name__, _DEPRECATED)`` (PEP 562: called only for names the module does not
define, so an old name is not in ``dir()`` and costs nothing until used). A renamed keyword goes through
:func:`renamed_kwarg`.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

REMOVED_IN = "0.3"
_UNSET: Any = object()


def warn(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that `old` is deprecated in favour of `new`."""
    warnings.warn(f"{old} is deprecated and will be removed in jaxlowfp {REMOVED_IN}; use {new} (see CHANGELOG.md)",
                  DeprecationWarning, stacklevel=stacklevel)


def deprecated_getattr(module: str, aliases: dict[str, tuple[str, Callable[[], Any]]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves the old names in `aliases` (old -> (new name, getter)) with a
    DeprecationWarning and raises the usual AttributeError for any other name."""

    def __getattr__(name: str) -> Any:
        if name in aliases:
            new, get = aliases[name]
            warn(f"{module}.{name}", new)
            return get()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    __getattr__.aliases = aliases  # type: ignore[attr-defined]  # read by tests/test_vocabulary.py
    return __getattr__


def renamed_kwarg(where: str, old: str, old_value: Any, new: str, new_value: Any, default: Any, *,
                  stacklevel: int = 4) -> Any:
    """The value of keyword `new` when the caller may still pass it as `old` (deprecated): `old_value` is
    ``None`` unless given; both given (and `new` not at its `default`) is an error. `stacklevel`: the user's
    frame, counted from :func:`warn` (4: the caller of the function that calls this one)."""
    if old_value is None:
        return new_value
    if new_value != default:
        raise TypeError(f"{where}: pass {new}= only ({old}= is its deprecated name); got {old}={old_value!r} and "
                        f"{new}={new_value!r}")
    warn(f"{where}({old}=...)", f"{new}=", stacklevel=stacklevel)
    return old_value
