"""Where the test suite's time goes: JAX's tracing, lowering and XLA compilation, per test.

A pytest plugin that listens to JAX's own duration events (`jax.monitoring`, public): ``jaxpr_trace_duration``
(tracing a function to a jaxpr), ``jaxpr_to_mlir_module_duration`` (lowering to StableHLO) and
``backend_compile_duration`` (XLA's compile, one event per program), and books each to the test that was running.
Every xdist worker writes one JSON file into ``$JAXLOWFP_SUITE_PROFILE`` (a directory); the command summarizes them::

    JAXLOWFP_SUITE_PROFILE=/tmp/sp make test PYTEST_ARGS="-p bench.suite_profile"
    .venv/bin/python bench/suite_profile.py /tmp/sp          # per file: wall, trace, lower, compile, programs

It sees the pytest processes only: a test's subprocesses (``python -m train``, notebooks, the multi-process
workers) count in its wall time, not in its JAX columns.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

import pytest

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}
COLUMNS = ("wall", "trace", "lower", "compile", "programs")

_OUTSIDE = "(outside any test)"
_current = [_OUTSIDE]
_rows: dict[str, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(COLUMNS, 0.0))


def _listener(event: str, duration: float, **_: object) -> None:
    column = EVENTS.get(event)
    if column is not None:
        row = _rows[_current[0]]
        row[column] += duration
        row["programs"] += column == "compile"


def pytest_configure(config) -> None:  # noqa: ANN001  (pytest's hooks)
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listener)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ANN001
    """Book events to this test while it runs (setup, call, teardown); its wall time is the three."""
    _current[0] = item.nodeid
    start = time.perf_counter()
    yield
    _rows[item.nodeid]["wall"] += time.perf_counter() - start
    _current[0] = _OUTSIDE


def pytest_unconfigure(config) -> None:  # noqa: ANN001
    out = os.environ.get("JAXLOWFP_SUITE_PROFILE")
    if out and _rows:
        Path(out).mkdir(parents=True, exist_ok=True)
        name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (Path(out) / f"{name}-{os.getpid()}.json").write_text(json.dumps(_rows))


def summarize(directory: Path, top: int) -> str:
    """A Markdown table per test file (and the `top` tests) of the worker files in `directory`."""
    by_file: dict[str, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(COLUMNS, 0.0))
    by_test: dict[str, dict[str, float]] = {}
    for path in sorted(directory.glob("*.json")):
        for test, row in json.loads(path.read_text()).items():
            by_test[test] = row
            acc = by_file[test.split("::")[0]]
            for c in COLUMNS:
                acc[c] += row[c]
    total = {c: sum(r[c] for r in by_file.values()) for c in COLUMNS}

    def table(rows: dict[str, dict[str, float]], n: int, what: str) -> list[str]:
        lines = [f"| {what} | wall s | trace s | lower s | compile s | programs |", "|---|---:|---:|---:|---:|---:|"]
        for name, r in sorted(rows.items(), key=lambda kv: -kv[1]["wall"])[:n]:
            lines.append(f"| {name} | {r['wall']:.1f} | {r['trace']:.1f} | {r['lower']:.1f} | {r['compile']:.1f} "
                         f"| {int(r['programs'])} |")
        return lines

    head = (f"{len(by_test)} tests: wall {total['wall']:.0f} s in the pytest processes, of which JAX tracing "
            f"{total['trace']:.0f} s, lowering {total['lower']:.0f} s, XLA compile {total['compile']:.0f} s "
            f"({int(total['programs'])} programs)")
    return "\n".join([head, "", *table(by_file, top, "file"), "", *table(by_test, top, "test")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="the JAXLOWFP_SUITE_PROFILE directory of a run")
    parser.add_argument("--top", type=int, default=25, help="rows per table (default 25)")
    args = parser.parse_args()
    print(summarize(args.directory, args.top))


if __name__ == "__main__":
    main()
