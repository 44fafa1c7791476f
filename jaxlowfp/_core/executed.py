"""The execution record: which quantized ops have run (been traced) in this process.

Every quantized contraction goes through `jaxlowfp.ops`, which adds the op's key here when it is traced; the
adapters (QAT layers, PTQ hooks, the Qwix provider) keep their op's key as static data, so it survives
``nnx.split`` / ``nnx.merge`` and ``jax.jit``. Reports read it to tell "configured" (a rule chose the layer) from
"executed" (its quantized op really ran): a layer whose kernel is read directly (``x @ layer.kernel[...]``) is
quantized on paper only.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable

_EXECUTED: set[str] = set()
_BACKEND: dict[str, str] = {}  # op key -> the backend its forward product was traced on (jaxlowfp.qat.gemm)
_KEYS = itertools.count()


def new_op_key(path: str) -> str:
    """A fresh key for one quantized op at `path` (unique in the process)."""
    return f"{path}#{next(_KEYS)}"


def mark(op_key: str | None, backend: str | None = None) -> None:
    """Record that the op with this key executed (called by `jaxlowfp.ops` at trace time), and on which backend
    its forward product ran."""
    if op_key is not None:
        _EXECUTED.add(op_key)
        if backend is not None:
            _BACKEND[op_key] = backend


def executed(op_key: str) -> bool:
    """Whether the op with this key has executed (been traced) since it was created."""
    return op_key in _EXECUTED


def backend(op_key: str) -> str | None:
    """The backend the op's forward product last ran on ("dequant", "fp8", "scaled_matmul"; None: not run)."""
    return _BACKEND.get(op_key)


def forget(op_keys: Iterable[str]) -> None:
    """Drop `op_keys` from the record."""
    keys = list(op_keys)
    _EXECUTED.difference_update(keys)
    for k in keys:
        _BACKEND.pop(k, None)
