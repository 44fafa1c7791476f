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

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flax import nnx

from jaxlowfp._core import executed as _record
from jaxlowfp._core.executed import ExecutionRecord
from jaxlowfp.rules import not_executed_message

__all__ = ["ExecutionRecord", "QuantizedOp", "quantized_ops", "op_modules", "check_executed", "records",
           "update_records", "checked_call", "SharedPrograms", "BATCH_SCALES", "batch_scaled_ops",
           "per_request_model"]

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


def op_modules(model: nnx.Module) -> list[tuple[str, Any]]:
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
    for path, op in op_modules(model):
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
    ops = op_modules(model)
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


# Batch-spanning activation scales (used by jaxlowfp.evaluation: a request's score must not depend on its batch)
BATCH_SCALES = ("warn", "error", "token")


def batch_scaled_ops(model: nnx.Module) -> list[tuple[str, str]]:
    """``(path, why)`` of every quantized op of `model` whose activation scale spans the whole batch, so that a
    request's score depends on the other requests batched with it and on the padding: an activation quantized with
    current per-tensor scaling (``CurrentScaling(granularity="tensor")``, the ``qat.nvfp4_w4a4()`` default and
    ``ptq`` with ``activation_scale="tensor"``: ``amax = max |x|`` over every row of the batch), or with delayed
    scaling whose history is still empty (its first estimate is the batch's amax). MX activations (block scales
    only), per-token, static and warmed-up delayed scales are per request. The ops found are the modules holding a
    `jaxlowfp.qat.Recipe` (``recipe``): `jaxlowfp.qnnx` layers, PTQ'd layers' activation quantizers and the Qwix
    provider's NNX ops."""
    from jaxlowfp.qat.spec import Recipe
    from jaxlowfp.scaling import CurrentScaling, DelayedScaling

    out = []
    for path, m in nnx.iter_modules(model):
        recipe = getattr(m, "recipe", None)
        if not isinstance(recipe, Recipe) or recipe.activation is None or recipe.activation.is_mx:
            continue
        sc, name = recipe.activation.scaling, _op_name(path, m)
        if isinstance(sc, CurrentScaling) and sc.granularity == "tensor":
            out.append((name, f"recipe {recipe.name!r}: the activation's amax is the whole batch's (current "
                              f"per-tensor scaling)"))
        elif isinstance(sc, DelayedScaling) and sc.convention == "default":
            try:
                # any history still empty (an expert op holds one per expert: count [E])
                empty = bool((np.asarray(m.amax.get_value().activation.count) == 0).any())  # type: ignore[attr-defined]
            except (AttributeError, TypeError, ValueError):
                empty = False  # no readable history (not a QAT op): nothing to say
            if empty:
                out.append((name, f"recipe {recipe.name!r}: delayed scaling with an empty amax history (the first "
                                  f"estimate is the batch's amax)"))
    return out


def _op_name(path: Any, module: Any) -> str:
    return "/".join(map(str, path)) or type(module).__name__


def _per_token(recipe: Any) -> Any:
    """`recipe` with its activation scaled per token (current scaling, one amax per vector along the contraction
    axis), as `jaxlowfp.harness.eval_recipe` builds it; the gradient quantizer dropped (evaluation has no backward)."""
    from jaxlowfp.scaling import CurrentScaling

    a = recipe.activation
    act = dataclasses.replace(a, scaling=CurrentScaling(target_max=a.scaling.target_max, granularity="token"),
                              target_max=None)
    return dataclasses.replace(recipe, activation=act, grad=None)


def _per_token_state(op: Any) -> None:
    """Give a QAT op whose recipe `_per_token` replaced the state that recipe expects (in the copy: `op`'s variables
    are its own): the activation's amax history a fresh per-token one (a delayed history of 1024 amaxes, say, is not
    a current-scaling state of 1; an expert op's keeps its leading expert axis), the weight's kept, and no gradient
    slots (the per-token recipe has no gradient quantizer). Evaluation drops what the forward pass writes there."""
    from jaxlowfp.qat.spec import RecipeState

    var = getattr(op, "amax", None)
    old = var.get_value() if isinstance(var, nnx.Variable) else None
    if not isinstance(old, RecipeState) or old.activation is None or not isinstance(var, nnx.Variable):
        return
    fresh = op.recipe.activation.init()
    o, f = jax.tree.leaves(old.activation)[0], jax.tree.leaves(fresh)[0]
    lead = tuple(o.shape[: o.ndim - f.ndim])  # the expert axis of a per-expert state, else ()
    act = jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (*lead, *leaf.shape)), fresh)
    setattr(op, "amax", type(var)(RecipeState(weight=old.weight, activation=act)))  # a new Variable: never `model`'s


def per_request_model(model: nnx.Module, batch_scales: str) -> nnx.Module:
    """The model that `jaxlowfp.evaluation.score_requests` runs: `model` itself, or (``batch_scales="token"``) a
    copy sharing its arrays whose batch-spanning activation scales (`batch_scaled_ops`) are per token; "error"
    refuses such a model and "warn" warns, naming the ops."""
    if batch_scales not in BATCH_SCALES:
        raise ValueError(f"batch_scales={batch_scales!r}; allowed: {', '.join(BATCH_SCALES)}")
    found = batch_scaled_ops(model)
    if not found:
        return model
    names = "; ".join(f"{p} ({why})" for p, why in found[:4]) + (f"; and {len(found) - 4} more" if len(found) > 4
                                                                  else "")
    if batch_scales == "token":
        qwix = [p for p, _ in found if p.rsplit("/", 1)[-1].startswith("jaxlowfp_")]  # qwix_provider.NNX_PREFIX
        if qwix:
            raise ValueError(f"batch_scales='token': the Qwix provider's ops {qwix[:3]} take their recipe from the "
                             f"provider's rule at every call, so evaluation cannot rescale them; quantize with a "
                             f"per-token recipe (jaxlowfp.harness.eval_recipe(recipe, 'token')) instead")
        graphdef, state = nnx.split(model)
        run = nnx.merge(graphdef, state)  # new modules, the same arrays: `model` keeps its recipes
        mods = {_op_name(p, m): m for p, m in nnx.iter_modules(run)}
        for p, _ in found:
            m = mods[p]
            m.recipe = _per_token(m.recipe)  # type: ignore[attr-defined]  # a recipe-holding op (batch_scaled_ops)
            _per_token_state(m)
            if hasattr(m, "activation_scale"):  # a PTQ ActQuant: its description follows its recipe
                m.activation_scale = "token"
        return run
    msg = (f"{len(found)} quantized op(s) scale their activations over the whole batch, so each request's score "
           f"depends on the requests batched with it and on the padding: {names}. Pass batch_scales='token' to "
           f"score every request with per-token activation scales, or quantize with per-token or static activation "
           f"scales (jaxlowfp.harness.eval_recipe(recipe, 'token'); ptq activation_scale='token' or 'static')")
    if batch_scales == "error":
        raise ValueError(msg)
    warnings.warn(msg, UserWarning, stacklevel=3)
    return model



__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
