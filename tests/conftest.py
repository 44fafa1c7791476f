"""Test configuration: strict dtype promotion, rank promotion raises, several fake CPU devices (set before any
backend starts), and (opt-in, ``JAXLOWFP_TEST_XLA_CACHE=1``) one persistent compilation cache per test run.

The cache: many files compile the same programs (the tiny and SmolLM2 models' forward passes, the `python -m train`
subprocesses' steps), and on 2 CPU cores compiling is much of the suite's time. The controlling pytest process makes
a fresh directory before the xdist workers start; the workers and every subprocess they run inherit it through
JAX_COMPILATION_CACHE_DIR, so a program compiled once is loaded, not compiled, by the next process that needs it.
A loaded executable is the same compiled program, so results are unchanged, bit for bit. Fresh per run (deleted at
the end): an executable made on one CPU is never loaded on another. Set JAX_COMPILATION_CACHE_DIR yourself to keep
one, or to an empty string to run without.

LLVM at -O0 (``--xla_backend_optimization_level=0``, added to XLA_FLAGS unless they set a level): the suite's
programs are tiny and compiled once, so LLVM's optimisation passes cost more than they save (measured: the suite
runs about a quarter faster). XLA's own HLO passes (the algebraic rewrites the bit-exactness tests are about:
division into reciprocal multiply, fusion) are the same at every level; LLVM's code generation is not, and can
round a multiply-add of two different programs differently (seen once: an EMA 1 ulp apart at -O0), which is why
two different programs are compared within float32 rounding, never bitwise, unless their result is integer-exact.
``XLA_FLAGS=--xla_backend_optimization_level=2`` runs the suite as users' programs are compiled.
"""
import gc
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# Off unless JAXLOWFP_TEST_XLA_CACHE=1 (or JAX_COMPILATION_CACHE_DIR is set): the suite takes as long with it.
# Stop 49, programs over 0.5 s cached: pytest 1482 s without, 1445-1515 s with, on CI's 2 cores. Stop 61, every
# program cached (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0; a small eager program compiled in 17 ms and loaded
# in 3.4 ms, and writing it took 0.4 ms and added no memory mapping): 863 s with, 856 s without, back to back on one
# 2-core VM, the cache at 94 MB by 86 % of the run.
_OWN_CACHE = os.environ.get("JAXLOWFP_TEST_XLA_CACHE") == "1" and "JAX_COMPILATION_CACHE_DIR" not in os.environ
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "")
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxlowfp-tests-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402

from train import GC_THRESHOLD  # noqa: E402

gc.set_threshold(*GC_THRESHOLD)  # train/__init__.py: fewer full collections of a heap JAX's caches keep growing
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
if os.environ["JAX_COMPILATION_CACHE_DIR"]:
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


def compiled(caplog, fun_name: str) -> list[str]:
    """XLA's "Finished XLA compilation of <fun_name> ..." messages among `caplog`'s records (the test runs its code
    under ``caplog.at_level(logging.DEBUG)`` and ``jax.log_compiles(True)``): one per compilation of that program."""
    return [m for m in (r.getMessage() for r in caplog.records)
            if m.startswith("Finished XLA compilation of") and fun_name in m]


def child_xla_flags() -> str:
    """XLA_FLAGS for a test's subprocess that sets its own device count: this run's flags without a forced host
    device count."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                    if not f.startswith("--xla_force_host_platform_device_count"))


def child_cache_env(directory) -> dict[str, str]:
    """Environment for subprocesses of one test that share a persistent compilation cache in `directory` (every
    program cached, however small or quick to compile): a later process loads what an earlier one compiled."""
    return {"JAX_COMPILATION_CACHE_DIR": str(directory), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def pytest_unconfigure(config):
    """The controlling process (not an xdist worker) deletes the cache it made."""
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_shared():
    """SmolLM2-135M (``jaxlowfp.models.load("smollm2-135m")``: model, tokenizer), loaded once per pytest worker
    (about 10 s each time on 2 cores) and shared by the tests that only read it. A test that changes the model
    (quantizes it, sets its weights) takes ``smollm2`` below, its own copy."""
    from jaxlowfp.models import load
    return load("smollm2-135m")


@pytest.fixture
def smollm2(smollm2_shared):
    """A fresh copy of the shared SmolLM2 (``nnx.clone``: its own parameter arrays, the same values), for a test that
    changes the model; with the shared tokenizer (it holds no state the tests change)."""
    from flax import nnx
    model, tok = smollm2_shared
    return nnx.clone(model), tok


def pytest_collection_modifyitems(config, items):
    """`slow` marks the tests that run SmolLM2-135M in this process (they take its fixtures): ``-m "not slow"`` is a
    quick run while developing; `make test` runs everything."""
    for item in items:
        if {"smollm2_shared", "smollm2"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def _mapped_regions() -> int:
    """This process's memory mappings (lines of /proc/self/maps; 0 where there is no procfs)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def _map_budget() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // 2
    except (OSError, ValueError):
        return 30_000


_MAP_BUDGET = _map_budget()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """At a test-module boundary, drop JAX's compiled programs once this worker holds more than half of the kernel's
    mapping limit (``vm.max_map_count``, 65530 by default). XLA:CPU maps each compiled object's code, read-only data
    and data as separate regions, and jit caches keep every executable alive: stop 49's clean runs each lost a worker
    to a segfault late in the run (74-92 %), inside the compilation or serialization of a large program, when mmap
    failed at the limit. ``jax.clear_caches()`` unmaps them; programs a later module needs are compiled again.
    Results are unchanged. Why half: sampled every 5 s through a whole run (stop 62), a worker gained up to 9,000
    regions a minute and one module at most 6,800 (test_packed_load), so half the limit leaves about five times that
    before mmap fails; at a third, each worker cleared its caches 4-5 times a run and compiled again what the next
    modules shared."""
    if nextitem is not None and nextitem.module is item.module:
        return
    if _mapped_regions() > _MAP_BUDGET:
        jax.clear_caches()
        gc.collect()
