"""The training application run from the checkout: ``python -m train``.

Modules: `train.data` (byte-level domains, batch iterator), `jaxlowfp.models.llama` (Llama-style decoder in Flax NNX),
`train.evaluate` (validation loss, multiple-choice task, loss APE), `train.report` (table and plots), and the
loop, checkpointing, mesh and command line. Submodules are imported explicitly; this package imports nothing.
"""

# The cyclic GC's thresholds for a process that traces and compiles JAX programs (`python -m train` sets them in
# `main`, the test suite in tests/conftest.py): the first generation at 50,000 allocations, not CPython's 700.
# Tracing allocates millions of short-lived objects, and at 700 the process ran a full collection of its ever larger
# heap (JAX's caches) every few seconds, 0.3 s each. Measured on a 2-core VM: four compile-heavy test files in one
# process, 86.6 / 86.6 s with the default and 81.9 / 82.6 / 79.6 s with these, the same peak memory; the tiny
# `python -m train` run of tests/test_train_main.py, 20.0 / 24.2 s and 19.0 / 21.5 s. (100_000, 50, 50) with
# gc.freeze() after the imports was no better (87.1 / 82.5 s). The same objects are collected, later.
GC_THRESHOLD = (50_000, 20, 20)
