"""`quantize`: path rules (`jaxlowfp.rules.Rule` with a recipe) swap `nnx.Linear`, `nnx.Einsum` and `nnx.LinearGeneral`
modules for `QuantLinear`, `QuantEinsum` and `QuantLinearGeneral` in place, and report what they did
(`jaxlowfp.rules.QuantizeReport`)."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator, MutableMapping, MutableSequence, Sequence
from typing import Any, cast

import numpy as np
from flax import nnx

from jaxlowfp import qat
from jaxlowfp._core.placement import commit_state
from jaxlowfp.qnnx.layer import GROUPED_PREFIX, QuantEinsum, QuantLinear, QuantLinearGeneral, QuantOp, QuantRaggedOp
from jaxlowfp.rules import QuantizeReport, Rule, check_rules, grouped_weights, select

_PathParts = tuple[Any, ...]

# the module types quantize() replaces, and how (each builds the quantized layer around the same Params)
_CONVERT: dict[type[nnx.Module], Callable[..., QuantOp]] = {
    nnx.Linear: QuantLinear.from_linear,
    nnx.Einsum: QuantEinsum.from_einsum,
    nnx.LinearGeneral: QuantLinearGeneral.from_linear_general,
}
_QUANTIZED = (QuantLinear, QuantEinsum, QuantLinearGeneral)
# a module quantize() replaces or finds already replaced: each has a `kernel` Param
_Layer = nnx.Linear | nnx.Einsum | nnx.LinearGeneral | QuantLinear | QuantEinsum | QuantLinearGeneral


def _join(path: _PathParts) -> str:
    return "/".join(str(p) for p in path)


def _kernel_size(m: _Layer) -> int:
    return int(np.prod(m.kernel.shape))


def _children(node: Any) -> list[tuple[Any, Any]]:
    """Direct (key, child) pairs of a module, an `nnx.List` / `nnx.Dict`, or a plain list / tuple / dict
    attribute; keys as `nnx.iter_graph` puts them in paths (attribute names, indices, dict keys)."""
    if isinstance(node, (list, tuple, MutableSequence)):
        return list(enumerate(node))
    if isinstance(node, (dict, MutableMapping)):
        return list(node.items())
    if isinstance(node, nnx.Module):
        return [(k, v) for k, v in vars(node).items() if not k.startswith("_")]
    return []


def _module_references(model: nnx.Module) -> list[tuple[Any, Any, nnx.Module]]:
    """Every (parent, key, module) reference in the graph, shared modules included (iter_graph yields a shared
    module once, under its first path; replacing it must update every parent)."""
    refs, seen = [], {id(model)}

    def visit(node: Any) -> None:
        for key, child in _children(node):
            if isinstance(child, nnx.Module):
                refs.append((node, key, child))
                if id(child) not in seen:
                    seen.add(id(child))
                    visit(child)
            elif isinstance(child, (list, tuple, dict)):
                visit(child)

    visit(model)
    return refs


def iter_quant_linears(model: nnx.Module) -> Iterator[tuple[str, QuantLinear]]:
    """(path, module) for each QuantLinear in `model`, path joined with "/"."""
    for parts, node in nnx.iter_graph(model):
        if isinstance(node, QuantLinear):
            yield _join(parts), node


def iter_quant_ops(model: nnx.Module) -> Iterator[tuple[str, QuantOp]]:
    """(path, op) for every quantized contraction in `model`: the quantized layers and the QuantOps the Qwix
    provider attached to the modules it intercepts; path joined with "/"."""
    for parts, node in nnx.iter_graph(model):
        if isinstance(node, QuantOp):
            yield _join(parts), node


def _check_replaceable(parent: Any, where: str) -> None:
    if not isinstance(parent, (nnx.Module, list, dict, MutableSequence, MutableMapping)):
        raise TypeError(
            f"{where}: cannot replace a module held in a {type(parent).__name__} (immutable); hold it in a list, "
            f"nnx.List, dict or nnx.Dict, or exclude the path from the rules"
        )


def quantize(model: nnx.Module, rules: Sequence[Rule], *, rngs: nnx.Rngs | None = None) -> QuantizeReport:
    """Replace every `nnx.Linear`, `nnx.Einsum` and `nnx.LinearGeneral` whose path a rule with a recipe matches by
    a `QuantLinear`, `QuantEinsum` or `QuantLinearGeneral`, in place.

    Rules are tried in order and the first whose regex `re.fullmatch`es the path decides. A Linear reachable
    from several parents (shared) is replaced at every reference, so sharing is preserved. Every layer is
    validated before the first replacement, so an error leaves the model unchanged. `rngs` is needed only by
    recipes with stochastic rounding.
    """
    rules = check_rules(rules, field="recipe", caller="jaxlowfp.qnnx.quantize (QAT)")
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module; got {type(model).__name__}")
    if isinstance(model, (*_CONVERT, *_QUANTIZED)):
        raise TypeError(f"quantize() replaces modules inside a model; for a bare {type(model).__name__} use "
                        f"QuantLinear.from_linear, QuantEinsum.from_einsum or QuantLinearGeneral.from_linear_general")

    # the isinstance filter keeps _Layer nodes only (mypy does not narrow on a tuple built by unpacking _CONVERT)
    nodes = cast(list[tuple[_PathParts, _Layer]],
                 [(p, n) for p, n in nnx.iter_graph(model) if isinstance(n, (*_CONVERT, *_QUANTIZED))])
    grouped = grouped_weights(model)
    fresh_grouped = [g for g in grouped if not isinstance(getattr(g[1], GROUPED_PREFIX + g[2], None), QuantRaggedOp)]
    decided, unused = select(rules, [_join(p) for p, n in nodes if not isinstance(n, _QUANTIZED)]
                             + [g[0] for g in fresh_grouped])
    decided_grouped = decided[len(decided) - len(fresh_grouped):]
    decided_layers = iter(decided[:len(decided) - len(fresh_grouped)])
    quantized, kept, unmatched, already, keys = [], [], [], [], []
    replacements: dict[int, QuantOp] = {}
    attach: list[tuple[nnx.Module, str, QuantRaggedOp]] = []
    total = done = 0
    for path, module, name in grouped:  # expert weights [E, K, N] of modules that declare grouped GEMMs
        size = int(np.prod(getattr(module, name).shape))
        total += size
        if (path, module, name) not in fresh_grouped:
            already.append(path)
            done += size
            continue
        idx = decided_grouped[fresh_grouped.index((path, module, name))]
        if idx is None:
            unmatched.append(path)
        elif rules[idx].recipe is None:
            kept.append((path, rules[idx].path))
        else:
            w = getattr(module, name)
            op = QuantRaggedOp(rules[idx].recipe, n_experts=w.shape[0], k=w.shape[1], m=w.shape[2],
                               dtype=getattr(module, "dtype", None) or w[...].dtype, path=path, rngs=rngs)
            attach.append((module, GROUPED_PREFIX + name, op))
            quantized.append((path, rules[idx].recipe.name))
            keys.append((path, op.record))
            done += size
    for parts, node in nodes:
        if isinstance(node, _QUANTIZED):
            already.append(_join(parts))
            total += _kernel_size(node)
            done += _kernel_size(node)
            continue
        path = _join(parts)
        total += _kernel_size(node)
        idx = next(decided_layers)
        if idx is None:
            unmatched.append(path)
            continue
        rule = rules[idx]
        if rule.recipe is None:
            kept.append((path, rule.path))
            continue
        convert = _CONVERT.get(type(node))
        if convert is None:
            base = next(t for t in _CONVERT if isinstance(node, t))
            raise TypeError(
                f"{path}: rule {rule.path!r} matches a {type(node).__name__}, a subclass of nnx.{base.__name__}; "
                f"replacing it by a quantized layer would drop its own behaviour. Exclude it or quantize it yourself."
            )
        replacements[id(node)] = convert(node, rule.recipe, path=path, rngs=rngs)
        keys.append((path, replacements[id(node)].record))
        quantized.append((path, rule.recipe.name))
        done += _kernel_size(node)

    todo = [(parent, key, replacements[id(child)]) for parent, key, child in _module_references(model)
            if id(child) in replacements]
    for parent, _, new in todo:  # check every parent first: fail before changing anything
        _check_replaceable(parent, new.path)
    for parent, key, new in todo:
        if isinstance(parent, nnx.Module) and not isinstance(parent, (MutableSequence, MutableMapping)):
            setattr(parent, key, new)
        else:
            parent[key] = new
    for module, attr, op in attach:
        setattr(module, attr, op)
    commit_state(model)  # the first jitted call compiles what every later one runs

    return QuantizeReport(
        quantized=tuple(quantized),
        kept=tuple(kept),
        unmatched=tuple(unmatched),
        already_quantized=tuple(already),
        unused_rules=unused,
        quantized_fraction=float(done / total) if total else 0.0,
        records=tuple(keys),
    )


def paper_rules(
    n_blocks: int,
    *,
    keep_first: int,
    keep_last: int,
    recipe: qat.Recipe,
    block_pattern: str = "blocks/{i}",
    mlp_names: Sequence[str] = ("gate_proj", "up_proj", "down_proj"),
) -> list[Rule]:
    """The Max-Window paper's selection: the MLP projections of blocks keep_first .. n_blocks-keep_last-1 get
    `recipe`; the first `keep_first` and last `keep_last` blocks are kept explicitly in high precision.
    Everything else (attention, embeddings, head) matches no rule and stays in high precision.

    `block_pattern` is a regex template with `{i}` for the block index; an MLP projection is any module inside
    the block whose last path component is one of `mlp_names` (e.g. `blocks/3/mlp/gate_proj`).
    """
    for name, v in (("n_blocks", n_blocks), ("keep_first", keep_first), ("keep_last", keep_last)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be a non-negative int; got {v!r}")
    if keep_first + keep_last >= n_blocks:
        raise ValueError(
            f"keep_first={keep_first} + keep_last={keep_last} leaves no block of n_blocks={n_blocks} to quantize"
        )
    if "{i}" not in block_pattern:
        raise ValueError(f"block_pattern must contain '{{i}}' for the block index; got {block_pattern!r}")
    if isinstance(mlp_names, str) or not mlp_names:
        raise ValueError(f"mlp_names must be a non-empty sequence of module names; got {mlp_names!r}")

    def blocks(ids: range) -> str:
        return block_pattern.replace("{i}", "(?:" + "|".join(str(i) for i in ids) + ")")

    names = "(?:" + "|".join(re.escape(n) for n in mlp_names) + ")"
    rules = []
    if keep_first:
        rules.append(Rule(path=blocks(range(keep_first)) + "/.*", recipe=None))
    if keep_last:
        rules.append(Rule(path=blocks(range(n_blocks - keep_last, n_blocks)) + "/.*", recipe=None))
    rules.append(Rule(path=blocks(range(keep_first, n_blocks - keep_last)) + f"/(?:.+/)?{names}", recipe=recipe))
    return rules


