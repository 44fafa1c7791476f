"""Flax Linen adapter: a quantized `dot_general` for `flax.linen.Dense` / `DenseGeneral(dot_general_cls=...)`, and
`QuantEinsum`, a `flax.linen.Einsum` whose einsum is quantized (Linen's Einsum has no hook: it calls `jnp.einsum`).

    dense = nn.Dense(256, dot_general_cls=quant_dot_general_cls(qat.hif8_w8a8()))
    variables = dense.init(key, x)             # {"params", "amax_state", "quant_phase", "quant_stats"}
    y, upd = dense.apply(variables, x, mutable=["amax_state"])    # histories recorded: merge `upd` back
    variables = set_observe_only(variables, flag)                  # warmup switch; a traced flag is fine
    variables = {**variables, **upd}
    execution.check_executed(variables)        # after an apply: names each quantized op that never ran

Collections: `AMAX_COLLECTION` holds each layer's `RecipeState` (the functional scale state, not trained),
`PHASE_COLLECTION` the observe-only flag (bool scalar), `STATS_COLLECTION` the last `RecipeStats`, written only
when that collection is mutable. Nothing is recorded while initializing, so `init`'s dummy input leaves no trace
in the histories. Each op's execution record (`jaxlowfp.execution`: int32, 0 until an `apply` ran the op, then
its GEMM backend's code) is a variable of the op's own state collection, ``<state name>_executed`` next to its
`RecipeState` in `AMAX_COLLECTION` (written when the histories are), or, with ``carry="gradient"``, in
`EXECUTED_COLLECTION` (written when that collection is mutable: an int32 cannot ride a gradient).
Same recipes and numerics as `jaxlowfp.qnnx.QuantLinear` (both call `jaxlowfp.qat`); any
`DenseGeneral` layout runs through `jaxlowfp.ops` (NVFP4 blocks along the flattened contraction axes).

`carry="gradient"` keeps each layer's state in the `_overwrite_with_gradient` collection instead (`jaxlowfp.owg`):
float32 leaves whose gradient is their new value, for train loops written for Flax's fp8 ops (MaxText, Flax's
`TrainState`); the observe-only flag rides in it too, and `set_observe_only` switches it there.

Delayed gradient scaling (`qat.fp8_delayed()`): the backward pass reports each layer's output-gradient amax as the
gradient w.r.t. the `PendingAmax` slots of `AMAX_COLLECTION`; differentiate w.r.t. them as well and keep that
gradient (Flax's fp8 ops do the same with their `_overwrite_with_gradient` collection, implicitly)::

    amax = variables["amax_state"]
    def loss(params, pend):
        v = {**variables, "params": params, "amax_state": scaling.with_pending_amaxes(amax, pend)}
        y, upd = dense.apply(v, x, mutable=["amax_state"])
        return loss_of(y), upd["amax_state"]
    (l, new_amax), (g_params, reported) = jax.value_and_grad(loss, (0, 1), has_aux=True)(
        variables["params"], scaling.pending_amaxes(amax))
    variables["amax_state"] = scaling.with_pending_amaxes(new_amax, reported)
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import functools
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxlowfp import owg, qat
from jaxlowfp._core.checks import bool_flag, one_of
from jaxlowfp.ops import contract, parse_einsum
from jaxlowfp.qat.telemetry import flatten_floats, named_leaves

__all__ = [
    "AMAX_COLLECTION",
    "PHASE_COLLECTION",
    "STATS_COLLECTION",
    "EXECUTED_COLLECTION",
    "RNG_STREAM",
    "CARRIES",
    "QuantDotGeneral",
    "QuantEinsum",
    "quant_dot_general_cls",
    "contract_in",
    "set_observe_only",
    "collect_stats",
]

AMAX_COLLECTION = "amax_state"
PHASE_COLLECTION = "quant_phase"
STATS_COLLECTION = "quant_stats"
EXECUTED_COLLECTION = "quant_executed"  # the execution records of carry="gradient" ops
RNG_STREAM = "quant"  # only stochastic-rounding recipes draw from it: apply(..., rngs={"quant": key})
CARRIES = ("mutable", "gradient")  # where the scale state lives: AMAX_COLLECTION (mutable) or owg.COLLECTION


def _check_recipe(recipe: Any) -> None:
    if not isinstance(recipe, qat.Recipe):
        raise TypeError(f"recipe must be a jaxlowfp.qat.Recipe; got {type(recipe).__name__}: {recipe!r}")


def record_name(name: str) -> str:
    """The name of the execution-record variable of the Linen op whose state is variable `name`."""
    return f"{name}_executed"


class _Slot:
    """Receives the record `jaxlowfp.ops` writes (its ``set_value``), for a Linen variable."""

    value: Any = None

    def set_value(self, value: Any) -> None:
        self.value = value


def contract_in(
    module: nn.Module,
    names: tuple[str, str, str],
    recipe: qat.Recipe,
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    *,
    weight: int = 1,
    observe_only: bool = False,
    carry: str = "mutable",
    precision: Any = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """`jaxlowfp.ops.dot_general` with its state in the variables of the bound Linen `module`.

    `names` = (state, phase, stats) variable names: the RecipeState in `AMAX_COLLECTION` (recorded only when that
    collection is mutable and not while initializing), the flag in `PHASE_COLLECTION`, the stats written to
    `STATS_COLLECTION` when it is mutable. With ``carry="gradient"`` the state and the flag are one
    `jaxlowfp.owg.Carried` in `owg.COLLECTION` under ``names[0]``, whose gradient is its new value.
    """
    _check_recipe(recipe)
    one_of(carry, CARRIES, "carry")
    scope = module.scope
    if scope is None:
        raise ValueError(f"{type(module).__name__}: a quantized Linen layer runs inside init / apply (it has no "
                         f"scope when called unbound)")
    key = module.make_rng(RNG_STREAM) if recipe.needs_key else None
    if carry == "gradient":
        carried_var = scope.variable(owg.COLLECTION, names[0], lambda: owg.init_carried(recipe, observe_only))
        carried = carried_var.value
        state, observe = owg.from_carried(carried)
    else:
        var = scope.variable(AMAX_COLLECTION, names[0], recipe.init)
        phase = scope.variable(PHASE_COLLECTION, names[1], lambda: jnp.asarray(bool(observe_only)))
        state, observe = var.value, phase.value
    where = "/".join(map(str, module.path))
    slot = _Slot()
    out, new_state, stats = contract(
        lhs, rhs, dimension_numbers, recipe=recipe, state=state, weight=weight, observe_only=observe, key=key,
        precision=precision, preferred_element_type=preferred_element_type, where=where, record=slot)
    rec_collection = AMAX_COLLECTION if carry == "mutable" else EXECUTED_COLLECTION
    if module.is_mutable_collection(rec_collection):  # `init` creates the record at 0: only `apply` counts
        rec = scope.variable(rec_collection, record_name(names[0]), lambda: np.zeros((), np.int32))
        if not module.is_initializing():
            rec.value = slot.value
    if carry == "gradient":
        out = owg.overwrite(out, carried, owg.to_carried(new_state, observe))
    elif not module.is_initializing() and module.is_mutable_collection(AMAX_COLLECTION):
        var.value = new_state
    if module.is_mutable_collection(STATS_COLLECTION):
        scope.put_variable(STATS_COLLECTION, names[2], stats)
    return out


class QuantDotGeneral(nn.Module):
    """`lax.dot_general` with lhs (activation) and rhs (weight) fake-quantized by `recipe` via `jaxlowfp.ops`.

    ``out = dot_general(Q_a(lhs), Q_w(rhs))``, straight-through gradients; ``out`` is bitwise the plain
    `lax.dot_general` while the observe-only flag is set. Any `DenseGeneral` layout (several contracted axes):
    block-scaled recipes block along the flattened contraction; batch axes take the per-tensor 8-bit recipes.
    """

    recipe: qat.Recipe
    observe_only: bool = False  # initial value of the flag variable
    carry: str = "mutable"  # "gradient": the state rides the gradient in owg.COLLECTION

    def __call__(
        self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None,
        preferred_element_type: Any = None, out_sharding: Any = None,
    ) -> jax.Array:
        if out_sharding is not None:
            raise NotImplementedError(f"{'/'.join(map(str, self.path))}: out_sharding is not supported by the "
                                      f"quantized matmul; shard the inputs and parameters instead")
        return contract_in(self, ("recipe_state", "observe_only", "stats"), self.recipe, lhs, rhs,
                           dimension_numbers, observe_only=self.observe_only, carry=self.carry,
                           precision=precision, preferred_element_type=preferred_element_type)


def quant_dot_general_cls(recipe: qat.Recipe, *, observe_only: bool = False, carry: str = "mutable") -> Any:
    """The `dot_general_cls` argument for `nn.Dense` / `nn.DenseGeneral`: `QuantDotGeneral` bound to `recipe`."""
    _check_recipe(recipe)
    if not isinstance(observe_only, bool):
        raise TypeError(f"observe_only must be a Python bool (the flag's initial value); got {observe_only!r}. "
                        f"Switch a traced flag with set_observe_only(variables, flag).")
    one_of(carry, CARRIES, "carry")
    return functools.partial(QuantDotGeneral, recipe=recipe, observe_only=observe_only, carry=carry)


class QuantEinsum(nn.Einsum):
    """`flax.linen.Einsum` with input and kernel fake-quantized by `recipe`: same params (``kernel``, ``bias``),
    shapes and initializers; the einsum runs as the GEMM of `jaxlowfp.ops` (K = the contracted axes,
    flattened; NVFP4 blocks along it). Linen's Einsum calls `jnp.einsum` directly (no injectable hook), hence a
    subclass. State variables are named as `QuantDotGeneral`'s."""

    recipe: qat.Recipe | None = None
    observe_only: bool = False
    carry: str = "mutable"

    @nn.compact
    def __call__(self, inputs: jax.Array, einsum_str: str | None = None) -> jax.Array:
        if self.recipe is None:
            raise TypeError("QuantEinsum needs recipe=jaxlowfp.qat.Recipe(...); use flax.linen.Einsum for high "
                            "precision")
        einsum_str = nn.module.merge_param("einsum_str", self.einsum_str, einsum_str).replace(" ", "")
        if "->" not in einsum_str or einsum_str.count(",") != 1:
            raise ValueError(f"einsum_str must be explicit (with '->') and have exactly two operands; got "
                             f"{einsum_str!r}")
        kernel = self.param("kernel", self.kernel_init, self.shape, self.param_dtype)
        bias = None
        if self.use_bias:
            bias_shape, broadcasted_bias_shape = self._get_bias_shape(einsum_str, inputs, kernel)
            bias = self.param("bias", self.bias_init, bias_shape, self.param_dtype)
        promoted_in, promoted_kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        assert promoted_in is not None and promoted_kernel is not None  # Linen's promote_dtype keeps non-None as such
        inputs, kernel = promoted_in, promoted_kernel
        e = parse_einsum(einsum_str, inputs, kernel)
        y = contract_in(self, ("recipe_state", "observe_only", "stats"), self.recipe, inputs, kernel,
                        e.dimension_numbers, observe_only=self.observe_only, carry=self.carry,
                        precision=self.precision, preferred_element_type=self.preferred_element_type)
        if e.out_perm != tuple(range(y.ndim)):
            y = jnp.transpose(y, e.out_perm)
        if bias is not None:
            y += jnp.reshape(bias, broadcasted_bias_shape)
        return y


def set_observe_only(variables: Mapping[str, Any], flag: bool | jax.Array) -> dict[str, Any]:
    """A copy of `variables` with every observe-only flag set to `flag` (Python bool or bool scalar, traced ok).

    Layers with ``carry="gradient"`` hold their flag in the `jaxlowfp.owg.Carried` of `owg.COLLECTION` (as 1.0 /
    0.0); it is switched there. Raises ValueError when `variables` has neither collection: the switch would
    silently do nothing.
    """
    value = jnp.asarray(bool_flag(flag))
    carried = [c for c in jax.tree.leaves(variables.get(owg.COLLECTION, {}), is_leaf=owg.is_carried)
               if isinstance(c, owg.Carried)]
    if PHASE_COLLECTION not in variables and not carried:
        raise ValueError(
            f"variables has no {PHASE_COLLECTION!r} collection and no jaxlowfp state in {owg.COLLECTION!r} (got "
            f"{sorted(variables)}): no quantized layer was initialized, or the collection was dropped before apply"
        )
    out = dict(variables)
    if PHASE_COLLECTION in variables:
        out[PHASE_COLLECTION] = jax.tree.map(lambda _: value, variables[PHASE_COLLECTION])
    if carried:
        out[owg.COLLECTION] = jax.tree.map(
            lambda c: c._replace(observe_only=value.astype(jnp.float32)) if isinstance(c, owg.Carried) else c,
            variables[owg.COLLECTION], is_leaf=owg.is_carried)
    return out


def collect_stats(variables: Mapping[str, Any]) -> dict[str, float]:
    """The `STATS_COLLECTION` of `variables` (or of `apply`'s mutated output) as a flat
    `{module/path/weight|activation/field: float}` dict, e.g. `Dense_0/QuantDotGeneral_0/activation/amax`."""
    def drop_slot(names: tuple[str, ...]) -> tuple[str, ...]:  # the sow slot name is "stats" in every module
        i = names.index("stats") if "stats" in names else len(names)
        return names[:i] + names[i + 1:]

    pairs = named_leaves(variables.get(STATS_COLLECTION, {}))
    return flatten_floats((drop_slot(names), leaf) for names, leaf in pairs)


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
