"""Deprecated names: old names keep working for one release with a DeprecationWarning (CHANGELOG.md lists them).

A module lists its old attribute names in ``_DEPRECATED = {old: (new, getter)}`` and sets
``__getattr__ = deprecated_getattr(__name__, _DEPRECATED)`` (PEP 562: called only for names the module does not
define, so an old name is not in ``dir()`` and costs nothing until used). A getter given as the string
``"package.module:name"`` is imported when the old name is used: a name that moved to a module above the old one
(``jaxlowfp.ptq.load_model`` is ``jaxlowfp.models.load_export``) keeps working without an upward import. A renamed
keyword goes through :func:`renamed_kwarg`.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

REMOVED_IN = "0.3"
_UNSET: Any = object()


def warn(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that `old` is deprecated in favour of `new`."""
    warnings.warn(f"{old} is deprecated and will be removed in jaxlowfp {REMOVED_IN}; use {new} (see CHANGELOG.md)",
                  DeprecationWarning, stacklevel=stacklevel)


def _importer(target: str) -> Callable[[], Any]:
    """A getter of ``"package.module:name"``, imported on call."""
    mod, _, attr = target.partition(":")
    if not mod or not attr:
        raise ValueError(f"a deprecated alias target must be 'package.module:name'; got {target!r}")

    def get() -> Any:
        import importlib

        return getattr(importlib.import_module(mod), attr)

    return get


def deprecated_getattr(module: str, aliases: Mapping[str, tuple[str, Callable[[], Any] | str]]
                       ) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves the old names in `aliases` (old -> (new name, getter or
    ``"package.module:name"``)) with a DeprecationWarning and raises the usual AttributeError for any other name."""
    resolved = {old: (new, _importer(get) if isinstance(get, str) else get) for old, (new, get) in aliases.items()}

    def __getattr__(name: str) -> Any:
        if name in resolved:
            new, get = resolved[name]
            warn(f"{module}.{name}", new)
            return get()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    __getattr__.aliases = resolved  # type: ignore[attr-defined]  # read by tests/test_vocabulary.py
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
