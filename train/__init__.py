"""The training application run from the checkout: ``python -m train``.

Modules: `train.data` (byte-level domains, batch iterator), `jaxlowfp.models.llama` (Llama-style decoder in Flax NNX),
`train.evaluate` (validation loss, multiple-choice task, loss APE), `train.report` (table and plots), and the
loop, checkpointing, mesh and command line. Submodules are imported explicitly; this package imports nothing.
"""
