"""Scale state that rides the gradient: the ``_overwrite_with_gradient`` convention of Flax's fp8 ops and MaxText,
with microbatch accumulation that merges by maximum.

Flax's ``flax.linen.fp8_ops`` keeps its amax histories in the variable collection ``_overwrite_with_gradient``
(OWG) and defines the *gradient* of each such variable as its new value; ``flax.training.train_state.TrainState
.apply_gradients`` then replaces those variables by their gradients instead of running the optimizer on them, and
MaxText's train step carries only that collection besides the parameters. A loop written for that convention
needs no change to carry jaxlowfp's scale state, if the state

- is float32 only (``jax.grad`` refuses integer inputs): :class:`Carried` holds a layer's ``RecipeState`` with its
  integer counters as float32 (exact up to 2**24 recorded steps) and the observe-only flag as 0.0 / 1.0;
- reaches the gradient: :func:`overwrite` ties it to the layer's output, so that ``d loss / d carried`` is the
  carried state after this step (and the amax a backward pass reports for delayed gradient scaling, which arrives
  through the ``PendingAmax`` slots as it does in :mod:`jaxlowfp.training`).

Gradient accumulation is where such loops go wrong: MaxText sums every gradient leaf over the microbatches and
divides by the token count, which averages the histories (clipping the next steps' activations, silently; Flax's
fp8 ops had the same bug with summed microbatches). :func:`accumulate` / :func:`finalize` / :func:`zeros_like` are
the drop-in replacements for those three tree maps: parameters are summed and divided as before, every
:class:`Carried` merges by maximum (:func:`jaxlowfp.scaling.merge`), so k microbatches leave the state one large
batch would (from a warm history; see :mod:`jaxlowfp.training`).

    grads = jax.grad(loss)(variables)                        # variables: {"params": ..., COLLECTION: ...}
    acc = owg.accumulate(acc, grads)                         # per microbatch, instead of tree_map(add)
    grads = owg.finalize(acc, total_weight)                  # instead of tree_map(lambda g: g / total_weight)
    state = state.apply_gradients(grads=grads)               # Flax's TrainState: OWG leaves replaced, exactly

The layers that carry their state this way: ``jaxlowfp.qlinen.quant_dot_general_cls(recipe, carry="gradient")``,
``jaxlowfp.qlinen.QuantEinsum(carry="gradient")`` and ``jaxlowfp.qwix_provider.RecipeProvider(..., carry="gradient")``
on Linen models. See ``docs/qwix_maxtext.md`` for MaxText.
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from jaxlowfp import scaling
from jaxlowfp._core.deprecation import deprecated_getattr
from jaxlowfp.qat.spec import Recipe, RecipeState
from jaxlowfp.scaling import AmaxHistory, PyTree

__all__ = ["COLLECTION", "Carried", "is_carried", "init_carried", "to_carried", "from_carried", "overwrite",
           "accumulate", "finalize", "zeros_like", "apply_gradients"]

COLLECTION = "_overwrite_with_gradient"  # flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT
_INT_FIELDS = ("count", "nonfinite", "version")  # the int32 fields of an AmaxHistory


class Carried(NamedTuple):
    """One quantized contraction's scale state in float32, for a collection whose gradient is its new value.

    Attributes:
      state: the ``RecipeState``, every leaf float32 (``AmaxHistory.count`` / ``nonfinite`` / ``version`` too).
      observe_only: f32[] 1.0 while observing (the high-precision warmup), 0.0 when quantized.
    """

    state: RecipeState
    observe_only: jax.Array


def _is_history(x: Any) -> bool:
    return isinstance(x, AmaxHistory)


def to_carried(state: RecipeState, observe_only: bool | jax.Array = False) -> Carried:
    """`state` (from ``recipe.init()`` or a quantized op) as a :class:`Carried`: every leaf float32."""
    f32 = jax.tree.map(lambda x: jnp.asarray(x).astype(jnp.float32), state)
    return Carried(state=f32, observe_only=jnp.asarray(observe_only).astype(jnp.float32))


def init_carried(recipe: Recipe, observe_only: bool = False) -> Carried:
    """The initial :class:`Carried` of a layer with `recipe`."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a jaxlowfp.qat.Recipe; got {type(recipe).__name__}: {recipe!r}")
    return to_carried(recipe.init(), observe_only)


def from_carried(carried: Carried) -> tuple[RecipeState, jax.Array]:
    """``(state, observe_only)``: the ``RecipeState`` with its integer counters back as int32, and the flag as a
    bool scalar. Counts are exact while below 2**24 (float32's integer range)."""
    if not isinstance(carried, Carried):
        raise TypeError(f"expected a jaxlowfp.owg.Carried; got {type(carried).__name__}")

    def one(h: Any) -> Any:
        if not isinstance(h, AmaxHistory):
            return h
        return h._replace(**{f: jnp.asarray(getattr(h, f)).astype(jnp.int32) for f in _INT_FIELDS})

    state = jax.tree.map(one, carried.state, is_leaf=_is_history)
    return state, jnp.asarray(carried.observe_only) > 0.5


@jax.custom_vjp
def overwrite(y: jax.Array, carried: Carried, new: Carried) -> jax.Array:
    """`y`, with the gradient w.r.t. `carried` defined as `new` (the state after this call): the OWG convention.

    No gradient reaches `new`; `y`'s cotangent passes unchanged. A layer called twice in one step adds two new
    states into one gradient (as Flax's fp8 ops do): call each carried layer once per step."""
    return y


def _overwrite_fwd(y, carried, new):
    return y, new


def _overwrite_bwd(new, g):
    return g, new, jax.tree.map(jnp.zeros_like, new)


overwrite.defvjp(_overwrite_fwd, _overwrite_bwd)


def is_carried(x: object) -> bool:
    return isinstance(x, Carried)


def _merge(a: Carried, b: Carried) -> Carried:
    merged = scaling.merge([from_carried(a)[0], from_carried(b)[0]])
    return to_carried(merged, jnp.maximum(jnp.asarray(a.observe_only), jnp.asarray(b.observe_only)))


def accumulate(acc: PyTree, grads: PyTree) -> PyTree:
    """``acc + grads`` leaf by leaf (MaxText's accumulation), except that every :class:`Carried` merges by max
    (:func:`jaxlowfp.scaling.merge`: the histories of microbatches that ran from the same state)."""
    return jax.tree.map(lambda a, g: _merge(a, g) if is_carried(g) else a + g, acc, grads, is_leaf=is_carried)


def finalize(acc: PyTree, divisor: ArrayLike) -> PyTree:
    """``acc / divisor`` for every gradient leaf (in its own dtype), the :class:`Carried` leaves unchanged."""
    return jax.tree.map(lambda a: a if is_carried(a) else (a / divisor).astype(a.dtype), acc, is_leaf=is_carried)


def zeros_like(tree: PyTree) -> PyTree:
    """The accumulator's start: zeros everywhere (an all-zero :class:`Carried` recorded nothing, so merging it
    with a microbatch's state gives that state)."""
    return jax.tree.map(jnp.zeros_like, tree)


def apply_gradients(tx: optax.GradientTransformation, params: PyTree, grads: PyTree, opt_state: optax.OptState
                    ) -> tuple[PyTree, optax.OptState]:
    """``(params', opt_state')`` as Flax's ``TrainState.apply_gradients`` computes them for a variables dict with
    a :data:`COLLECTION`: the optimizer updates ``params["params"]``, the OWG collection becomes its gradient
    (exactly, no arithmetic); other collections are kept (Flax's TrainState drops them)."""
    if COLLECTION not in grads:
        raise ValueError(f"grads has no {COLLECTION!r} collection (got {sorted(grads)}); use optax directly")
    updates, opt_state = tx.update(grads["params"], opt_state, params["params"])
    new = dict(params)
    new["params"] = optax.apply_updates(params["params"], updates)
    new[COLLECTION] = grads[COLLECTION]
    return new, opt_state


# old names (one release): `encode` / `decode` meant codes of a format everywhere else (jaxlowfp.hif8)
__getattr__ = deprecated_getattr(__name__, {
    "encode": ("jaxlowfp.owg.to_carried", lambda: to_carried),
    "decode": ("jaxlowfp.owg.from_carried", lambda: from_carried),
    "init": ("jaxlowfp.owg.init_carried", lambda: init_carried),
})


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
