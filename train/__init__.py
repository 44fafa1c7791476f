"""The training application run from the checkout: ``python -m train``.

Modules: `train.data` (byte-level domains, batch iterator), `jaxlowfp.models.llama` (Llama-style decoder in Flax NNX),
`train.evaluate` (validation loss, multiple-choice task, loss APE), `train.report` (table and plots), and the
loop, checkpointing, mesh and command line. Submodules are imported explicitly; this package imports nothing.
"""

# The cyclic GC's thresholds for a process that traces and compiles JAX programs (`python -m train` sets them in
# `main`, the test suite in tests/conftest.py): the youngest generation is collected after 50,000 net allocations of
# tracked objects, not CPython's 700. Tracing allocates millions of short-lived objects, and at 700 a test process
# ran a full collection of its ever larger heap (JAX's caches) about every 8 s, 0.3 s each (16 in a 130 s run).
# Measured on a 2-core VM, four compile-heavy test files in one process: 86.6 / 86.6 s with the default, 81.9 / 82.6
# / 79.6 s with these, the same peak memory; (100_000, 50, 50) with gc.freeze() after collection, 87.1 / 82.5 s. The
# tiny `python -m train` run of tests/test_train_main.py: 20.0 / 24.2 s before, 19.0 / 21.5 s after. The same
# objects are collected, later.
GC_THRESHOLD = (50_000, 20, 20)
