"""What ``dir()`` of a public module shows: its ``__all__`` and nothing else (PEP 562 ``__dir__``).

The helpers a module imports for its own use (``one_of``, ``float_input``, typing names) stay importable for the
library's own modules but are not API, so ``dir()`` and tab completion do not offer them::

    __dir__ = public_dir(__all__)
"""
from __future__ import annotations

from collections.abc import Callable, Sequence


def public_dir(names: Sequence[str]) -> Callable[[], list[str]]:
    """A module ``__dir__`` returning `names` (the module's ``__all__``), sorted."""
    listed = sorted(set(names))

    def __dir__() -> list[str]:
        return list(listed)

    return __dir__
