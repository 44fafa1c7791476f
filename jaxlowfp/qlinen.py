"""Flax Linen adapter: a quantized `dot_general` for `flax.linen.Dense(dot_general_cls=...)`.

    dense = nn.Dense(256, dot_general_cls=quant_dot_general_cls(qat.hif8_w8a8()))
    variables = dense.init(key, x)             # {"params", "amax_state", "quant_phase", "quant_stats"}
    y, upd = dense.apply(variables, x, mutable=["amax_state"])    # histories recorded: merge `upd` back
    variables = set_observe_only(variables, flag)                  # warmup switch; a traced flag is fine

Collections: `AMAX_COLLECTION` holds each layer's `RecipeState` (the functional scale state, not trained),
`PHASE_COLLECTION` the observe-only flag (bool scalar), `STATS_COLLECTION` the last `RecipeStats`, written only
when that collection is mutable. Nothing is recorded while initializing, so `init`'s dummy input leaves no trace
in the histories. Same recipes and numerics as `jaxlowfp.qnnx.QuantLinear` (both call `jaxlowfp.qat`).

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

import functools
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxlowfp import qat
from jaxlowfp._core.checks import bool_flag
from jaxlowfp.qat.telemetry import flatten_floats, named_leaves

__all__ = [
    "AMAX_COLLECTION",
    "PHASE_COLLECTION",
    "STATS_COLLECTION",
    "RNG_STREAM",
    "QuantDotGeneral",
    "quant_dot_general_cls",
    "set_observe_only",
    "collect_stats",
]

AMAX_COLLECTION = "amax_state"
PHASE_COLLECTION = "quant_phase"
STATS_COLLECTION = "quant_stats"
RNG_STREAM = "quant"  # only stochastic-rounding recipes draw from it: apply(..., rngs={"quant": key})


class QuantDotGeneral(nn.Module):
    """`lax.dot_general` with lhs (activation) and rhs (weight) fake-quantized by `recipe` via `qat.dot_general`.

    ``out = dot_general(Q_a(lhs), Q_w(rhs))``, straight-through gradients; ``out`` is bitwise the plain
    `lax.dot_general` while the observe-only flag is set.
    """

    recipe: qat.Recipe
    observe_only: bool = False  # initial value of the flag variable

    def setup(self) -> None:
        if not isinstance(self.recipe, qat.Recipe):
            raise TypeError(f"recipe must be a jaxlowfp.qat.Recipe; got {type(self.recipe).__name__}")
        self.state = self.variable(AMAX_COLLECTION, "recipe_state", self.recipe.init)
        self.phase = self.variable(PHASE_COLLECTION, "observe_only", lambda: jnp.asarray(bool(self.observe_only)))

    def __call__(
        self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None,
        preferred_element_type: Any = None,
    ) -> jax.Array:
        key = self.make_rng(RNG_STREAM) if self.recipe.needs_key else None
        out, new_state, stats = qat.dot_general(
            lhs, rhs, dimension_numbers, recipe=self.recipe, state=self.state.value,
            observe_only=self.phase.value, key=key, precision=precision,
            preferred_element_type=preferred_element_type,
        )
        if not self.is_initializing() and self.is_mutable_collection(AMAX_COLLECTION):
            self.state.value = new_state
        self.sow(STATS_COLLECTION, "stats", stats, init_fn=lambda: None, reduce_fn=lambda _, new: new)
        return out


def quant_dot_general_cls(recipe: qat.Recipe, *, observe_only: bool = False) -> Any:
    """The `dot_general_cls` argument for `nn.Dense` / `nn.DenseGeneral`: `QuantDotGeneral` bound to `recipe`."""
    if not isinstance(recipe, qat.Recipe):
        raise TypeError(f"recipe must be a jaxlowfp.qat.Recipe; got {type(recipe).__name__}: {recipe!r}")
    if not isinstance(observe_only, bool):
        raise TypeError(f"observe_only must be a Python bool (the flag's initial value); got {observe_only!r}. "
                        f"Switch a traced flag with set_observe_only(variables, flag).")
    return functools.partial(QuantDotGeneral, recipe=recipe, observe_only=observe_only)


def set_observe_only(variables: Mapping[str, Any], flag: bool | jax.Array) -> dict[str, Any]:
    """A copy of `variables` with every observe-only flag set to `flag` (Python bool or bool scalar, traced ok).

    Raises ValueError when `variables` has no `PHASE_COLLECTION`: the switch would silently do nothing.
    """
    value = jnp.asarray(bool_flag(flag))
    if PHASE_COLLECTION not in variables:
        raise ValueError(
            f"variables has no {PHASE_COLLECTION!r} collection (got {sorted(variables)}): no QuantDotGeneral was "
            f"initialized, or the collection was dropped before apply"
        )
    out = dict(variables)
    out[PHASE_COLLECTION] = jax.tree.map(lambda _: value, variables[PHASE_COLLECTION])
    return out


def collect_stats(variables: Mapping[str, Any]) -> dict[str, float]:
    """The `STATS_COLLECTION` of `variables` (or of `apply`'s mutated output) as a flat
    `{module/path/weight|activation/field: float}` dict, e.g. `Dense_0/QuantDotGeneral_0/activation/amax`."""
    def drop_slot(names: tuple[str, ...]) -> tuple[str, ...]:  # the sow slot name is "stats" in every module
        i = names.index("stats") if "stats" in names else len(names)
        return names[:i] + names[i + 1:]

    pairs = named_leaves(variables.get(STATS_COLLECTION, {}))
    return flatten_floats((drop_slot(names), leaf) for names, leaf in pairs)
