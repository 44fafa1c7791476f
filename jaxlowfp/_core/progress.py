"""Progress bars for long library calls: off unless asked for (``progress=True``), then a tqdm bar on stderr."""
from __future__ import annotations

import sys
from typing import Any, Iterable

from jaxlowfp._core.checks import optional_module


def progress_bar(items: Iterable | None = None, *, enabled: bool, desc: str, total: int | None = None,
                 unit: str = "it") -> Any:
    """``items`` unchanged (or None when ``items`` is None) if not ``enabled``; else a ``tqdm`` bar over them (or a
    manual bar of ``total`` units), which needs the ``tqdm`` package of the ``jaxlowfp[models]`` extra."""
    if not enabled:
        return items
    tqdm = optional_module("tqdm.auto", extra="models", feature="progress=True").tqdm
    return tqdm(items, total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)
