"""A functional QAT train step for Flax NNX models: ``step(state, batch) -> (state, metrics)``, pure and jittable.

The model is split once into a ``graphdef`` and state pytrees (:func:`split`)::

    params   nnx.Param                   differentiated, updated by optax
    qstate   jaxlowfp.qnnx.AmaxState      amax histories of the quantized layers (delayed scaling); its
                                         ``scaling.PendingAmax`` slots (delayed gradient scaling) are differentiated
                                         too, and their gradient, the output-gradient amax, is their new value
    rest     everything else             rng counters of stochastic rounding, the observe-only flags, last stats,
                                         the ops' execution records (`jaxlowfp.execution`)

One step, for ``k = microbatches``::

    observe  = warmup.observe_only(step)            (traced: crossing the warmup boundary does not retrace)
    for each microbatch i (lax.scan):  loss_i, grads_i, qstate_i = value_and_grad(loss_fn)(params, pending; ...)
    grads    = mean_i grads_i;  loss = mean_i loss_i;  qstate' = scaling.merge(qstate_1 .. qstate_k)   (max)
    ok       = loss, grads finite and no non-finite value in a quantized tensor
    params', opt_state' = optax update            (all of params, opt_state, qstate, rest kept as they were if not ok)

Every microbatch quantizes with the same delayed estimate (the histories as they were when the step began), and
the recorded amaxes merge by maximum (Flax's fp8 ops summed them and Levanter kept the last microbatch's; both clip
silently). So once a layer's history holds a recorded amax (after one observe-only warmup step, for instance),
``k`` microbatches quantize and record what one batch ``k`` times larger would, up to float32 rounding of the
activations. The exception is a quantized step on an empty history: the estimate then falls back to the current
amax, which is each microbatch's own, not the large batch's, so that step's scales differ; its merged record is the
max over the microbatches (for a layer fed by the batch itself, exactly the large batch's amax). A skipped step is
the idea of ``optax.apply_if_finite`` carried over to the whole state: nothing non-finite ever reaches the state,
so nothing non-finite can reach a checkpoint. The optimizer runs under standard dtype promotion (optax mixes
Python floats with its int32 count), the model under whatever promotion the caller set.

>>> import jax, jax.numpy as jnp, optax
>>> from flax import nnx
>>> from jaxlowfp import qnnx, qat, training
>>> class Net(nnx.Module):
...     def __init__(self, rngs):
...         self.up_proj = nnx.Linear(16, 16, rngs=rngs)
...     def __call__(self, x):
...         return self.up_proj(x)
>>> model = Net(nnx.Rngs(0))
>>> _ = qnnx.quantize_model(model, [qnnx.Rule(path="up_proj", recipe=qat.hif8_w8a8())])
>>> def loss_fn(m, batch):
...     return jnp.mean((m(batch) - batch) ** 2), {}
>>> graphdef, state = training.init(model, optax.sgd(0.1))
>>> step = jax.jit(training.make_step(graphdef, optax.sgd(0.1), loss_fn, warmup=qat.Warmup(steps=1)))
>>> state, metrics = step(state, jnp.ones((4, 16)))
>>> int(state.step), bool(metrics["observe_only"]), bool(metrics["finite"])
(1, True, True)
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

from collections.abc import Callable
from typing import Any, NamedTuple

import functools
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlowfp.execution import checked_call
from jaxlowfp import scaling
from jaxlowfp._core.checks import integer
from jaxlowfp._core.placement import commit_tree
from jaxlowfp.qnnx import AmaxState, QuantStatsState, set_observe_only
from jaxlowfp.qat import Warmup

__all__ = ["TrainState", "LossFn", "split", "init", "make_step", "quant_metrics"]

LossFn = Callable[[nnx.Module, Any], tuple[jax.Array, Any] | jax.Array]

_LIBRARY_METRICS = ("loss", "observe_only", "skipped", "finite", "lr", "max_saturated_fraction",
                    "mean_saturated_fraction", "nonfinite_quantized", "amax", "amax_estimate", "invalid_token_ids")


def _loss_and_aux(out: Any, loss_fn: Any) -> tuple[jax.Array, Any]:
    """``(loss, aux)`` from what `loss_fn` returned: ``(loss, aux)`` or a bare scalar loss (aux None)."""
    if isinstance(out, tuple | list):
        if len(out) != 2:
            raise TypeError(f"loss_fn {getattr(loss_fn, '__name__', loss_fn)!r} must return a scalar loss or "
                            f"(scalar loss, aux); got a {type(out).__name__} of length {len(out)}")
        loss, aux = out
    else:
        loss, aux = out, None
    shape = getattr(loss, "shape", None)
    if shape is None or tuple(shape) != ():
        raise TypeError(f"loss_fn {getattr(loss_fn, '__name__', loss_fn)!r} must return a scalar loss (shape ()) or "
                        f"(scalar loss, aux); got a loss of "
                        f"{'shape ' + str(tuple(shape)) if shape is not None else 'type ' + type(loss).__name__}: "
                        f"reduce it (e.g. jnp.mean) inside loss_fn")
    return loss, aux


def _aux_metrics(aux: Any) -> dict[str, Any]:
    """The user's aux as metrics: a dict's entries by name, anything else as ``aux`` (None: nothing)."""
    if aux is None:
        return {}
    if not isinstance(aux, dict) or not all(isinstance(k, str) for k in aux):
        return {"aux": aux}
    clash = sorted(set(aux) & set(_LIBRARY_METRICS))
    if clash:
        raise ValueError(f"loss_fn's aux names {clash} clash with make_step's own metrics {list(_LIBRARY_METRICS)}; "
                         f"rename them in loss_fn's aux dict")
    return dict(aux)


def _reduce_microbatches(x: jax.Array) -> jax.Array:
    """One aux leaf over the microbatch axis: the mean of a float (a loss, an accuracy), the sum of a count."""
    x = jnp.asarray(x)
    return jnp.mean(x, axis=0) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.sum(x, axis=0)


class TrainState(NamedTuple):
    """The functional training state (a pytree)."""

    params: nnx.State  # nnx.Param leaves
    qstate: nnx.State  # AmaxState leaves (amax histories)
    rest: nnx.State  # the rest of the model state
    opt_state: optax.OptState
    step: jax.Array  # int32 []: batches consumed, skipped ones included
    skipped: jax.Array  # int32 []: steps skipped (non-finite loss, gradients or quantized values)


def split(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State, nnx.State]:
    """``(graphdef, params, qstate, rest)`` = ``nnx.split(model, nnx.Param, AmaxState, ...)``."""
    return nnx.split(model, nnx.Param, AmaxState, ...)  # type: ignore[return-value]  # three filters: three states


def init(model: nnx.Module, tx: optax.GradientTransformation) -> tuple[nnx.GraphDef, TrainState]:
    """``(graphdef, state)`` at step 0 for `model` (a quantized or plain NNX model) and optimizer `tx`.

    Every array leaf of the state has a buffer of its own (a leaf that shares one with an earlier leaf, as an
    optimizer's or a model's shared constants may, is copied), so ``jax.jit(step, donate_argnums=0)`` works on it.
    The params are the model's own arrays: after donating them, read the trained values from the returned state
    (``nnx.update(model, state.params, state.qstate, state.rest)``). Every leaf is committed where the params are
    (`jaxlowfp._core.placement.commit_tree`), so a jitted step's first call compiles the program every later call
    runs (an uncommitted step counter made the second call compile it again).
    """
    graphdef, params, qstate, rest = split(model)
    with jax.numpy_dtype_promotion("standard"):
        opt_state = tx.init(params)
    state = TrainState(params=params, qstate=qstate, rest=rest, opt_state=opt_state,
                       step=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32))
    return graphdef, commit_tree(_own_buffers(state))


def _buffer_ids(x: jax.Array) -> set:
    try:
        return {(id(s.device), s.data.unsafe_buffer_pointer()) for s in x.addressable_shards}
    except Exception:  # an array type without buffer pointers: its identity is the best we know
        return {id(x)}


def _own_buffers(tree: Any) -> Any:
    """`tree` with every jax.Array leaf that shares a buffer with an earlier leaf replaced by a copy, and every
    NumPy leaf put on the device (a buffer of its own)."""
    seen: set = set()

    def fresh(x: Any) -> Any:
        if isinstance(x, np.ndarray | np.generic):  # host values (the ops' execution records): on the device
            return jnp.array(x)
        if not isinstance(x, jax.Array):
            return x
        ids = _buffer_ids(x)
        if ids & seen:
            x = jnp.array(x, copy=True)
            ids = _buffer_ids(x)
        seen.update(ids)
        return x

    return jax.tree.map(fresh, tree)


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def _stats_vars(rest: nnx.State) -> list[tuple[str, Any]]:
    """(layer path, RecipeStats) of every quantized layer in `rest`."""
    return [("/".join(map(str, path[:-1])), v.get_value()) for path, v in nnx.to_flat_state(rest)
            if isinstance(v, QuantStatsState)]


def quant_metrics(rest: nnx.State, layer: str | None = None) -> dict[str, jax.Array]:
    """Telemetry from the quantized layers' last stats: the max and mean clipped (saturated) fraction of their
    activations, the number of non-finite values in any quantized tensor and, for `layer`, its observed input
    amax and the estimate its scale came from. Empty for a model without quantized layers."""
    sat, nonfinite, out = [], [], {}
    for path, stats in _stats_vars(rest):
        for s in (stats.weight, stats.activation):
            if s is not None:
                nonfinite.append(jnp.asarray(s.nonfinite_count, jnp.int32).reshape(()))
        act = stats.activation
        if act is None:
            continue
        sat.append(jnp.asarray(act.saturated_fraction, jnp.float32).reshape(()))
        if path == layer:
            out["amax"] = jnp.asarray(act.amax, jnp.float32).reshape(())
            out["amax_estimate"] = jnp.asarray(act.amax_estimate, jnp.float32).reshape(())
    if sat:
        out["max_saturated_fraction"] = jnp.max(jnp.stack(sat))
        out["mean_saturated_fraction"] = jnp.mean(jnp.stack(sat))
    if nonfinite:
        out["nonfinite_quantized"] = jnp.sum(jnp.stack(nonfinite))
    return out


TOKEN_KEYS = ("tokens", "input_ids", "inputs")


def _invalid_token_ids(graphdef: nnx.GraphDef, state: TrainState, batch: Any) -> jax.Array | None:
    """The number of token ids outside ``[0, model.config.vocab)`` in the batch's tokens (the batch itself if it is
    an integer array, as `jaxlowfp.models.loss_fn` takes it, else its integer entries named in `TOKEN_KEYS`), or
    None when the model has no ``config.vocab`` or the batch no such tokens. Inside the trace: a count, not an
    error (the step cannot raise on traced values); the step is skipped and ``metrics["invalid_token_ids"]``
    says why."""
    model = nnx.merge(graphdef, state.params, state.qstate, state.rest, copy=True)
    vocab = getattr(getattr(model, "config", None), "vocab", None)
    if not isinstance(vocab, int):
        return None
    if isinstance(batch, dict):
        leaves = [batch[k] for k in TOKEN_KEYS if k in batch]
    else:
        leaves = [batch] if hasattr(batch, "dtype") else []
    leaves = [x for x in leaves if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.integer)]
    if not leaves:
        return None
    counts = [jnp.sum((x < 0) | (x >= vocab)).astype(jnp.int32) for x in leaves]
    return functools.reduce(jnp.add, counts)


def check_tokens(batch: Any, vocab: int, max_len: int | None = None, where: str = "batch") -> None:
    """Host-side check of a concrete token batch before a step (`make_step` can only count and skip): every id in
    ``[0, vocab)`` and rows of at most ``max_len`` tokens; a ValueError saying what was given and what is allowed."""
    t = np.asarray(batch)
    if not np.issubdtype(t.dtype, np.integer):
        raise TypeError(f"{where}: token ids must be integers; got dtype {t.dtype}")
    if t.size and (t.min() < 0 or t.max() >= vocab):
        bad = int(((t < 0) | (t >= vocab)).sum())
        raise ValueError(f"{where}: {bad} token ids outside [0, {vocab}) (the model's vocabulary); got ids from "
                         f"{int(t.min())} to {int(t.max())}")
    if max_len is not None and t.ndim >= 1 and t.shape[-1] > max_len:
        raise ValueError(f"{where}: rows of {t.shape[-1]} tokens; the model takes at most {max_len}")


def make_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    loss_fn: LossFn,
    *,
    warmup: Warmup | None = None,
    microbatches: int = 1,
    lr_schedule: optax.Schedule | None = None,
    telemetry_layer: str | None = None,
    state_shardings: Callable[[TrainState], Any] | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
    """The pure step ``(state, batch) -> (state', metrics)``: wrap it in ``jax.jit``, with ``donate_argnums=0`` to
    update the state in place (a state from :func:`init` has a buffer per leaf).

    Args:
      graphdef: from :func:`init` / :func:`split`.
      tx: the optax transformation (the same one `init` was given).
      loss_fn: ``loss_fn(model, batch) -> (scalar loss, aux)`` or ``-> scalar loss``. `aux` (any pytree of arrays)
        comes back in the metrics: a dict with str keys entry by entry (``metrics["accuracy"]``; a name that clashes
        with a metric below is refused), anything else as ``metrics["aux"]``. With microbatches, each aux leaf is
        reduced over them: floats by mean, integers and bools by sum (token counts add up).
      warmup: a :class:`jaxlowfp.qat.Warmup`: observe-only (high precision) while ``step < warmup.steps``.
      microbatches: split the leading axis of every batch leaf into this many equal microbatches, accumulate the
        mean gradient and merge the amax histories by maximum (the module docstring says when that equals one
        large batch).
      lr_schedule: reported as ``metrics["lr"]`` at the optimizer's own count (skipped steps do not advance it).
      telemetry_layer: a quantized layer's path, e.g. ``blocks/1/mlp/down_proj``: its activation amax and amax
        estimate are reported.
      state_shardings: ``state -> pytree of shardings``: the new state is constrained to it (a sharded model keeps
        its layout from step to step).

    A batch whose tokens (the batch itself if it is an integer array, else its entries ``tokens``, ``input_ids`` or
    ``inputs``) hold ids outside ``[0, model.config.vocab)`` is skipped, and ``metrics["invalid_token_ids"]`` counts
    them (`check_tokens` refuses such a batch on the host, before the step).

    Metrics: ``loss``, ``observe_only``, ``finite``, ``skipped`` and, with quantized layers, ``max_saturated_fraction``,
    ``mean_saturated_fraction`` (max / mean over layers and microbatches), ``nonfinite_quantized``, and the
    ``amax`` / ``amax_estimate`` of `telemetry_layer`; ``lr`` with `lr_schedule`; and the entries of `aux`.
    """
    if warmup is not None and not isinstance(warmup, Warmup):
        raise TypeError(f"warmup must be a jaxlowfp.qat.Warmup or None; got {type(warmup).__name__}")
    k = integer(microbatches, "microbatches", minimum=1)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, batch) -> (loss, aux); got {loss_fn!r}")

    def grads_of(params, qstate, rest, batch, observe):
        def loss_of(p, pending=None):
            q = qstate if pending is None else scaling.with_pending_amaxes(qstate, pending)
            model = nnx.merge(graphdef, p, q, rest, copy=True)  # fresh Variables: mutable in this trace
            set_observe_only(model, observe)
            # at trace time: a layer reported quantized whose op never ran in this trace is named
            loss, aux = _loss_and_aux(checked_call(model, loss_fn, batch), loss_fn)
            _, _, new_q, new_rest = split(model)
            return loss, (new_q, new_rest, aux)

        pending = scaling.pending_amaxes(qstate)
        if not jax.tree.leaves(pending):  # no delayed gradient scaling: differentiate w.r.t. the params only
            (loss, (new_q, new_rest, aux)), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
            return loss, grads, new_q, new_rest, aux
        # Delayed gradient scaling: the backward passes report their output-gradient amaxes as the gradient
        # w.r.t. the pending slots of qstate, which becomes their new value (recorded at the next forward pass).
        (loss, (new_q, new_rest, aux)), (grads, reported) = jax.value_and_grad(
            loss_of, argnums=(0, 1), has_aux=True)(params, pending)
        return loss, grads, scaling.with_pending_amaxes(new_q, reported), new_rest, aux

    def split_batch(batch):
        def one(x):
            if x.shape[0] % k:
                raise ValueError(f"microbatches={k} must divide the batch size; got a batch leaf of shape {x.shape}")
            return x.reshape(k, x.shape[0] // k, *x.shape[1:])

        return jax.tree.map(one, batch)

    def accumulate(state, batch, observe):
        def body(carry, mb):
            rest, gsum, lsum = carry
            loss, grads, new_q, new_rest, aux = grads_of(state.params, state.qstate, rest, mb, observe)
            carry = (new_rest, jax.tree.map(jnp.add, gsum, grads), lsum + loss)
            return carry, (new_q, quant_metrics(new_rest, telemetry_layer), aux)

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        (rest, gsum, lsum), (qs, mets, aux) = jax.lax.scan(
            body, (state.rest, zeros, jnp.zeros((), jnp.float32)), split_batch(batch))
        grads = jax.tree.map(lambda g: g / k, gsum)
        reduce = {"mean_saturated_fraction": jnp.mean, "nonfinite_quantized": jnp.sum}  # the others: max
        mets = {name: reduce.get(name, jnp.max)(v) for name, v in mets.items()}
        return lsum / k, grads, scaling.merge(qs), rest, mets, jax.tree.map(_reduce_microbatches, aux)

    def step_fn(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        observe = warmup.observe_only(state.step) if warmup is not None else jnp.bool_(False)
        if k == 1:
            loss, grads, qstate, rest, aux = grads_of(state.params, state.qstate, state.rest, batch, observe)
            qmets = quant_metrics(rest, telemetry_layer)
        else:
            loss, grads, qstate, rest, qmets, aux = accumulate(state, batch, observe)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        ok = jnp.isfinite(loss) & _all_finite(grads)
        if "nonfinite_quantized" in qmets:
            ok = ok & (qmets["nonfinite_quantized"] == 0)
        bad_ids = _invalid_token_ids(graphdef, state, batch)
        if bad_ids is not None:
            ok = ok & (bad_ids == 0)

        def pick(new: Any, old: Any) -> Any:
            return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)

        applied = state.step - state.skipped  # optax's own count: skipped steps do not advance the schedule
        new = TrainState(
            params=pick(params, state.params),
            qstate=pick(qstate, state.qstate),
            rest=pick(rest, state.rest),
            opt_state=pick(opt_state, state.opt_state),
            step=state.step + 1,
            skipped=state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
        )
        metrics = {**_aux_metrics(aux), "loss": loss, "observe_only": observe, "skipped": new.skipped, "finite": ok,
                   **qmets}
        if bad_ids is not None:
            metrics["invalid_token_ids"] = bad_ids
        if lr_schedule is not None:
            with jax.numpy_dtype_promotion("standard"):
                metrics["lr"] = jnp.asarray(lr_schedule(applied), jnp.float32)
        if state_shardings is not None:
            new = jax.lax.with_sharding_constraint(new, state_shardings(new))
        return new, metrics

    return step_fn


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
