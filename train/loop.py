"""The training loop of the app: data stream, device mesh, checkpoints, metrics and progress around the library's
functional step (`jaxlowfp.training`: TrainState, init, make_step; one copy of the step for the app, the examples,
the benchmarks and the tests).

`train(...)` drives the step: data stream, device mesh, checkpoints (`train.checkpoint`), ``metrics.jsonl``
(one row a step) and a tqdm progress bar with loss, tokens/s and the largest saturated fraction. A step whose loss,
gradients or quantized values are non-finite is skipped inside jit (`jaxlowfp.training`), so a NaN is never written
to the state or to a checkpoint.
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

from jaxlowfp import training
from jaxlowfp.training import LossFn, TrainState
from . import mesh as mesh_lib
from .checkpoint import Checkpointer

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


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State, nnx.State]:
    """``(graphdef, params, qstate, rest)`` = ``nnx.split(model, nnx.Param, AmaxState, ...)``."""
    return training.split(model)


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
    return optax.chain(*parts)


def init_state(model: nnx.Module, tx: optax.GradientTransformation) -> tuple[nnx.GraphDef, TrainState]:
    """``jaxlowfp.training.init``: (graphdef, state at step 0)."""
    return training.init(model, tx)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, *, loss_fn: LossFn,
                    schedule: optax.Schedule, warmup: Any = None, stats_layer: str | None = None,
                    mesh: Mesh | None = None, microbatches: int = 1,
                    ) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """The library step (`jaxlowfp.training.make_step`) with the app's telemetry layer and, with a `mesh`, the
    new state constrained to the `shard_state` layout, so it stays put from step to step."""
    shardings = None if mesh is None else (lambda s: state_shardings(s, mesh))
    return training.make_step(graphdef, tx, loss_fn, warmup=warmup, microbatches=microbatches,
                              lr_schedule=schedule, telemetry_layer=stats_layer, state_shardings=shardings)


def jit_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, *, loss_fn: LossFn,
                   schedule: optax.Schedule, warmup: Any = None, stats_layer: str | None = None,
                   mesh: Mesh | None = None, donate: bool = True, microbatches: int = 1,
                   ) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """`make_train_step` under `jax.jit`, donating the input state; cached, so runs that share the model
    structure, optimizer and schedule objects compile once."""
    return _jit_train_step(graphdef, tx, loss_fn, schedule, warmup, stats_layer, mesh, donate, microbatches)


@functools.lru_cache(maxsize=16)
def _jit_train_step(graphdef, tx, loss_fn, schedule, warmup, stats_layer, mesh, donate, microbatches):  # one key
    fn = make_train_step(graphdef, tx, loss_fn=loss_fn, schedule=schedule, warmup=warmup, stats_layer=stats_layer,
                         mesh=mesh, microbatches=microbatches)
    return jax.jit(fn, donate_argnums=0 if donate else ())


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
          resume: bool = False, progress: bool = True, desc: str = "train",
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
    if jax.process_count() > 1:  # nobody opens the checkpoint directory before the lead has cleared it
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"jaxlowfp.train:{out_dir}:cleared")
    mesh = mesh if mesh is not None else mesh_lib.make_mesh(None)

    graphdef, state = init_state(model, tx)
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
                        log.warning("step %d: non-finite loss, gradients or quantized values (%d in quantized "
                                    "tensors), step skipped (%d so far)", step + 1,
                                    row.get("nonfinite_quantized", 0), row["skipped"])
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
