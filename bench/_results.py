"""Shared by the benchmark scripts: timing and writing one `## <title>` section of bench/RESULTS.md."""
from __future__ import annotations

import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import jax

RESULTS = Path(__file__).with_name("RESULTS.md")
# the checkout root: the benchmarks import the repository's application `train` (it is not installed by that name)
if str(RESULTS.parents[1]) not in sys.path:
    sys.path.insert(1, str(RESULTS.parents[1]))


def time_call(fn: Callable, *args, reps: int = 7, warmup: int = 2) -> float:
    """Median wall seconds of `fn(*args)` with `jax.block_until_ready`, after `warmup` untimed calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def machine() -> str:
    d = jax.devices()[0]
    return (f"{platform.processor() or platform.machine()}, {len(jax.devices())} x {d.device_kind}, "
            f"jax {jax.__version__}")


def markdown_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_section(title: str, body: str) -> None:
    """Replace (or append) the section `## title` of bench/RESULTS.md, leaving the others as they are."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\nWritten by the scripts in bench/.\n"
    section = f"## {title}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: section + "\n", text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    RESULTS.write_text(text)
