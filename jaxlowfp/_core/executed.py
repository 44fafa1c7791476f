"""The execution record: whether a quantized op has run, held as state of the op itself.

Every quantized op of jaxlowfp (a QAT layer's or the Qwix provider's `QuantOp`, a PTQ layer's activation quantizer)
owns an :class:`ExecutionRecord`: an ``nnx.Variable`` holding an int32 scalar code, 0 until the op's forward has
run, then ``1 + BACKENDS.index(backend)`` for the GEMM its forward product ran on. `jaxlowfp.ops` writes it in each
call (:func:`write`), as a NumPy constant, so it is

- a runtime value: it leaves ``nnx.jit`` (and ``jax.jit`` over ``nnx.split`` state, when the function returns the
  state) with the model's other state, like the amax histories; a call whose state is dropped leaves no record;
- concrete even inside a trace: code that inspects the model in the same trace (`jaxlowfp.training.make_step`'s
  check) reads it without running anything;
- not in the graph definition: two identically built quantized models have equal graphdefs and share one trace.

Linen ops keep the same code as a variable of their own collection (`jaxlowfp.qlinen`).
"""
from __future__ import annotations

from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx

__all__ = ["ExecutionRecord", "RecordSink", "BACKENDS", "new_record", "code", "write", "read", "new_op_key"]

# the forward GEMMs (`jaxlowfp.qat.gemm`), in code order: code 1 + i; code 0: the op has not run
BACKENDS = ("dequant", "fp8", "scaled_matmul")
_OTHER = len(BACKENDS) + 1  # ran, on a backend this table does not name


class ExecutionRecord(nnx.Variable):
    """int32 scalar: 0 while the op has not run, else ``1 + BACKENDS.index(backend)`` of its last forward
    (`jaxlowfp.execution`). State, not configuration: not trained, small, and never part of the graphdef."""


class RecordSink(Protocol):
    """What `jaxlowfp.ops` writes a record to: an `ExecutionRecord`, or a Linen variable's stand-in."""

    def set_value(self, value: Any) -> Any: ...


def new_record() -> ExecutionRecord:
    """A fresh record: not executed. A NumPy value, as every value `write` sets: it lives on no device, so a model
    placed on a mesh after (or before) its ops were made is still all on the mesh (`jaxlowfp.sharding`); a jitted
    call takes it as any input and returns it on the call's devices. `quantize_model` and `pack_model` then put it
    where the model's arrays are (`jaxlowfp._core.placement`), so the first call compiles what later calls run."""
    return ExecutionRecord(np.zeros((), np.int32))


def code(backend: str | None) -> np.ndarray:
    """The record's code for an op whose forward ran on `backend` (None: ran, backend not known): an int32 0-d
    NumPy array, the kind `new_record` starts with (a jitted function's cache sees the same kind of input)."""
    c = 1 + BACKENDS.index(backend) if backend in BACKENDS else _OTHER
    return np.asarray(c, np.int32)


def write(record: RecordSink | None, backend: str | None) -> None:
    """Record on `record` (an `ExecutionRecord`, or None: nothing) that its op ran on `backend`. The value is a
    NumPy constant, so it is concrete in a trace as well."""
    if record is not None:
        record.set_value(code(backend))


def read(value: Any) -> tuple[bool | None, str | None]:
    """``(executed, backend)`` from a record's value. A traced value that this trace did not write (the record
    came in as an argument, or left a nested transform) gives ``(None, None)``: not known here. A stacked record
    (an op inside ``nnx.scan`` / ``nnx.vmap``) counts as executed when any slice is."""
    if isinstance(value, jax.core.Tracer):
        return None, None
    if isinstance(value, jax.Array) and not value.is_fully_addressable:  # replicated over processes: ours suffices
        value = value.addressable_data(0)
    c = int(np.max(np.asarray(value))) if np.size(value) else 0
    if c <= 0:
        return False, None
    return True, BACKENDS[c - 1] if c - 1 < len(BACKENDS) else None


def new_op_key(path: str) -> str:
    """Deprecated: ops no longer carry a key (the record is their own state). Returns `path` unchanged, so code
    that still passes a key keeps working; the key is ignored."""
    return str(path)
