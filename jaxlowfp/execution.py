"""What ran: the quantized ops of a model, configured versus executed.

A rule decides that a layer is quantized (the report's "configured"); the layer's quantized op runs only when the
layer is called. A model that reads a layer's kernel directly (``x @ self.qkv.kernel[...]``) never calls it, so
its inputs are never quantized while the report lists it. Every quantized op of jaxlowfp (a QAT layer's or the Qwix
provider's `jaxlowfp.qnnx.QuantOp`, a PTQ layer's `jaxlowfp.ptq.ActQuant`) owns an :class:`ExecutionRecord`: an
``nnx.Variable`` (int32 scalar) that the op's forward sets to "ran, on backend b" (`jaxlowfp.ops`); this module
reads it for a whole model::

    logits = nnx.jit(lambda m, x: m(x))(model, x)  # eager or nnx.jit: the records are written back
    execution.check_executed(model)              # warns, naming each quantized layer that never ran
    execution.check_executed(model, strict=True) # raises instead

Why state: the record is a runtime value of the op, like its amax histories, so it follows the model through
``nnx.split`` / ``nnx.merge``, ``nnx.jit`` and ``jax.jit`` over split state (returned with the state); nothing
process-specific is in the graphdef, so two identically built quantized models share one trace and one compiled
program, and nothing is global. The price: a call whose state is dropped (``jax.jit(lambda m, x: m(x))`` returns
the logits only) leaves no record, as it leaves no amax history; return the state (``nnx.jit`` does) or read the
records it returns (:func:`records`, ``nnx.update``). PTQ's activation quantizers are small ``nnx.Module`` s for
this reason (a frozen dataclass hook is static and cannot hold a runtime value): installed as a layer's
``dot_general`` they are its graph children, and their record is part of ``nnx.state(model)``.

`jaxlowfp.evaluation` and `jaxlowfp.training.make_step` check after their first call (make_step within its
trace), so a layer quantized on paper only is named at once.

Flax Linen (`jaxlowfp.qlinen`, and the Qwix provider on Linen models): pass the variables instead of a model. Each
quantized op there has its scale state in ``amax_state`` (or ``_overwrite_with_gradient``) and its record next to
it (`jaxlowfp.qlinen`); ``init`` does not count, an ``apply`` with the collection mutable writes it, and the
returned collection merged back into the variables is what this module reads::

    variables = model.init(key, x)
    y, upd = model.apply(variables, x, mutable=["amax_state"])
    variables = {**variables, **upd}
    execution.check_executed(variables)          # e.g. a layer called only while initializing
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from flax import nnx

from jaxlowfp._core import executed as _record
from jaxlowfp._core.executed import ExecutionRecord
from jaxlowfp.rules import not_executed_message

__all__ = ["ExecutionRecord", "QuantizedOp", "quantized_ops", "check_executed", "records",
           "update_records", "checked_call", "SharedPrograms"]

_WARNED: set[tuple[int, frozenset[str]]] = set()  # (id of the model, paths) already warned about


class QuantizedOp(NamedTuple):
    """One quantized op of a model: its path, what it was configured to (recipe or format name), its execution
    record (the op's `ExecutionRecord` variable; for Linen, the record's path in the variables), whether it has
    executed and on which backend its forward product ran ("dequant", "fp8", "scaled_matmul"; None where it has
    not run)."""

    path: str
    configured: str
    record: Any
    executed: bool
    backend: str | None = None


def _describe(op: Any, ran: bool) -> str:
    """What the op is and, for a PTQ activation quantizer, what it did: its activations quantized at run time
    (`ran`) or not (yet)."""
    name = getattr(getattr(op, "recipe", None), "name", None) or type(op).__name__
    if not hasattr(op, "fmt"):
        return name
    if ran:
        return f"PTQ {name}: weights quantized, activations quantized at run time " \
               f"({getattr(op, 'activation_scale', 'tensor')} scale)"
    return f"PTQ {name}: weights quantized, activation quantization never ran"


def _linen_ops(variables: Mapping[str, Any]) -> list[QuantizedOp]:
    from jaxlowfp import owg, qat
    from jaxlowfp.qlinen import AMAX_COLLECTION, EXECUTED_COLLECTION, record_name

    def is_state(x: Any) -> bool:
        return isinstance(x, (qat.RecipeState, owg.Carried))

    out = []
    for collection, flags in ((AMAX_COLLECTION, AMAX_COLLECTION), (owg.COLLECTION, EXECUTED_COLLECTION)):
        leaves, _ = jax.tree_util.tree_flatten_with_path(variables.get(collection, {}), is_leaf=is_state)
        for keys, leaf in leaves:
            if not is_state(leaf):
                continue
            names = [str(getattr(k, "key", k)) for k in keys]
            node: Any = variables.get(flags, {})
            for n in names[:-1]:
                node = node.get(n, {}) if isinstance(node, Mapping) else {}
            value = node.get(record_name(names[-1])) if isinstance(node, Mapping) else None
            ran, backend = _record.read(value) if value is not None else (False, None)
            out.append(QuantizedOp("/".join(names[:-1]), f"Linen quantized op {names[-1]!r}",
                                   "/".join([flags, *names[:-1], record_name(names[-1])]), bool(ran), backend))
    return out


_HOOKS = ("dot_general", "einsum_op")  # a layer's hook attributes; "quant_<name>": a grouped weight's


def _ops(model: nnx.Module) -> list[tuple[str, Any]]:
    """(report path, op) of every module of `model` that owns an execution record: QuantOps at their graph path,
    PTQ hooks at their layer's path (``dot_general`` / ``einsum_op``) or ``<module>/<weight>`` (``quant_<weight>``);
    a record held elsewhere (a packed layer's copy of the hook, which it never calls) is not an op of the model."""
    out = []
    for parts, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module) or not isinstance(getattr(node, "record", None), ExecutionRecord) \
                or getattr(node, "recipe", None) is None:
            continue
        names = [str(p) for p in parts]
        if not hasattr(node, "fmt"):  # a QAT / Qwix QuantOp
            out.append(("/".join(names), node))
        elif names and names[-1] in _HOOKS:
            out.append(("/".join(names[:-1]), node))
        elif names and names[-1].startswith("quant_"):
            out.append(("/".join([*names[:-1], names[-1][len("quant_"):]]), node))
    return out


def quantized_ops(model: Any) -> list[QuantizedOp]:
    """Every quantized op in `model` (NNX graph order): QuantOps (QAT layers, Qwix provider) and the run-time
    activation quantizers of PTQ'd layers (a layer's ``dot_general`` / ``einsum_op``, a grouped weight's
    ``quant_<name>``). A Linen model's variables (a mapping of collections): the ops whose scale state they hold
    (`jaxlowfp.qlinen`). Inside a trace, an op counts as executed once this trace has run it."""
    if isinstance(model, Mapping):
        return _linen_ops(model)
    out = []
    for path, op in _ops(model):
        ran, backend = _record.read(op.record.get_value())
        out.append(QuantizedOp(path, _describe(op, bool(ran)), op.record, bool(ran), backend))
    return out


def check_executed(model: Any, *, strict: bool = False, warn_once: bool = True) -> tuple[str, ...]:
    """Paths of the quantized ops in `model` (an NNX model, or a Linen model's variables) that have not executed; a
    RuntimeWarning naming them and saying why (or, with `strict`, a RuntimeError). Call it after the model's first
    call (with its state written back). `warn_once`: the same set of layers of one model object is warned about once."""
    return _check(quantized_ops(model), strict, warn_once, id(model))


def _check(ops: list[QuantizedOp], strict: bool, warn_once: bool, owner: int) -> tuple[str, ...]:
    missing = [op for op in ops if not op.executed]
    if missing:
        msg = not_executed_message([op.path for op in missing], ran=len(missing) < len(ops),
                                   what={op.path: op.configured for op in missing})
        if strict:
            raise RuntimeError(msg)
        token = (owner, frozenset(op.path for op in missing))
        if not (warn_once and token in _WARNED):
            _WARNED.add(token)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return tuple(op.path for op in missing)


def records(model: nnx.Module, *, written: bool = False) -> nnx.State:
    """The execution records of `model` (``nnx.state(model, ExecutionRecord)``): what a jitted function that
    drops the rest of the state returns, for :func:`update_records` (or ``nnx.update``) outside. ``written``: only
    those this trace wrote (concrete values; a record that came in as an argument is a tracer), so a program that
    runs part of a model returns no output for the rest of it."""
    state = nnx.state(model, ExecutionRecord)
    if not written:
        return state
    return nnx.from_flat_state([(p, v) for p, v in nnx.to_flat_state(state)
                                if not isinstance(v.get_value(), jax.core.Tracer)])


def update_records(model: nnx.Module, recs: nnx.State) -> None:
    """Write into `model` the records in `recs` (from :func:`records` of a model or block of the same structure,
    e.g. returned by a jitted function) that say executed; the others leave the model's as they are (a program
    that ran part of the model returns the rest as it got it). Written as NumPy values, as the ops write them: the
    model's inputs to a jitted function keep their kind, so its cache gets no second entry for them."""
    mine = {path: v for path, v in nnx.to_flat_state(records(model))}
    for path, v in nnx.to_flat_state(recs):
        ran, backend = _record.read(v.get_value() if isinstance(v, nnx.Variable) else v)
        if path in mine and ran:
            mine[path].set_value(_record.code(backend))


def checked_call(model: nnx.Module, fn: Callable[..., Any], *args: Any, strict: bool = False) -> Any:
    """``fn(model, *args)``, then :func:`check_executed` on the ops this call ran, inside a trace as well.

    Every record starts the call at 0 (concrete), so an op counts as executed when this call wrote it (a record
    written inside a nested transform, ``nnx.remat`` or ``nnx.scan``, comes back traced: it counts as run); the
    records of the ops that did not run are then restored. Used by `jaxlowfp.training.make_step` at trace time."""
    ops = _ops(model)
    before = [op.record.get_value() for _, op in ops]
    for _, op in ops:
        op.record.set_value(np.zeros((), np.int32))
    try:
        out = fn(model, *args)
    finally:
        after = [op.record.get_value() for _, op in ops]
        ran = [isinstance(a, jax.core.Tracer) or bool(_record.read(a)[0]) for a in after]
        for (_, op), b, a, r in zip(ops, before, after, ran):
            op.record.set_value(a if r else b)
    seen = [QuantizedOp(path, _describe(op, r), op.record, r) for (path, op), r in zip(ops, ran)]
    _check(seen, strict, True, id(model))
    return out


def _structure(block: nnx.Module) -> nnx.GraphDef:
    """A key equal for blocks of the same structure: the block's graphdef with its quantized ops' ``path`` (a static
    name used in error messages only) blanked. Nothing else differs between identical blocks: the execution
    records are state."""
    ops: list[Any] = [m for _, m in nnx.iter_modules(block)
                      if isinstance(getattr(m, "record", None), ExecutionRecord)
                      and isinstance(getattr(m, "path", None), str)]
    saved = [m.path for m in ops]
    try:
        for m in ops:
            m.path = ""
        return nnx.graphdef(block)
    finally:
        for m, p in zip(ops, saved):
            m.path = p


class SharedPrograms:
    """Blocks of a model split so that blocks of the same structure share one graphdef, hence one compiled program
    of a function jitted with the graphdef static (block-by-block evaluation and generation: a fake-quantized
    layer is thousands of HLO ops, and one program for the whole model costs gigabytes to compile).

    ``split[i]`` is ``(graphdef, state)`` of block ``i``: the graphdef of the first block of its structure (the
    blocks differ in their ops' ``path``, a name for error messages, only), its own state. The execution records
    are state, so no key is blanked and nothing is marked by hand: a program that returns ``records(block)``
    hands them to :meth:`record` (``record(i, recs)``), which writes them into block ``i``.
    """

    def __init__(self, blocks: list[nnx.Module]):
        first: dict[nnx.GraphDef, nnx.GraphDef] = {}
        self.blocks = list(blocks)
        self.split: list[tuple[nnx.GraphDef, nnx.State]] = []
        for block in self.blocks:
            g, s = nnx.split(block)
            self.split.append((first.setdefault(_structure(block), g), s))
        self._recorded: set[int] = set()

    def record(self, i: int, recs: nnx.State) -> None:
        """Write the execution records a program returned for block `i` into that block (once per block: a
        program's records do not change between calls)."""
        if i not in self._recorded:
            update_records(self.blocks[i], recs)
            self._recorded.add(i)

    def mark_shared(self) -> None:
        """Deprecated, does nothing: the records come back with each block's own state (:meth:`record`)."""


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
