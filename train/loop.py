"""The training loop: one jit-compiled functional step, optax AdamW, QAT warmup, non-finite skipping, metrics.

The NNX model is split once into ``graphdef`` and state pytrees (`split_model`)::

    params  nnx.Param                    differentiated, updated by optax
    qstate  jaxlowfp.nnx.AmaxState       amax histories of the quantized layers (delayed scaling)
    rest    everything else              last QuantStats, observe-only flags, ...

and the step is a pure function ``(TrainState, batch) -> (TrainState, metrics)``: it merges the model inside,
switches the quantized layers to observe-only while ``warmup.observe_only(step)`` (a traced bool, so crossing the
warmup boundary does not retrace), takes the loss and its gradient with respect to ``params`` only, applies the
optax update and returns the new amax state. When the loss or any gradient is non-finite the step is skipped inside
jit (`jnp.where`): params, optimizer state and amax state stay as they were and ``skipped`` counts it, so a NaN is
never written to the state or to a checkpoint.

`train(...)` drives the step: data stream, device mesh, checkpoints (`train.checkpoint`), ``metrics.jsonl``
(one row a step) and a tqdm progress bar with loss, tokens/s and the largest saturated fraction.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from train import mesh as mesh_lib
from train.checkpoint import Checkpointer

__all__ = [
    "TrainState",
    "RunResult",
    "StopTraining",
    "split_model",
    "make_schedule",
    "make_optimizer",
    "init_state",
    "make_train_step",
    "jit_train_step",
    "state_shardings",
    "shard_state",
    "checkpointer",
    "train",
]

log = logging.getLogger(__name__)

LossFn = Callable[[nnx.Module, jax.Array], tuple[jax.Array, Any]]


class TrainState(NamedTuple):
    """The functional training state (a pytree; the data position is kept beside it by `train`)."""

    params: nnx.State  # nnx.Param leaves
    qstate: nnx.State  # AmaxState leaves (amax histories)
    rest: nnx.State  # the rest of the model state
    opt_state: optax.OptState
    step: jax.Array  # int32 []: batches consumed
    skipped: jax.Array  # int32 []: non-finite steps skipped
    rng: jax.Array  # uint32 [2]: a PRNG key split once a step, for losses that need one (the model's own
    #                 streams, e.g. stochastic rounding in a QuantLinear, live in `rest`)


class RunResult(NamedTuple):
    """What `train` returns besides updating the model in place."""

    state: TrainState
    data_state: Any
    losses: list[float]  # one per step run in this call (NaN for skipped steps)
    wall_s: float  # wall time of this call, compile included
    resumed_from: int | None  # checkpoint step this call started from
    rows: list[dict[str, Any]]  # metrics rows written in this call


class StopTraining(Exception):
    """Raise from an `on_step` callback to stop cleanly (the state is not checkpointed)."""


def _amax_filter() -> Any:
    from jaxlowfp.nnx import AmaxState

    return AmaxState


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State, nnx.State]:
    """``(graphdef, params, qstate, rest)`` = ``nnx.split(model, nnx.Param, AmaxState, ...)``."""
    return nnx.split(model, nnx.Param, _amax_filter(), ...)


def make_schedule(lr: float, *, kind: str = "constant", total_steps: int = 1, warmup_steps: int = 0) -> optax.Schedule:
    """``constant``: lr throughout (the paper's low LR for continued pretraining); ``cosine``: linear warmup over
    `warmup_steps` to lr, then cosine decay to lr / 10 at `total_steps`."""
    if kind == "constant":
        return optax.constant_schedule(lr)
    if kind == "cosine":
        warm = min(warmup_steps, max(total_steps - 1, 0))
        inner = optax.warmup_cosine_decay_schedule(0.0, lr, warm, max(total_steps, warm + 1), end_value=lr / 10)

        def schedule(count: Any) -> jax.Array:
            with jax.numpy_dtype_promotion("standard"):  # optax mixes the int32 count with Python floats
                return jnp.asarray(inner(count), jnp.float32)

        return schedule
    raise ValueError(f"schedule kind={kind!r} is not supported; allowed: 'constant', 'cosine'")


def make_optimizer(schedule: optax.Schedule, *, weight_decay: float = 0.1, grad_clip: float = 1.0,
                   b1: float = 0.9, b2: float = 0.95) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW; weight decay on matrices only (not norms or biases)."""
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
    parts.append(optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay,
                             mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
    return _standard_promotion(optax.chain(*parts))


def _standard_promotion(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """optax's Adam bias correction computes ``b1 ** count`` (Python float ** int32), which the strict dtype
    promotion this project runs under rejects; the optimizer (float32 state, no low-precision math) runs with
    standard promotion, the model does not."""

    def init(params: Any) -> optax.OptState:
        with jax.numpy_dtype_promotion("standard"):
            return tx.init(params)

    def update(updates: Any, state: optax.OptState, params: Any = None) -> tuple[Any, optax.OptState]:
        with jax.numpy_dtype_promotion("standard"):
            return tx.update(updates, state, params)

    return optax.GradientTransformation(init, update)


def init_state(model: nnx.Module, tx: optax.GradientTransformation, *, seed: int = 0
               ) -> tuple[nnx.GraphDef, TrainState]:
    graphdef, params, qstate, rest = split_model(model)
    return graphdef, TrainState(params=params, qstate=qstate, rest=rest, opt_state=tx.init(params),
                                step=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32),
                                rng=jax.random.PRNGKey(seed))


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, *, loss_fn: LossFn,
                    schedule: optax.Schedule, warmup: Any = None, stats_layer: str | None = None,
                    mesh: Mesh | None = None,
                    ) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """The pure step ``(state, batch) -> (state', metrics)`` (not jitted: see `jit_train_step`).

    `warmup` is a `jaxlowfp.qat.Warmup` (None: quantize from step 0). Metrics: loss, lr, observe_only, skipped,
    finite, the max and mean saturated fraction over the quantized layers and, for `stats_layer`, its observed
    amax and the amax estimate its scale came from. With a `mesh`, the new state is constrained to the
    `shard_state` layout, so it stays put from step to step.
    """
    amax_filter = _amax_filter()
    from jaxlowfp.nnx import set_observe_only

    def step_fn(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        observe = warmup.observe_only(state.step) if warmup is not None else jnp.bool_(False)

        def loss_of(params: nnx.State) -> tuple[jax.Array, tuple[nnx.State, nnx.State]]:
            model = nnx.merge(graphdef, params, state.qstate, state.rest, copy=True)  # fresh Variables: mutable here
            set_observe_only(model, observe)
            loss, _ = loss_fn(model, batch)
            _, _, qstate, rest = nnx.split(model, nnx.Param, amax_filter, ...)
            return loss, (qstate, rest)

        (loss, (qstate, rest)), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        ok = jnp.isfinite(loss) & _all_finite(grads)

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
            rng=jax.random.split(state.rng)[0],
        )
        metrics = {"loss": loss, "lr": jnp.asarray(schedule(applied), jnp.float32), "observe_only": observe,
                   "skipped": new.skipped, "finite": ok}
        metrics.update(quant_metrics(rest, stats_layer))
        if mesh is not None:
            new = jax.lax.with_sharding_constraint(new, state_shardings(new, mesh))
        return new, metrics

    return step_fn


def jit_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, *, loss_fn: LossFn,
                   schedule: optax.Schedule, warmup: Any = None, stats_layer: str | None = None,
                   mesh: Mesh | None = None, donate: bool = True,
                   ) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """`make_train_step` under `jax.jit`, donating the input state; cached, so runs that share the model
    structure, optimizer and schedule objects compile once."""
    return _jit_train_step(graphdef, tx, loss_fn, schedule, warmup, stats_layer, mesh, donate)


@functools.lru_cache(maxsize=16)
def _jit_train_step(graphdef, tx, loss_fn, schedule, warmup, stats_layer, mesh, donate):  # positional: one key
    fn = make_train_step(graphdef, tx, loss_fn=loss_fn, schedule=schedule, warmup=warmup, stats_layer=stats_layer,
                         mesh=mesh)
    return jax.jit(fn, donate_argnums=0 if donate else ())


def quant_metrics(rest: nnx.State, layer: str | None) -> dict[str, jax.Array]:
    """Saturation of the quantized activations (max and mean over layers) and, for `layer`, the observed amax of
    its input and the estimate its scale came from; from the layers' last `QuantStats`. Empty for a
    high-precision model (no saturation columns rather than zeros)."""
    from jaxlowfp.nnx import QuantStatsState

    sat, out = [], {}
    for path, var in _iter_vars(rest, QuantStatsState):
        act = getattr(var.get_value(), "activation", None)  # RecipeStats(weight, activation)
        if act is None:
            continue
        sat.append(jnp.asarray(act.saturated_fraction, jnp.float32).reshape(()))
        if path == layer:
            out["amax"] = jnp.asarray(act.amax, jnp.float32).reshape(())
            out["amax_estimate"] = jnp.asarray(act.amax_estimate, jnp.float32).reshape(())
    if sat:
        out["max_saturated_fraction"] = jnp.max(jnp.stack(sat))
        out["mean_saturated_fraction"] = jnp.mean(jnp.stack(sat))
    return out


def _iter_vars(state: nnx.State, var_type: type) -> list[tuple[str, Any]]:
    return [("/".join(map(str, path[:-1])), v) for path, v in nnx.to_flat_state(state) if isinstance(v, var_type)]


def state_shardings(state: TrainState, mesh: Mesh) -> TrainState:
    """Params and optimizer moments over fsdp (where divisible), everything else replicated."""
    rep = mesh_lib.replicated(mesh)
    return TrainState(
        params=mesh_lib.param_shardings(state.params, mesh),
        qstate=jax.tree.map(lambda _: rep, state.qstate),
        rest=jax.tree.map(lambda _: rep, state.rest),
        opt_state=mesh_lib.param_shardings(state.opt_state, mesh),
        step=rep,
        skipped=rep,
        rng=rep,
    )


def shard_state(state: TrainState, mesh: Mesh) -> TrainState:
    """`state` laid out by `state_shardings`, in fresh buffers: the step donates its input state, which must
    not alias the caller's arrays (nor one buffer twice, as NNX variables that share an array would)."""
    return mesh_lib.shard(state, state_shardings(state, mesh), copy=True)


CHECKED = ("train.params", "train.opt_state")


def checkpointer(out_dir: str | Path, **kw: Any) -> Checkpointer:
    """The checkpoints of a `train` run: ``<out_dir>/ckpt``, items ``{"train": TrainState, "data": DataState}``,
    refusing non-finite params or optimizer state."""
    return Checkpointer(Path(out_dir) / "ckpt", checked=CHECKED, **kw)


def _rewrite_metrics(path: Path, keep_up_to: int | None) -> None:
    """Drop rows logged after the checkpoint we resume from (they are redone), or all rows on a fresh run."""
    if not path.exists():
        return
    rows = []
    if keep_up_to is not None:
        for line in path.read_text().splitlines():
            if line.strip() and json.loads(line)["step"] <= keep_up_to:
                rows.append(line)
    path.write_text("".join(r + "\n" for r in rows))


def _to_host(m: dict[str, jax.Array]) -> dict[str, Any]:
    out = {}
    for k, v in jax.device_get(m).items():
        v = np.asarray(v)
        out[k] = bool(v) if v.dtype == np.bool_ else (int(v) if np.issubdtype(v.dtype, np.integer) else float(v))
    return out


def train(model: nnx.Module, stream: Any, *, steps: int, tx: optax.GradientTransformation,
          schedule: optax.Schedule, loss_fn: LossFn, out_dir: str | Path, warmup: Any = None,
          stats_layer: str | None = None, mesh: Mesh | None = None, checkpoint_every: int = 50,
          resume: bool = False, seed: int = 0, progress: bool = True, desc: str = "train",
          on_step: Callable[[int, dict[str, Any]], None] | None = None, meta: dict[str, Any] | None = None,
          ) -> RunResult:
    """Train `model` (updated in place) for `steps` steps of `stream`, checkpointing to ``<out_dir>/ckpt``.

    `stream` has ``init() -> data_state`` and ``next(data_state) -> (batch [B, T+1] int32, data_state)``.
    ``resume=True`` continues from the latest checkpoint in `out_dir` (bit-identical to an uninterrupted run);
    otherwise earlier checkpoints and metrics in `out_dir` are discarded. Rows go to ``<out_dir>/metrics.jsonl``.
    """
    for name, v in (("steps", steps), ("checkpoint_every", checkpoint_every)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int; got {v!r}")
    t_start = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir, metrics_path = out_dir / "ckpt", out_dir / "metrics.jsonl"
    lead = jax.process_index() == 0  # multi-host: one process writes files (orbax coordinates checkpoints)
    if not resume and ckpt_dir.exists() and lead:
        shutil.rmtree(ckpt_dir)
    mesh = mesh if mesh is not None else mesh_lib.make_mesh(None)

    graphdef, state = init_state(model, tx, seed=seed)
    state = shard_state(state, mesh)
    data_state = stream.init()
    resumed_from = None
    with checkpointer(out_dir) as ckpt:
        if resume and ckpt.latest_step() is not None:
            restored, _ = ckpt.restore({"train": state, "data": data_state})
            state, data_state = restored["train"], restored["data"]
            resumed_from = int(state.step)
        if lead:
            _rewrite_metrics(metrics_path, resumed_from)

        step_fn = jit_train_step(graphdef, tx, loss_fn=loss_fn, schedule=schedule, warmup=warmup,
                                 stats_layer=stats_layer, mesh=mesh)
        start = int(state.step)
        losses: list[float] = []
        rows: list[dict[str, Any]] = []
        bar = _progress(progress, total=steps, initial=start, desc=desc)
        try:
            with metrics_path.open("a") if lead else open(os.devnull, "w") as f:
                t_last = time.perf_counter()
                for step in range(start, steps):
                    batch_np, data_state = stream.next(data_state)  # this process's rows
                    batch = mesh_lib.global_batch(np.asarray(batch_np), mesh)
                    tokens = batch.shape[0] * (batch.shape[1] - 1)  # global: all processes
                    state, m = step_fn(state, batch)
                    row = _to_host(m)
                    now = time.perf_counter()
                    row = {"step": step + 1, **row, "tokens_per_s": tokens / max(now - t_last, 1e-9),
                           "time_s": now - t_start}
                    t_last = now
                    losses.append(row["loss"] if row["finite"] else float("nan"))
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    if bar is not None:
                        bar.update(1)
                        sat = row.get("max_saturated_fraction")
                        bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}",
                                        **({} if sat is None else {"max_sat": f"{sat:.2e}"}), refresh=False)
                    if not row["finite"]:
                        log.warning("step %d: non-finite loss or gradients, step skipped (%d so far)",
                                    step + 1, row["skipped"])
                    if on_step is not None:
                        on_step(step + 1, row)
                    if (step + 1) % checkpoint_every == 0 or step + 1 == steps:
                        ckpt.save(step + 1, {"train": state, "data": data_state},
                                  {"step": step + 1, "skipped": row["skipped"], **(meta or {})})
                        t_last = time.perf_counter()  # tokens/s counts training, not saving
        except StopTraining:
            pass
        finally:
            if bar is not None:
                bar.close()
            nnx.update(model, state.params, state.qstate, state.rest)  # its old buffers were donated
    return RunResult(state=state, data_state=data_state, losses=losses, wall_s=time.perf_counter() - t_start,
                     resumed_from=resumed_from, rows=rows)


def _progress(enabled: bool, **kw: Any) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(dynamic_ncols=True, leave=True, **kw)
