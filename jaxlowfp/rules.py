"""Module-path rules: the one rule type of QAT (`jaxlowfp.qnnx.quantize_model`, recipes) and PTQ
(`jaxlowfp.ptq.quantize_model`, schemes), how rules are matched, and the report of what a quantize call did.

A `Rule` names modules by a regex matched with `re.fullmatch` against their "/"-joined NNX graph path (as
``nnx.iter_graph`` gives it, e.g. ``blocks/3/mlp/gate_proj``) and says what to do with them:

    Rule(path=r"blocks/\\d+/mlp/\\w+_proj", recipe=qat.hif8_w8a8())     # QAT: fake quantization while training
    Rule(path=r"blocks/\\d+/mlp/\\w+_proj", scheme=ptq.scheme("nvfp4-mse"))  # PTQ: weights quantized once
    Rule(path=r"blocks/0/.*")                                          # keep in high precision, explicitly

Rules are tried in order and the first whose regex matches a path decides (`select`); a rule that decided no
module is reported as unused, so a typo in a path does not silently leave a model in high precision.

>>> from jaxlowfp.rules import Rule, select
>>> rules = [Rule(path="blocks/0/.*"), Rule(path="blocks/\\\\d+/mlp/.*"), Rule(path="head")]
>>> decided, unused = select(rules, ["blocks/0/mlp/up", "blocks/1/mlp/up", "blocks/1/attn/q"])
>>> decided, unused
([0, 1, None], ('head',))
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import dataclasses
import re
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from jaxlowfp._core import executed as _executed

__all__ = ["QuantizeReport", "Rule", "check_rules", "grouped_weights", "natural_key", "not_executed_message",
           "select"]

# what each field holds: (module, class). Looked up in sys.modules rather than imported (this module sits below
# both): an object of that class exists only once its module has been imported.
_KINDS = {"recipe": ("jaxlowfp.qat.spec", "Recipe"), "scheme": ("jaxlowfp.ptq.formats", "Scheme")}


def _is_kind(value: Any, field: str) -> bool:
    module, name = _KINDS[field]
    cls = getattr(sys.modules.get(module), name, None)
    return cls is not None and isinstance(value, cls)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """``path``: a regex matched with `re.fullmatch` against a module path. At most one of ``recipe`` (a
    `jaxlowfp.qat.Recipe`, for `jaxlowfp.qnnx.quantize_model`) and ``scheme`` (a `jaxlowfp.ptq.Scheme`, for
    `jaxlowfp.ptq.quantize_model`); with neither, the matched modules are kept in high precision, explicitly (the report
    says so). Each quantize call checks that its rules carry the kind it applies."""

    path: str
    recipe: Any = None
    scheme: Any = None
    _regex: re.Pattern = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise TypeError(f"Rule.path must be a regex string; got {type(self.path).__name__}: {self.path!r}")
        for field, public in (("recipe", "jaxlowfp.qat.Recipe"), ("scheme", "jaxlowfp.ptq.Scheme")):
            value = getattr(self, field)
            if value is not None and not _is_kind(value, field):
                raise TypeError(f"Rule(path={self.path!r}).{field} must be a {public} or None (keep high "
                                f"precision); got {type(value).__name__}: {value!r}")
        if self.recipe is not None and self.scheme is not None:
            raise ValueError(f"Rule(path={self.path!r}) has both a recipe (QAT) and a scheme (PTQ); give one, or "
                             f"neither to keep the modules in high precision")
        try:
            regex = re.compile(self.path)
        except re.error as e:
            raise ValueError(f"Rule.path {self.path!r} is not a valid regular expression: {e}") from None
        object.__setattr__(self, "_regex", regex)

    @property
    def keeps(self) -> bool:
        """True for a keep-in-high-precision rule (neither recipe nor scheme)."""
        return self.recipe is None and self.scheme is None

    def matches(self, module_path: str) -> bool:
        return self._regex.fullmatch(module_path) is not None


def check_rules(rules: Rule | Sequence[Rule], *, field: str, caller: str) -> list[Rule]:
    """The rules as a list, each a `Rule` whose other field than ``field`` (``"recipe"`` or ``"scheme"``) is None;
    else a TypeError that names the rule and what ``caller`` applies."""
    other = {"recipe": "scheme", "scheme": "recipe"}[field]
    rules = [rules] if isinstance(rules, Rule) else list(rules)
    for i, r in enumerate(rules):
        if not isinstance(r, Rule):
            raise TypeError(f"rules[{i}] must be a jaxlowfp.rules.Rule; got {type(r).__name__}: {r!r}")
        if getattr(r, other) is not None:
            raise TypeError(f"rules[{i}] (path={r.path!r}) has a {other}, but {caller} applies a {field} (or "
                            f"neither, to keep modules in high precision)")
    return rules


def select(rules: Sequence[Rule], paths: Sequence[str]) -> tuple[list[int | None], tuple[str, ...]]:
    """For each path, the index of the first rule that matches it (or None); and the regexes of the rules that
    decided no path (matched nothing, or only paths an earlier rule decided), in rule order."""
    decided = [next((i for i, r in enumerate(rules) if r.matches(p)), None) for p in paths]
    used = set(decided)
    return decided, tuple(r.path for i, r in enumerate(rules) if i not in used)


def not_executed_message(paths: Sequence[str], *, ran: bool, what: dict[str, str] | None = None) -> str:
    """The warning for layers configured as quantized whose quantized op never executed; `ran`: whether some
    other quantized op of the model did (so the model was called); `what`: per path, what it was configured to."""
    shown = ", ".join(f"{p} ({what[p]})" if what and p in what else p for p in list(paths)[:8])
    more = f" and {len(paths) - 8} more" if len(paths) > 8 else ""
    if ran:
        why = ("the model ran, but these layers were never called: their kernel is read directly (e.g. "
               "`x @ layer.kernel[...]`) or the module is unused, so their quantized op never ran and their "
               "inputs stayed in high precision. Call the layer (`layer(x)`), or exclude it from the rules "
               "(a Rule with no recipe / scheme) so the report says so")
    else:
        why = ("no quantized op of the model has executed yet: call the model once first (eagerly or under nnx.jit; "
               "a jitted call that drops the model's state leaves no record, as it leaves no amax history)")
    return f"{len(paths)} layer(s) reported quantized never ran quantized ({shown}{more}): {why}."


def grouped_weights(model: Any) -> list[tuple[str, Any, str]]:
    """(path, module, weight name) of every expert weight of the modules that declare grouped GEMMs: a module with
    a tuple ``grouped_weights`` of the names of its [E, K, N] ``nnx.Param`` s, which computes each product through
    the `jaxlowfp.qnnx.QuantRaggedOp` it finds at ``quant_<name>`` when there is one (`jaxlowfp.models.moe.Experts`).
    The path is the weight's, e.g. ``blocks/1/mlp/experts/gate_proj``. Both QAT (`jaxlowfp.qnnx.quantize_model`) and
    PTQ (`jaxlowfp.ptq.quantize_model`) quantize these weights."""
    from flax import nnx  # on use: the rules themselves need no Flax

    out = []
    for parts, node in nnx.iter_graph(model):
        names = getattr(node, "grouped_weights", None) if isinstance(node, nnx.Module) else None
        if isinstance(names, tuple):
            out += [("/".join(str(p) for p in (*parts, name)), node, name) for name in names]
    return out


def natural_key(path: str) -> list:
    """Sort key that orders ``blocks/2`` before ``blocks/10``."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", path) if t]


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeReport:
    """What a quantize call did (`jaxlowfp.qnnx.quantize_model`, `jaxlowfp.ptq.quantize_model`). Paths are
    "/"-joined NNX graph paths.

    quantized:        (path, recipe or scheme name) of each module quantized by this call
    kept:             (path, rule regex) of each module a keep rule (no recipe, no scheme) kept in high precision
    unmatched:        paths of candidate modules no rule matched (left in high precision)
    already_quantized: paths of modules that were quantized before this call (left as they are)
    unused_rules:     regexes of the rules that decided no module (matched nothing, or only shadowed paths)
    quantized_fraction: quantized kernel elements / all candidate kernel elements
    records:          (path, `jaxlowfp.execution.ExecutionRecord`) of each op quantized by this call: the op's own
                      state, read by `executed` / `not_executed` (the model's Variables, so what a call of the
                      model writes back, eagerly, by ``nnx.jit`` or by ``nnx.update``, shows here)
    """

    quantized: tuple[tuple[str, str], ...]
    kept: tuple[tuple[str, str], ...]
    unmatched: tuple[str, ...]
    already_quantized: tuple[str, ...]
    unused_rules: tuple[str, ...]
    quantized_fraction: float
    records: tuple[tuple[str, Any], ...] = dataclasses.field(default=(), compare=False, repr=False)

    def _ran(self, record: Any) -> bool:
        return bool(_executed.read(record.get_value())[0])

    def executed(self) -> tuple[str, ...]:
        """Paths of the layers quantized by this call whose quantized op has run since: each op's execution record
        (its own state, written by its forward). "quantized" says what the rules configured; this says what ran.
        A call whose state is dropped (``jax.jit`` of a function that does not return the model's state) leaves
        no record, as it leaves no amax history."""
        return tuple(p for p, r in self.records if self._ran(r))

    def not_executed(self) -> tuple[str, ...]:
        """Paths quantized by this call whose quantized op has not run yet. After the model has been called, these
        are layers quantized on paper only: the layer is never called (its kernel is read directly, e.g.
        ``x @ layer.kernel[...]``), so their inputs are never quantized."""
        return tuple(p for p, r in self.records if not self._ran(r))

    def check_executed(self, *, strict: bool = False) -> tuple[str, ...]:
        """After the model's first call: a warning (`strict`: a RuntimeError) naming every layer reported quantized
        whose quantized op never executed, and why; returns their paths."""
        missing = self.not_executed()
        if missing:
            msg = not_executed_message(missing, ran=len(missing) < len(self.records))
            if strict:
                raise RuntimeError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return missing

    def __str__(self) -> str:
        keys = dict(self.records)
        ran = any(self._ran(r) for r in keys.values())

        def state(p: str) -> str:
            if p not in keys:
                return ""
            return " (executed)" if self._ran(keys[p]) else (
                " (NOT executed: the layer is never called)" if ran else " (not executed yet)")

        rows = [(p, "quantized", name + state(p)) for p, name in self.quantized]
        rows += [(p, "already", "quantized before this call") for p in self.already_quantized]
        rows += [(p, "kept", f"rule {rx!r} (no recipe or scheme)") for p, rx in self.kept]
        rows += [(p, "unmatched", "no rule: high precision") for p in self.unmatched]
        rows.sort(key=lambda r: natural_key(r[0]))
        width = max([len("module path")] + [len(r[0]) for r in rows])
        lines = [f"{'module path':<{width}}  {'action':<9}  recipe / reason", "-" * (width + 30)]
        lines += [f"{p:<{width}}  {a:<9}  {d}" for p, a, d in rows]
        n_q = len(self.quantized) + len(self.already_quantized)
        lines.append(f"quantized {n_q} of {len(rows)} linear modules, {100.0 * self.quantized_fraction:.1f} % of "
                     f"linear kernel weights")
        if self.unused_rules:
            lines.append("unused rules (decided no module): " + ", ".join(repr(r) for r in self.unused_rules))
        else:
            lines.append("unused rules: none")
        return "\n".join(lines)


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
