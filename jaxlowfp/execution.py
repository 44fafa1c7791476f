"""What ran: the quantized ops of a model, configured versus executed.

A rule decides that a layer is quantized (the report's "configured"); the layer's quantized op runs only when the
layer is called. A model that reads a layer's kernel directly (``x @ self.qkv.kernel[...]``) never calls it, so
its inputs are never quantized while the report lists it. Every quantized op of jaxlowfp (a QAT layer's or the Qwix
provider's `jaxlowfp.qnnx.QuantOp`, a PTQ layer's `jaxlowfp.ptq.ActQuant`) holds a key in the execution record of
`jaxlowfp.ops`, marked when the op is traced; this module reads it for a whole model::

    logits = model(tokens)                       # or any jitted step: tracing runs the ops
    execution.check_executed(model)              # warns, naming each quantized layer that never ran
    execution.check_executed(model, strict=True) # raises instead

`jaxlowfp.evaluation` and `jaxlowfp.training.make_step` call it after their first traced call, so a layer quantized
on paper only is named at once.

Flax Linen (`jaxlowfp.qlinen`, and the Qwix provider on Linen models): pass the variables instead of a model. Each
quantized op there has its scale state in ``amax_state`` (or ``_overwrite_with_gradient``); it counts as executed
once an ``apply`` has traced it (``init`` traces every op and does not count)::

    variables = model.init(key, x)
    y, upd = model.apply(variables, x, mutable=["amax_state"])
    execution.check_executed(variables)          # e.g. a layer called only while initializing
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

from flax import nnx

from jaxlowfp._core import executed as _record
from jaxlowfp.rules import not_executed_message

__all__ = ["QuantizedOp", "quantized_ops", "check_executed", "SharedPrograms"]

_WARNED: set[frozenset[str]] = set()


class QuantizedOp(NamedTuple):
    """One quantized op of a model: its path, what it was configured to (recipe or format name), its
    execution-record key, whether it has executed and on which backend its forward product ran ("dequant",
    "fp8", "scaled_matmul"; None where it has not run or the op records none, e.g. PTQ's activation quantizers)."""

    path: str
    configured: str
    op_key: str
    executed: bool
    backend: str | None = None


def _describe(op: Any) -> str:
    name = getattr(getattr(op, "recipe", None), "name", None) or type(op).__name__
    return f"PTQ {name}: weights quantized, activation quantization never ran" if hasattr(op, "fmt") else name


def _linen_ops(variables: Mapping[str, Any]) -> list[QuantizedOp]:
    from jaxlowfp import owg, qat
    from jaxlowfp.qlinen import AMAX_COLLECTION, linen_op_key

    def is_state(x: Any) -> bool:
        return isinstance(x, (qat.RecipeState, owg.Carried))

    out = []
    for collection in (AMAX_COLLECTION, owg.COLLECTION):
        leaves, _ = jax.tree_util.tree_flatten_with_path(variables.get(collection, {}), is_leaf=is_state)
        for keys, leaf in leaves:
            if not is_state(leaf):
                continue
            names = [str(getattr(k, "key", k)) for k in keys]
            path, key = "/".join(names[:-1]), linen_op_key("/".join(names[:-1]), names[-1])
            out.append(QuantizedOp(path, f"Linen quantized op {names[-1]!r}", key, _record.executed(key),
                                  _record.backend(key)))
    return out


def quantized_ops(model: Any) -> list[QuantizedOp]:
    """Every quantized op in `model` (NNX graph order): QuantOps (QAT layers, Qwix provider) and the run-time
    activation quantizers of PTQ'd layers (held in a layer's ``dot_general`` / ``einsum_op``). A Linen model's
    variables (a mapping of collections): the ops whose scale state they hold (`jaxlowfp.qlinen`)."""
    if isinstance(model, Mapping):
        return _linen_ops(model)
    out = []
    for parts, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        path = "/".join(map(str, parts))
        candidates = [(path, node)] + [(f"{path}/{k[len('quant_'):]}" if k.startswith("quant_") else path, v)
                                       for k, v in vars(node).items() if not isinstance(v, nnx.Module)
                                       and (k in ("dot_general", "einsum_op") or k.startswith("quant_"))]
        for p, op in candidates:
            key = getattr(op, "op_key", None)
            if isinstance(key, str) and getattr(op, "recipe", None) is not None:
                out.append(QuantizedOp(p, _describe(op), key, _record.executed(key), _record.backend(key)))
    return out


def check_executed(model: Any, *, strict: bool = False, warn_once: bool = True) -> tuple[str, ...]:
    """Paths of the quantized ops in `model` (an NNX model, or a Linen model's variables) that have not executed; a
    RuntimeWarning naming them and saying why (or, with `strict`, a RuntimeError). Call it after the model's first
    (traced) call. `warn_once`: the same set
    of layers is warned about once per process."""
    ops = quantized_ops(model)
    missing = [op for op in ops if not op.executed]
    if missing:
        msg = not_executed_message([op.path for op in missing], ran=len(missing) < len(ops),
                                   what={op.path: op.configured for op in missing})
        if strict:
            raise RuntimeError(msg)
        token = frozenset(op.op_key for op in missing)
        if not (warn_once and token in _WARNED):
            _WARNED.add(token)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return tuple(op.path for op in missing)


def _shared_graphdef(block: nnx.Module) -> Any:
    """A key equal for blocks of the same structure: the block's graphdef with its quantized ops' static names
    blanked (a QuantOp's ``path`` and ``op_key``, a PTQ hook's ``path`` and ``op_key``: used in error messages and
    the execution record only), so identical blocks share one compiled program."""
    import dataclasses

    from jaxlowfp.qnnx.layer import QuantOp

    saved_ops, saved_hooks = [], []
    for _, m in nnx.iter_modules(block):
        if isinstance(m, QuantOp):
            saved_ops.append((m, m.path, m.op_key))
        for k, v in list(vars(m).items()):
            if dataclasses.is_dataclass(v) and not isinstance(v, type) and isinstance(getattr(v, "op_key", None), str):
                saved_hooks.append((m, k, v))
    try:
        for m, _, _ in saved_ops:
            m.path, m.op_key = "", ""
        for m, k, v in saved_hooks:
            setattr(m, k, dataclasses.replace(v, path="", op_key=""))
        return nnx.graphdef(block)
    finally:
        for m, p, k in saved_ops:
            m.path, m.op_key = p, k
        for m, k, v in saved_hooks:
            setattr(m, k, v)


class SharedPrograms:
    """Blocks of a model split so that blocks of the same structure share one graphdef, hence one compiled program
    of a function jitted with the graphdef static (block-by-block evaluation and generation: a fake-quantized
    layer is thousands of HLO ops, and one program for the whole model costs gigabytes to compile).

    ``split[i]`` is ``(graphdef, state)`` of block ``i``: the graphdef of the first block of its structure, its own
    state. The ops of a block that runs a program traced for another block are not traced under their own keys:
    `mark_shared` marks them executed once the first block's ops are.
    """

    def __init__(self, blocks: list[nnx.Module]):
        first: dict[Any, tuple[nnx.GraphDef, list[str]]] = {}  # structure -> its first block's graphdef, op keys
        self.split: list[tuple[nnx.GraphDef, nnx.State]] = []
        self._keys: list[tuple[list[str], list[str]]] = []
        for block in blocks:
            g, s = nnx.split(block)
            keys = [op.op_key for op in quantized_ops(block)]
            g0, keys0 = first.setdefault(_shared_graphdef(block), (g, keys))
            self.split.append((g0, s))
            self._keys.append((keys0, keys))

    def mark_shared(self) -> None:
        """Mark the ops of every block whose program (traced for an identical block) has executed."""
        for keys0, keys in self._keys:
            if all(_record.executed(k) for k in keys0):
                for k in keys:
                    _record.mark(k)


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
