"""Path rules that swap `nnx.Linear` modules for `QuantLinear` in place, and the report of what they did."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, MutableMapping, MutableSequence, Sequence
from typing import Any

import numpy as np
from flax import nnx

from jaxlowfp import qat
from jaxlowfp.nnx.layer import QuantLinear

_PathParts = tuple[Any, ...]


def _join(path: _PathParts) -> str:
    return "/".join(str(p) for p in path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """`path` is a regex matched with `re.fullmatch` against a module path like `blocks/3/mlp/gate_proj`.

    `recipe=None` keeps the matched modules in high precision, explicitly (and the report says so).
    """

    path: str
    recipe: qat.Recipe | None
    _regex: re.Pattern = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.path, str):
            raise TypeError(f"Rule.path must be a regex string; got {type(self.path).__name__}: {self.path!r}")
        if self.recipe is not None and not isinstance(self.recipe, qat.Recipe):
            raise TypeError(
                f"Rule(path={self.path!r}).recipe must be a jaxlowfp.qat.Recipe or None (keep high precision); "
                f"got {type(self.recipe).__name__}: {self.recipe!r}"
            )
        try:
            regex = re.compile(self.path)
        except re.error as e:
            raise ValueError(f"Rule.path {self.path!r} is not a valid regular expression: {e}") from None
        object.__setattr__(self, "_regex", regex)

    def matches(self, module_path: str) -> bool:
        return self._regex.fullmatch(module_path) is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeReport:
    """What `quantize` did. Paths are "/"-joined NNX graph paths.

    quantized:        (path, recipe name) of each module now a QuantLinear
    kept:             (path, rule regex) of each Linear a `recipe=None` rule kept in high precision
    unmatched:        Linear paths no rule matched (left in high precision)
    already_quantized: QuantLinear paths found in the model before this call (left as they are)
    unused_rules:     regexes of the rules that decided no module (matched nothing, or only shadowed paths)
    quantized_fraction: quantized kernel elements / all Linear and QuantLinear kernel elements
    """

    quantized: tuple[tuple[str, str], ...]
    kept: tuple[tuple[str, str], ...]
    unmatched: tuple[str, ...]
    already_quantized: tuple[str, ...]
    unused_rules: tuple[str, ...]
    quantized_fraction: float

    def __str__(self) -> str:
        rows = [(p, "quantized", name) for p, name in self.quantized]
        rows += [(p, "already", "QuantLinear before quantize()") for p in self.already_quantized]
        rows += [(p, "kept", f"rule {rx!r} (recipe=None)") for p, rx in self.kept]
        rows += [(p, "unmatched", "no rule: high precision") for p in self.unmatched]
        rows.sort(key=lambda r: _natural_key(r[0]))
        width = max([len("module path")] + [len(r[0]) for r in rows])
        lines = [f"{'module path':<{width}}  {'action':<9}  recipe / reason", "-" * (width + 30)]
        lines += [f"{p:<{width}}  {a:<9}  {d}" for p, a, d in rows]
        n_lin = len(rows)
        n_q = len(self.quantized) + len(self.already_quantized)
        lines.append(
            f"quantized {n_q} of {n_lin} linear modules, {100.0 * self.quantized_fraction:.1f} % of linear kernel "
            f"weights"
        )
        if self.unused_rules:
            lines.append("unused rules (decided no module): " + ", ".join(repr(r) for r in self.unused_rules))
        else:
            lines.append("unused rules: none")
        return "\n".join(lines)


def _natural_key(path: str) -> list:
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", path) if t]


def _kernel_size(m: nnx.Module) -> int:
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


def _check_replaceable(parent: Any, where: str) -> None:
    if not isinstance(parent, (nnx.Module, list, dict, MutableSequence, MutableMapping)):
        raise TypeError(
            f"{where}: cannot replace a module held in a {type(parent).__name__} (immutable); hold it in a list, "
            f"nnx.List, dict or nnx.Dict, or exclude the path from the rules"
        )


def quantize(model: nnx.Module, rules: Sequence[Rule], *, rngs: nnx.Rngs | None = None) -> QuantizeReport:
    """Replace every `nnx.Linear` whose path a rule with a recipe matches by a `QuantLinear`, in place.

    Rules are tried in order and the first whose regex `re.fullmatch`es the path decides. A Linear reachable
    from several parents (shared) is replaced at every reference, so sharing is preserved. Every layer is
    validated before the first replacement, so an error leaves the model unchanged. `rngs` is needed only by
    recipes with stochastic rounding.
    """
    if isinstance(rules, Rule):
        rules = [rules]
    rules = list(rules)
    for i, r in enumerate(rules):
        if not isinstance(r, Rule):
            raise TypeError(f"rules[{i}] must be a jaxlowfp.nnx.Rule; got {type(r).__name__}: {r!r}")
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module; got {type(model).__name__}")
    if isinstance(model, (nnx.Linear, QuantLinear)):
        raise TypeError("quantize() replaces modules inside a model; for a bare nnx.Linear use QuantLinear.from_linear")

    nodes = [(p, n) for p, n in nnx.iter_graph(model) if isinstance(n, nnx.Module)]
    used = [False] * len(rules)
    quantized, kept, unmatched, already = [], [], [], []
    replacements: dict[int, QuantLinear] = {}
    total = done = 0
    for parts, node in nodes:
        if isinstance(node, QuantLinear):
            already.append(_join(parts))
            total += _kernel_size(node)
            done += _kernel_size(node)
            continue
        if not isinstance(node, nnx.Linear):
            continue
        path = _join(parts)
        total += _kernel_size(node)
        idx = next((i for i, r in enumerate(rules) if r.matches(path)), None)
        if idx is None:
            unmatched.append(path)
            continue
        used[idx] = True
        rule = rules[idx]
        if rule.recipe is None:
            kept.append((path, rule.path))
            continue
        if type(node) is not nnx.Linear:
            raise TypeError(
                f"{path}: rule {rule.path!r} matches a {type(node).__name__}, a subclass of nnx.Linear; replacing "
                f"it by a QuantLinear would drop its own behaviour. Exclude it or quantize it yourself."
            )
        replacements[id(node)] = QuantLinear.from_linear(node, rule.recipe, path=path, rngs=rngs)
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

    return QuantizeReport(
        quantized=tuple(quantized),
        kept=tuple(kept),
        unmatched=tuple(unmatched),
        already_quantized=tuple(already),
        unused_rules=tuple(r.path for r, u in zip(rules, used) if not u),
        quantized_fraction=float(done / total) if total else 0.0,
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


