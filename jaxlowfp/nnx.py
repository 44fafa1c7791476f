"""Flax NNX integration: `QuantLinear`, path rules that swap `nnx.Linear` modules in place, telemetry.

State categories (typed `nnx.Variable` subclasses, so `nnx.split` separates them)::

    AmaxState        the layer's RecipeState (amax histories): functional state, threaded through the train step
    QuantStatsState  the QuantStats of the last call (amax, scale, saturated / underflow fractions, ...)
    QuantPhase       a bool scalar: True = observe only (warmup: y = x @ w exactly, histories still recorded)

    graphdef, params, qstate, rest = nnx.split(model, nnx.Param, AmaxState, ...)
    nnx.Optimizer(model, tx, wrt=nnx.Param)          # amax histories never reach optax

`quantize(model, rules)` replaces matching modules in their parent (attribute, list item or dict entry); nothing is
cloned, and the new `QuantLinear` holds the very same `nnx.Param` objects as the `nnx.Linear` it replaces.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator, MutableMapping, MutableSequence, Sequence
from types import MappingProxyType
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.nnx.nn.linear import default_bias_init, default_kernel_init
from jax import lax

from jaxlowfp import qat

__all__ = [
    "AmaxState",
    "QuantStatsState",
    "QuantPhase",
    "QuantLinear",
    "Rule",
    "QuantizeReport",
    "quantize",
    "paper_rules",
    "set_observe_only",
    "collect_stats",
    "max_saturated_fraction",
    "iter_quant_linears",
]


class AmaxState(nnx.Variable):
    """A QuantLinear's `RecipeState` (amax histories): the functional QAT state, separate from `nnx.Param`."""


class QuantStatsState(nnx.Variable):
    """The `RecipeStats` (weight and activation `QuantStats`) of a QuantLinear's last call: telemetry, not
    trained and not needed to resume."""


class QuantPhase(nnx.Variable):
    """Bool scalar: True = observe only (high-precision warmup), False = fake-quantized."""


_PathParts = tuple[Any, ...]


def _join(path: _PathParts) -> str:
    return "/".join(str(p) for p in path)


def _needs_key(recipe: qat.Recipe) -> bool:
    return any(s is not None and s.rounding == "stochastic" for s in (recipe.weight, recipe.activation, recipe.grad))


def _check_layer_shape(recipe: qat.Recipe, in_features: int, out_features: int, where: str) -> None:
    """Block-scaled formats need whole blocks: the activation [.., in] is blocked along `in`, the kernel
    [in, out] along `in` (its contraction axis) and, for 2D tiles (r, c), along `out` by r; a quantized output
    gradient [.., out] along `out`. (The wgrad blocks run along the tokens: that count is checked per call.)"""
    for role in ("activation", "weight", "grad"):
        spec = getattr(recipe, role, None)
        block = getattr(spec, "block_shape", None) if spec is not None else None
        if block is None:
            continue
        block = tuple(int(b) for b in block)
        problems = []
        if role == "grad":  # dgrad quantizes dy [.., out] in blocks along `out`
            if out_features % block[-1]:
                problems.append(f"out_features={out_features} is not a multiple of the block size {block[-1]}")
        elif in_features % block[-1]:
            problems.append(f"in_features={in_features} is not a multiple of the block size {block[-1]}")
        if role == "weight" and block[0] > 1 and out_features % block[0]:
            problems.append(f"out_features={out_features} is not a multiple of the tile height {block[0]}")
        if problems:
            raise ValueError(
                f"{where}: recipe {recipe.name!r} quantizes the {role} as {spec.format} with block_shape={block}, "
                f"but {' and '.join(problems)}. Keep this layer in high precision (a Rule with recipe=None) "
                f"or use a recipe without block scaling."
            )


@functools.lru_cache(maxsize=256)
def _stats_shapes(recipe: qat.Recipe, in_features: int, out_features: int, dtype: np.dtype) -> Any:
    x = jax.ShapeDtypeStruct((1, in_features), dtype)
    w = jax.ShapeDtypeStruct((in_features, out_features), dtype)
    fn = lambda x, w, s, k: qat.linear(x, w, recipe=recipe, state=s, key=k)[2]  # noqa: E731
    return jax.eval_shape(fn, x, w, recipe.init(), jax.random.key(0))


def _zero_stats(recipe: qat.Recipe, in_features: int, out_features: int, dtype: Any, where: str) -> Any:
    """A zero RecipeStats pytree with the structure `qat.linear` returns, found by abstract evaluation (cached
    per recipe and shape; it also surfaces any incompatibility the QAT op itself detects, named by path)."""
    try:
        shapes = _stats_shapes(recipe, int(in_features), int(out_features), np.dtype(dtype))
    except (ValueError, TypeError, NotImplementedError) as e:
        raise ValueError(f"{where}: recipe {recipe.name!r} cannot quantize this layer: {e}") from e
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


class QuantLinear(nnx.Module):
    """Drop-in for `nnx.Linear` that fake-quantizes weight and input with a `qat.Recipe`.

        y = Q_a(x) @ Q_w(W) + b        (straight-through gradients; Q = identity while observe_only)

    Same `kernel` [in, out] and `bias` [out] Params, initializers, dtypes and promotion as `nnx.Linear`, so a
    checkpoint of either loads into the other. In observe-only mode the output is bitwise that of `nnx.Linear`.
    Each call stores the updated amax histories in `self.amax` and the stats in `self.stats`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        recipe: qat.Recipe,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Any = default_kernel_init,
        bias_init: Any = default_bias_init,
        promote_dtype: Any = nnx_dtypes.promote_dtype,
        preferred_element_type: Any = None,
        observe_only: bool = False,
        path: str = "",
        rngs: nnx.Rngs | None = None,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        _from: nnx.Linear | None = None,  # private: from_linear's way to adopt existing Params
    ):
        if not isinstance(recipe, qat.Recipe):
            raise TypeError(f"recipe must be a jaxlowfp.qat.Recipe; got {type(recipe).__name__}: {recipe!r}")
        if not isinstance(path, str):
            raise TypeError(f"path must be a str; got {type(path).__name__}")
        where = path or f"QuantLinear({in_features}, {out_features})"
        _check_layer_shape(recipe, int(in_features), int(out_features), where)
        if _needs_key(recipe) and rngs is None:
            raise TypeError(f"{where}: recipe {recipe.name!r} uses stochastic rounding and needs rngs=nnx.Rngs(...) "
                            f"(its 'quant' stream, or 'default') to draw a key per call")
        if _from is None:
            if rngs is None:
                raise TypeError("QuantLinear needs rngs=nnx.Rngs(...) to initialize its parameters")
            self.kernel = nnx.Param(
                kernel_init(rngs.params(), (in_features, out_features), param_dtype), **kernel_metadata
            )
            self.bias = (
                nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype), **bias_metadata)
                if use_bias
                else nnx.data(None)
            )
        else:  # adopt the Param objects of an existing Linear: no copy of the weights
            self.kernel = _from.kernel
            self.bias = _from.bias if use_bias else nnx.data(None)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.promote_dtype = promote_dtype
        self.preferred_element_type = preferred_element_type
        self.recipe = recipe
        self.path = path
        compute_dtype = dtype if dtype is not None else param_dtype
        self.amax = AmaxState(recipe.init())
        self.stats = QuantStatsState(_zero_stats(recipe, in_features, out_features, compute_dtype, where))
        self.observe_only = QuantPhase(_bool_flag(observe_only))
        self.rngs = rngs["quant"].fork() if _needs_key(recipe) else nnx.data(None)

    @classmethod
    def from_linear(
        cls,
        linear: nnx.Linear,
        recipe: qat.Recipe,
        *,
        path: str = "",
        observe_only: bool = False,
        rngs: nnx.Rngs | None = None,
    ) -> "QuantLinear":
        """A QuantLinear sharing `linear`'s kernel and bias `nnx.Param` objects (same arrays, no copy).

        `rngs` is needed only by recipes with stochastic rounding (a forked 'quant' stream per layer).
        """
        where = path or "from_linear"
        if not isinstance(linear, nnx.Linear):
            raise TypeError(f"{where}: expected an nnx.Linear; got {type(linear).__name__}")
        if linear.dot_general is not lax.dot_general:
            raise ValueError(
                f"{where}: this nnx.Linear uses a custom dot_general ({linear.dot_general!r}); QuantLinear would "
                f"replace it. Keep the layer out of the rules or build the QuantLinear yourself."
            )
        return cls(
            linear.in_features,
            linear.out_features,
            recipe=recipe,
            use_bias=linear.use_bias,
            dtype=linear.dtype,
            param_dtype=linear.param_dtype,
            precision=linear.precision,
            promote_dtype=linear.promote_dtype,
            preferred_element_type=linear.preferred_element_type,
            observe_only=observe_only,
            path=path,
            rngs=rngs,
            _from=linear,
        )

    def __call__(self, inputs: jax.Array, out_sharding: Any = None, *, key: jax.Array | None = None) -> jax.Array:
        """`key` overrides the layer's own stream (used only by stochastic-rounding recipes)."""
        if out_sharding is not None:
            raise NotImplementedError(
                f"{self.path or 'QuantLinear'}: out_sharding is not supported by the quantized matmul; shard the "
                f"inputs and parameters instead"
            )
        if key is None and self.rngs is not None:
            key = self.rngs()
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        y, new_state, stats = qat.linear(
            inputs,
            kernel,
            recipe=self.recipe,
            state=self.amax.get_value(),
            observe_only=self.observe_only[...],
            key=key,
            precision=self.precision,
            preferred_element_type=self.preferred_element_type,
        )
        self.amax.set_value(new_state)
        self.stats.set_value(stats)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y


# --------------------------------------------------------------------------------------------------- rules


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
    """Direct (key, child) pairs of a module or of a plain list / tuple / dict attribute."""
    if isinstance(node, nnx.Module):
        return [(k, v) for k, v in nnx.graph.get_node_impl(node).node_dict(node).items()
                if not (isinstance(k, str) and k.startswith("_"))]
    if isinstance(node, (list, tuple)):
        return list(enumerate(node))
    if isinstance(node, dict):
        return list(node.items())
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


# --------------------------------------------------------------------------------------------------- phase, stats


def _bool_flag(flag: Any) -> jax.Array:
    """The flag as a bool[] array; qat's validation (Python bool, or a bool scalar array, traced or not)."""
    return jnp.asarray(qat.observe_flag(flag))


def set_observe_only(model: nnx.Module, flag: bool | jax.Array) -> int:
    """Switch every QuantLinear to observe-only (warmup, `flag=True`) or quantized (`False`).

    The flag is state (a `QuantPhase` variable), not static config: a traced bool flips a jitted step without
    retracing. Returns the number of QuantLinear modules switched.
    """
    value = _bool_flag(flag)
    n = 0
    for _, m in iter_quant_linears(model):
        m.observe_only.set_value(value)
        n += 1
    return n


def _key_name(k: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _named_leaves(tree: Any) -> Iterator[tuple[tuple[str, ...], jax.Array]]:
    """(key names, leaf) for every leaf of a pytree (NamedTuple fields, dict keys, sequence indices)."""
    for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        yield tuple(_key_name(k) for k in kp), leaf


def _flatten_floats(pairs: Iterator[tuple[tuple[str, ...], Any]]) -> dict[str, float]:
    """{"a/b/c": float} from (names, leaf) pairs; a non-scalar leaf gets one "/i" entry per element."""
    out: dict[str, float] = {}
    for names, leaf in pairs:
        name = "/".join(n for n in names if n)
        arr = np.asarray(jax.device_get(leaf))
        if arr.ndim == 0:
            out[name] = float(arr)
        else:
            out.update({f"{name}/{i}": float(v) for i, v in enumerate(arr.reshape(-1))})
    return out


def _flat_stats(model: nnx.Module) -> Iterator[tuple[tuple[str, ...], jax.Array]]:
    for path, m in iter_quant_linears(model):
        for names, leaf in _named_leaves(m.stats.get_value()):
            yield (path, *names), leaf


def collect_stats(model: nnx.Module) -> dict[str, float]:
    """Every QuantLinear's last QuantStats as a flat `{path/tensor/field: float}` dict, for a logger, e.g.
    `blocks/3/mlp/gate_proj/activation/saturated_fraction`."""
    return _flatten_floats(_flat_stats(model))


def max_saturated_fraction(model: nnx.Module) -> jax.Array:
    """max over all QuantLinear tensors of the last saturated (clipped) fraction, as a float32 scalar.

    Traceable: return it from a jitted step for a progress bar. 0 when the model has no QuantLinear.
    """
    vals = [jnp.max(leaf).astype(jnp.float32) for names, leaf in _flat_stats(model)
            if names[-1] == "saturated_fraction"]
    return jnp.max(jnp.stack(vals)) if vals else jnp.zeros((), jnp.float32)
