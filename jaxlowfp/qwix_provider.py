"""A Qwix quantization provider with jaxlowfp's formats: ``qwix.quantize_model(model, RecipeProvider(rules))``.

Qwix (github.com/google/qwix) quantizes a Flax model by *interception*: while the model's method runs, calls to
``jax.lax.dot_general`` and ``jax.numpy.einsum`` are routed to a provider, which looks up the first rule whose
``module_path`` regex ``re.fullmatch``-es the calling module's path (and whose ``op_names`` contain the op, if
given). This provider also intercepts ``jax.numpy.matmul`` (and so ``x @ w``) and ``jax.numpy.dot``, looked up as
``dot_general`` ops: JAX jit-compiles those functions and caches their traces, so the ``dot_general`` inside them
reaches an interceptor only on a cache miss, and what it decided (quantize or not, with which module's state) would
be replayed for every later call of the same shapes, whatever the rules say there. Intercepted before their jit,
every call is looked up on its own: a rule's effect is a function of (module path, op name) and the rule order only.
A contraction met inside another jitted function that a module calls (``jnp.inner``, ``jnp.vdot``, a user's
``jax.jit`` helper) cannot be quantized reliably for the same reason: under a quantizing rule it is an error that
names the module, the op and the jitted function. This provider quantizes the matched op with a
:class:`jaxlowfp.qat.Recipe` (HiF8, NVFP4 with every Four Over Six rule, MX, E4M3/E5M2 delayed scaling): the
contraction runs through :func:`jaxlowfp.ops.dot_general` (``jax.lax.ragged_dot``: :func:`jaxlowfp.ops.ragged_dot`),
so it is bit for bit the op :class:`jaxlowfp.qnnx.QuantLinear` runs on the same operands.
Which operand is the weight is found as Qwix finds it (the one that is a parameter of the calling
module), or else the one that is a parameter of one of its submodules (``x @ self.qkv.kernel[...]``, a kernel read
directly); an op between two activations under a quantizing rule is an error (narrow the rule).
`RecipeProvider.executed` lists the ops that were traced quantized (module path, op id, recipe).
`RecipeProvider.direct_reads` lists the contractions that read a submodule's parameter directly
(``x @ self.qkv.kernel[...]`` in the parent) where a quantizing rule matches that submodule but none matches the
module running the contraction: Qwix matches an op by the module that runs it, so the op stays in high precision;
each is warned about (a RuntimeWarning) when it is traced.

State, as in jaxlowfp's own layers:

- NNX: each intercepted op gets a :class:`jaxlowfp.qnnx.QuantOp` child of the calling module, named
  ``jaxlowfp_<op><n>`` (``AmaxState`` histories, ``QuantStatsState`` stats, ``QuantPhase`` flag), so
  :func:`jaxlowfp.training.init` / ``make_step`` train the model (warmup, max-merged microbatches, delayed
  gradient scaling) and :func:`jaxlowfp.qnnx.set_observe_only` / ``collect_stats`` reach it.
- Linen: variables of the calling module named ``<op><n>`` in ``jaxlowfp.qlinen``'s collections
  (``amax_state``, ``quant_phase``, ``quant_stats``), or with ``carry="gradient"`` one
  :class:`jaxlowfp.owg.Carried` in ``_overwrite_with_gradient`` for loops written for Flax's fp8 ops (MaxText).

>>> import jax, jax.numpy as jnp, qwix
>>> from flax import nnx
>>> from jaxlowfp import qat, qwix_provider
>>> class MLP(nnx.Module):
...     def __init__(self, rngs):
...         self.up, self.down = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 16, rngs=rngs)
...     def __call__(self, x):
...         return self.down(jax.nn.relu(self.up(x)))
>>> provider = qwix_provider.RecipeProvider([qwix_provider.RecipeRule(module_path="up", recipe=qat.hif8_w8a8())])
>>> model = qwix.quantize_model(MLP(nnx.Rngs(0)), provider, jnp.ones((2, 16)))
>>> type(model.up.jaxlowfp_dot_general0).__name__, [r.module_path for r in provider.get_unused_rules()]
('QuantOp', [])

Qwix versions: the provider relies on Qwix's private rule lookup (``QuantizationProvider._get_current_rule_and_op_id``,
``_init_rule``) and ``qwix._src.utils.flax_util`` (``get_current_module``, ``find_param``); it is tested with the
versions in :data:`SUPPORTED_QWIX` and refuses to import with others (``tests/test_qwix_provider.py`` checks that
private API, so an upgrade fails loudly).
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import dataclasses
import functools
import inspect
import os
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from packaging.specifiers import SpecifierSet
from qwix._src.utils import flax_util

from jaxlowfp import qat
from jaxlowfp._core.checks import one_of
from jaxlowfp.ops import contraction_sizes, parse_einsum
from jaxlowfp.qlinen import CARRIES, contract_in
from jaxlowfp.qnnx.layer import QuantOp, QuantRaggedOp

__all__ = ["SUPPORTED_QWIX", "OP_NAMES", "RecipeRule", "RecipeProvider"]

SUPPORTED_QWIX = ">=0.1.8,<0.1.9"  # the Qwix releases this provider is tested with: pyproject's pin, as a specifier
# the op names of rules (jnp.matmul, jnp.dot and `@` are dot_general ops; ragged_dot: the grouped GEMM of MoE layers)
OP_NAMES = ("dot_general", "einsum", "ragged_dot")
# jnp functions that JAX jit-compiles and that call lax.dot_general inside: quantized as dot_general ops
_MATMULS = ("matmul", "dot")
# other jitted jnp contractions: a quantizing rule that meets one is an error (nothing is quantized inside them)
_REFUSED = ("vdot", "inner", "matvec", "vecmat")
_PJIT_FILE = os.path.join("jax", "_src", "pjit.py")  # frames of jax.jit's tracing (a cached trace)
_TRACING_FILES = (_PJIT_FILE, os.path.join("jax", "_src", "interpreters"), os.path.join("jax", "_src", "linear_util"),
                  os.path.join("jax", "_src", "api_util"), os.path.join("jax", "_src", "traceback_util"),
                  os.path.join("jax", "_src", "profiler"))
NNX_PREFIX = "jaxlowfp_"  # attribute name of an NNX op's QuantOp: jaxlowfp_dot_general0, jaxlowfp_einsum1, ...

if not SpecifierSet(SUPPORTED_QWIX).contains(qwix.__version__):  # parsed: 0.1.8.post1 is admitted, as by pip
    raise ImportError(f"jaxlowfp.qwix_provider is tested with Qwix {SUPPORTED_QWIX} and uses its private "
                      f"rule lookup; Qwix {qwix.__version__} is installed. Install a tested version "
                      f"(pip install 'jaxlowfp[qwix]') or run tests/test_qwix_provider.py against the new one first.")

# Qwix's own quantization settings: a RecipeRule quantizes by its recipe, so any of these set would be ignored
_QWIX_ONLY = {"weight_qtype": None, "act_qtype": None, "tile_size": None, "act_static_scale": (None, False),
              "weight_calibration_method": "absmax", "act_calibration_method": (None, "absmax")}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeRule(qwix.QuantizationRule):
    """A Qwix rule that quantizes with a :class:`jaxlowfp.qat.Recipe`.

    Attributes:
      module_path: regex, ``re.fullmatch``-ed against the calling module's path ("/"-joined, as Qwix builds it:
        NNX attribute path such as ``layers/0/mlp/up``, Linen scope path such as ``Block_0/Dense_1``).
      op_names: the ops this rule applies to, a subset of :data:`OP_NAMES`; empty for all.
      recipe: the recipe, or None to keep the matched ops in high precision (first match wins, so a None rule
        before a broad one excludes modules).
    Qwix's own ``weight_qtype`` / ``act_qtype`` / ``tile_size`` / calibration fields must stay unset.
    """

    recipe: qat.Recipe | None = None

    def __post_init__(self) -> None:
        if self.recipe is not None and not isinstance(self.recipe, qat.Recipe):
            raise TypeError(f"RecipeRule(module_path={self.module_path!r}).recipe must be a jaxlowfp.qat.Recipe or "
                            f"None (high precision); got {type(self.recipe).__name__}: {self.recipe!r}")
        if not isinstance(self.module_path, str):
            raise TypeError(f"module_path must be a regex string; got {self.module_path!r}")
        try:
            re.compile(self.module_path)
        except re.error as e:
            raise ValueError(f"module_path {self.module_path!r} is not a valid regular expression: {e}") from None
        if isinstance(self.op_names, str):
            raise TypeError(f"op_names must be a collection of op names, e.g. ('einsum',); got the string "
                            f"{self.op_names!r}")
        bad = [op for op in self.op_names if op not in OP_NAMES]
        if bad:
            raise ValueError(f"RecipeRule(module_path={self.module_path!r}): op_names {bad} are not intercepted by "
                             f"this provider; allowed: {OP_NAMES}")
        for name, default in _QWIX_ONLY.items():
            value = getattr(self, name)
            if value not in (default if isinstance(default, tuple) else (default,)):
                raise ValueError(f"RecipeRule(module_path={self.module_path!r}) sets {name}={value!r}, a setting of "
                                 f"Qwix's own quantizers that this provider would ignore; the recipe decides "
                                 f"(leave {name} unset)")


def _dims_of_weight(dn: Any, weight: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    (lc, rc), (lb, rb) = dn
    return (tuple(lc), tuple(lb)) if weight == 0 else (tuple(rc), tuple(rb))


class RecipeProvider(qwix.QuantizationProvider):
    """Qwix provider that runs intercepted ``dot_general`` / ``einsum`` ops through a :class:`RecipeRule`'s recipe.

    Args:
      rules: :class:`RecipeRule` s, in order of precedence (the first match decides).
      carry: Linen only: "mutable" (state in ``amax_state``: ``apply(..., mutable=["amax_state"])``) or
        "gradient" (state in ``_overwrite_with_gradient``, :mod:`jaxlowfp.owg`). NNX state is always variables.
      observe_only: the initial phase of every op (True: the high-precision warmup; switch it with
        ``jaxlowfp.qnnx.set_observe_only`` / ``jaxlowfp.qlinen.set_observe_only``).
      rngs: NNX only: an ``nnx.Rngs`` whose 'quant' stream (or default) seeds stochastic-rounding recipes (each
        op forks it). Linen draws from the ``quant`` rng stream (``apply(..., rngs={"quant": key})``).
      disable_jit: passed to Qwix.
    """

    def __init__(self, rules: Sequence[RecipeRule], *, carry: str = "mutable", observe_only: bool = False,
                 rngs: nnx.Rngs | None = None, disable_jit: bool = False):
        one_of(carry, CARRIES, "carry")
        if not isinstance(observe_only, bool):
            raise TypeError(f"observe_only must be a Python bool (the initial phase); got {observe_only!r}")
        if rngs is not None and not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs or None; got {type(rngs).__name__}")
        if isinstance(rules, RecipeRule) or not isinstance(rules, Sequence):
            raise TypeError(f"rules must be a sequence of RecipeRule; got {type(rules).__name__}")
        self.carry = carry
        self.observe_only = observe_only
        self.rngs = rngs
        self._executed: set[tuple[str, str, str]] = set()
        self._direct_reads: set[tuple[str, str, str]] = set()
        super().__init__(rules, disable_jit=disable_jit)

    def _init_rule(self, rule: qwix.QuantizationRule) -> RecipeRule:
        # Qwix's base fills in act_static_scale / act_calibration_method for its own quantizers; ours has none.
        if not isinstance(rule, RecipeRule):
            raise TypeError(f"RecipeProvider takes jaxlowfp.qwix_provider.RecipeRule rules; got "
                            f"{type(rule).__name__}: {rule!r}")
        return rule

    def get_intercept_map(self) -> dict[str, Callable[..., Any]]:
        out = super().get_intercept_map() | {"jax.lax.dot_general": self.dot_general,
                                             "jax.numpy.einsum": self.einsum,
                                             "jax.lax.ragged_dot": self.ragged_dot}
        # `x @ w` calls jax._src.numpy.tensor_contractions.matmul by module attribute: patch that name too (with
        # disable_jit, Qwix patches the jitted function's code instead, which covers every alias at once)
        where = ("jax.numpy",) if self.disable_jit else ("jax.numpy", "jax._src.numpy.tensor_contractions")
        for name in _MATMULS:
            for mod in where:
                out[f"{mod}.{name}"] = functools.partial(self._matmul, name)
        for name in _REFUSED:
            for mod in where:
                out[f"{mod}.{name}"] = functools.partial(self._refused, name)
        return out

    def executed(self) -> tuple[tuple[str, str, str], ...]:
        """``(module path, op id, recipe name)`` of every op traced quantized so far (recorded when the op is traced,
        so after the model's first call, e.g. ``qwix.quantize_model``'s), sorted. An op under a ``recipe=None``
        rule or under no rule is not listed."""
        return tuple(sorted(self._executed))

    def direct_reads(self) -> tuple[tuple[str, str, str], ...]:
        """``(module path, op id, submodule path)`` of every contraction traced in high precision although it reads
        the parameter of a submodule that a quantizing rule matches (``x @ self.qkv.kernel[...]`` under a rule for
        ``qkv``: the rule matches ops by the module that runs them, here the parent): add a rule for the module
        path, or call the submodule. Sorted; each was warned about when traced."""
        return tuple(sorted(self._direct_reads))

    def _flag_direct_read(self, op_name: str, op_id: str | None, operands: Sequence[Any]) -> None:
        """A RuntimeWarning (once per op) if this unmatched contraction reads the parameter of a submodule that a
        quantizing rule would match (NNX only: a Linen parent cannot read a child's parameter this way)."""
        module = flax_util.get_current_module()
        if not isinstance(module, nnx.Module) or not any(r.recipe is not None for r in self._rules):
            return
        here = "/".join(map(str, flax_util.get_current_module_path()))
        for x in operands:
            param = _submodule_param(module, x)
            if param is None:
                continue
            child = "/".join(p for p in (here, param.rsplit("/", 1)[0]) if p)
            rule = next((r for r in self._rules if re.fullmatch(r.module_path, child)
                         and (not r.op_names or op_name in r.op_names)), None)
            key = (here, str(op_id), child)
            if rule is None or rule.recipe is None or key in self._direct_reads:
                continue
            self._direct_reads.add(key)
            warnings.warn(f"{here or '<root>'}:{op_id} reads {child}'s parameter {param!r} directly; the rule "
                          f"module_path={rule.module_path!r} ({rule.recipe.name}) matches {child}, but Qwix matches "
                          f"an op by the module that runs it ({here or 'the root module'}), which no rule matches: "
                          f"this contraction runs in HIGH PRECISION. Add a rule whose module_path matches {here!r} "
                          f"(or call {child} instead of reading its kernel)", RuntimeWarning, stacklevel=3)

    def dot_general(self, lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
                    preferred_element_type: Any = None, *, out_sharding: Any = None) -> jax.Array:
        """The intercepted ``jax.lax.dot_general``."""
        rule, op_id = self._get_current_rule_and_op_id("dot_general")
        if rule is None:
            self._flag_direct_read("dot_general", op_id, (lhs, rhs))
        if rule is None or rule.recipe is None:
            return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                       preferred_element_type=preferred_element_type, out_sharding=out_sharding)
        self._refuse_nested_jit(op_id)
        self._refuse_sharding(out_sharding, op_id)
        return self._quantized(rule, op_id, lhs, rhs, dimension_numbers, precision, preferred_element_type)

    def einsum(self, subscripts: str, *operands: Any, precision: Any = None, preferred_element_type: Any = None,
               _dot_general: Callable[..., jax.Array] = jax.lax.dot_general, out_sharding: Any = None,
               **kwargs: Any) -> jax.Array:
        """The intercepted ``jax.numpy.einsum`` (two operands, one of them a parameter, under a quantizing rule)."""
        rule, op_id = self._get_current_rule_and_op_id("einsum")
        if rule is None:
            self._flag_direct_read("einsum", op_id, operands)
        if rule is None or rule.recipe is None:
            return jnp.einsum(subscripts, *operands, precision=precision, preferred_element_type=preferred_element_type,
                              _dot_general=_dot_general, out_sharding=out_sharding, **kwargs)
        if kwargs:
            raise TypeError(f"{self._where(op_id)}: einsum arguments {sorted(kwargs)} are not supported by the "
                            f"quantized einsum")
        if len(operands) != 2:
            raise ValueError(f"{self._where(op_id)}: a quantized einsum takes two operands; {subscripts!r} has "
                             f"{len(operands)} (exclude this module or op with a RecipeRule(recipe=None))")
        self._refuse_nested_jit(op_id)
        self._refuse_sharding(out_sharding, op_id)
        lhs, rhs = operands
        e = parse_einsum(subscripts, lhs, rhs)
        y = self._quantized(rule, op_id, lhs, rhs, e.dimension_numbers, precision, preferred_element_type)
        return y if e.out_perm == tuple(range(y.ndim)) else jnp.transpose(y, e.out_perm)

    def ragged_dot(self, lhs: Any, rhs: Any, group_sizes: Any, precision: Any = None,
                   preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
        """The intercepted ``jax.lax.ragged_dot`` (the grouped GEMM of mixture-of-experts layers, MaxText's): under a
        quantizing rule, `jaxlowfp.ops.ragged_dot` with the expert weight ``rhs`` [G, K, N] (a parameter of the
        calling module) and its per-expert state in a `jaxlowfp.qnnx.QuantRaggedOp` child (NNX only)."""
        rule, op_id = self._get_current_rule_and_op_id("ragged_dot")
        if rule is None or rule.recipe is None:
            return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                                      preferred_element_type=preferred_element_type, **kwargs)
        if kwargs:
            raise TypeError(f"{self._where(op_id)}: ragged_dot arguments {sorted(kwargs)} are not supported by the "
                            f"quantized grouped GEMM")
        self._refuse_nested_jit(op_id)
        module = flax_util.get_current_module()
        if isinstance(module, nn.Module) or self.carry != "mutable":
            raise NotImplementedError(f"{self._where(op_id)}: the quantized ragged_dot keeps per-expert state in an "
                                      f"NNX QuantRaggedOp; Linen modules (and carry={self.carry!r}) are not "
                                      f"supported: exclude this op (RecipeRule(op_names=('dot_general', 'einsum')))")
        if flax_util.find_param(rhs) is None:
            raise ValueError(f"{self._where(op_id)}: a quantizing rule matched a ragged_dot whose rhs (shape "
                             f"{tuple(jnp.shape(rhs))}) is not a parameter of this module; the provider quantizes "
                             f"the grouped GEMM of routed activations with an expert weight [G, K, N]")
        self._executed.add(("/".join(map(str, flax_util.get_current_module_path())), op_id, rule.recipe.name))
        name = NNX_PREFIX + op_id
        op = getattr(module, name, None)
        if op is None:
            g, k, n = (int(d) for d in jnp.shape(rhs))
            path = "/".join(map(str, flax_util.get_current_module_path()))
            op = QuantRaggedOp(rule.recipe, n_experts=g, k=k, m=n, dtype=jnp.result_type(lhs),
                               observe_only=self.observe_only, path=f"{path}/{name}" if path else name,
                               rngs=self.rngs)
            setattr(module, name, op)
        elif not isinstance(op, QuantRaggedOp) or op.recipe != rule.recipe:
            raise ValueError(f"{self._where(op_id)}: the module's {name!r} holds {getattr(op, 'recipe', op)!r}, "
                             f"not this rule's recipe {rule.recipe.name!r}")
        return op.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                             preferred_element_type=preferred_element_type)

    def _matmul(self, fn: str, a: Any, b: Any, *, precision: Any = None, preferred_element_type: Any = None,
                out_sharding: Any = None) -> jax.Array:
        """The intercepted ``jnp.matmul`` / ``jnp.dot`` (and ``a @ b``): a ``dot_general`` op contracting ``a``'s last
        axis with ``b``'s first (``b`` 1-D or 2-D; jnp.dot: ``b``'s second-to-last), as JAX's own functions do."""
        original = getattr(jnp, fn)  # the interceptor is off inside its own handler: this is JAX's function
        kw = dict(precision=precision, preferred_element_type=preferred_element_type, out_sharding=out_sharding)
        if min(jnp.ndim(a), jnp.ndim(b)) < 1:  # a product with a scalar: no contraction, nothing to quantize
            return original(a, b, **kw)
        rule, op_id = self._get_current_rule_and_op_id("dot_general")
        if rule is None:
            self._flag_direct_read("dot_general", op_id, (a, b))
        if rule is None or rule.recipe is None:
            return original(a, b, **kw)
        self._refuse_nested_jit(op_id)
        self._refuse_sharding(out_sharding, op_id)
        nb = jnp.ndim(b)
        if fn == "matmul" and nb > 2 and jnp.ndim(a) > 1:
            raise ValueError(f"{self._where(op_id)}: jnp.matmul of shapes {tuple(jnp.shape(a))} and "
                             f"{tuple(jnp.shape(b))} broadcasts batch axes, which the quantized matmul does not; "
                             f"write it as jnp.einsum, or exclude this op with a RecipeRule(recipe=None)")
        dn = (((jnp.ndim(a) - 1,), (max(nb - 2, 0),)), ((), ()))
        return self._quantized(rule, op_id, a, b, dn, precision, preferred_element_type)

    def _refused(self, fn: str, *args: Any, **kwargs: Any) -> jax.Array:
        """The intercepted jitted jnp contractions the provider does not quantize: JAX's own function, or an error
        under a quantizing rule (never a silently high-precision op)."""
        rule, op_id = self._get_current_rule_and_op_id("dot_general")
        if rule is not None and rule.recipe is not None:
            raise ValueError(f"{self._where(op_id)}: jnp.{fn} under a quantizing rule ({rule.recipe.name}): the "
                             f"provider quantizes jnp.einsum, jax.lax.dot_general, jnp.matmul / @ and jnp.dot; "
                             f"write this contraction with one of them, or exclude it with a "
                             f"RecipeRule(recipe=None) before this rule")
        return getattr(jnp, fn)(*args, **kwargs)

    # -- internals --------------------------------------------------------------------------------------------

    def _refuse_nested_jit(self, op_id: str) -> None:
        """An error if the op runs inside a function that jax.jit traces between the calling module and here (a
        cached trace: its quantization would be replayed for other modules and calls, and its state could not be
        created at the module's trace level)."""
        frame, inner = inspect.currentframe(), None
        while frame is not None and not isinstance(frame.f_locals.get("self"), (nn.Module, nnx.Module)):
            if frame.f_code.co_filename.endswith(_PJIT_FILE):
                name = f"{inner.f_globals.get('__name__', '?')}.{inner.f_code.co_name}" if inner else "?"
                raise ValueError(
                    f"{self._where(op_id)}: this contraction runs inside {name}, a function jax.jit traces once "
                    f"and caches: its quantization would be replayed for every other call of that function, so the "
                    f"provider cannot quantize it. Write the contraction in the module (jnp.einsum, "
                    f"jax.lax.dot_general, jnp.matmul / @), or exclude it with a RecipeRule(recipe=None)")
            if not any(part in frame.f_code.co_filename for part in _TRACING_FILES):
                inner = frame
            frame = frame.f_back

    def _where(self, op_id: str | None) -> str:
        path = "/".join(map(str, flax_util.get_current_module_path()))
        return f"{path}:{op_id}" if op_id else path

    def _refuse_sharding(self, out_sharding: Any, op_id: str) -> None:
        if out_sharding is not None:
            raise NotImplementedError(f"{self._where(op_id)}: out_sharding is not supported by the quantized matmul")

    def _weight_operand(self, lhs: Any, rhs: Any, op_id: str) -> int:
        """0 or 1: which operand is a parameter of the calling module (Qwix's own test, ``find_param``), else (NNX)
        the one that is a parameter of one of its submodules, read directly (``x @ self.qkv.kernel[...]``)."""
        found = [flax_util.find_param(x) for x in (lhs, rhs)]
        module = flax_util.get_current_module()
        if found[0] is None and found[1] is None and isinstance(module, nnx.Module):
            found = [_submodule_param(module, x) for x in (lhs, rhs)]
        if found[0] is None and found[1] is None:
            raise ValueError(
                f"{self._where(op_id)}: a quantizing rule matched a contraction of two activations (shapes "
                f"{tuple(lhs.shape)} and {tuple(rhs.shape)}; neither is a parameter of this module or of its "
                f"submodules). A recipe "
                f"quantizes a weight and an activation: narrow module_path / op_names, or put a "
                f"RecipeRule(recipe=None) for this module first")
        if found[0] is not None and found[1] is not None:
            raise ValueError(f"{self._where(op_id)}: both operands are parameters ({found[0]!r}, {found[1]!r}); "
                             f"which one is the weight is ambiguous: exclude this op")
        return 0 if found[0] is not None else 1

    def _quantized(self, rule: RecipeRule, op_id: str, lhs: Any, rhs: Any, dn: Any, precision: Any,
                   preferred_element_type: Any) -> jax.Array:
        recipe = rule.recipe
        assert recipe is not None  # called for the rules with a recipe only
        weight = self._weight_operand(lhs, rhs, op_id)
        module = flax_util.get_current_module()
        self._executed.add(("/".join(map(str, flax_util.get_current_module_path())), op_id, recipe.name))
        if isinstance(module, nn.Module):
            return contract_in(module, (op_id, op_id, op_id), recipe, lhs, rhs, dn, weight=weight,
                               observe_only=self.observe_only, carry=self.carry, precision=precision,
                               preferred_element_type=preferred_element_type)
        if self.carry != "mutable":
            raise NotImplementedError(f"{self._where(op_id)}: carry={self.carry!r} is for Linen models; an NNX "
                                      f"model's scale state is its QuantOp variables (carry='mutable')")
        name = NNX_PREFIX + op_id
        op = getattr(module, name, None)
        if op is None:
            w = rhs if weight == 1 else lhs
            w_contract, w_batch = (tuple(d % w.ndim for d in ax) for ax in _dims_of_weight(_normalize(dn), weight))
            k, m = contraction_sizes(w.shape, w_contract, w_batch)
            path = "/".join(map(str, flax_util.get_current_module_path()))
            op = QuantOp(recipe, k=k, m=m, dtype=jnp.result_type(lhs), observe_only=self.observe_only,
                         path=f"{path}/{name}" if path else name, rngs=self.rngs)
            setattr(module, name, op)
        elif not isinstance(op, QuantOp) or op.recipe != recipe:
            raise ValueError(f"{self._where(op_id)}: the module's {name!r} holds "
                             f"{getattr(op, 'recipe', op)!r}, not this rule's recipe {recipe.name!r} (quantized "
                             f"before by another provider or rule?)")
        return op.contract(lhs, rhs, dn, weight=weight, precision=precision,
                           preferred_element_type=preferred_element_type)


def _submodule_param(module: nnx.Module, x: Any) -> str | None:
    """The path of the `nnx.Param` of ``module``'s submodules whose value ``x`` is (the same array or tracer, or
    one unary op of it such as ``astype``, as Qwix's ``find_param`` follows it); None if there is none. No shape
    heuristics here: an activation of a parameter's shape is not a parameter."""
    by_id = {id(node.get_raw_value()): "/".join(map(str, path)) for path, node in nnx.iter_graph(module)
             if isinstance(node, nnx.Param) and len(path) > 1}
    while x is not None:
        if id(x) in by_id:
            return by_id[id(x)]
        parent = getattr(x, "parent", None) if isinstance(x, jax.core.Tracer) else None
        x = parent.in_tracers[0] if parent is not None and len(parent.in_tracers) == 1 else None
    return None


def _normalize(dn: Any) -> Any:
    (lc, rc), (lb, rb) = dn
    return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
