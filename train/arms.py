"""Running one arm: quantize the model per the arm, build its optimizer and warmup, and train it with
`train.loop.train`. Shared by the byte-level jobs (`train.__main__`) and real checkpoints (`train.real_qat`)."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from jaxlowfp import qat
from jaxlowfp.qnnx import QuantizeReport, paper_rules, quantize_model
from .grid import FOUROVERSIX_LAYERS, ArmSpec, make_recipe
from .loop import RunResult, make_optimizer, make_schedule, train
from jaxlowfp.models.llama import loss_fn

__all__ = ["RuleError", "finished_arm", "loss_function", "quantize_arm", "record_arm", "stats_layer", "train_arm"]


class RuleError(ValueError):
    """The arm's quantization rules do not fit the model (no block to quantize, no layer matched, a layer whose
    shape the recipe cannot block)."""


def _remat_loss(model: Any, batch: Any) -> Any:
    return _REMAT(model, batch)


# Rematerialisation of the whole forward: the backward pass keeps only the outputs of matmuls without batch
# dimensions (the projections) and recomputes the rest (norms, RoPE, attention scores and probabilities, SwiGLU).
_REMAT = nnx.remat(loss_fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)


def loss_function(remat: bool) -> Any:
    """`jaxlowfp.models.llama.loss_fn`, or its rematerialised twin (one object each, so jitted steps are shared)."""
    return _remat_loss if remat else loss_fn


def quantize_arm(model: nnx.Module, arm: ArmSpec, *, keep_first: int, keep_last: int,
                 seed: int = 0) -> QuantizeReport | None:
    """Quantize `model` in place for `arm` (nothing for a high-precision arm) and return the report.

    HiF8 / NVFP4 W4A4 arms: `jaxlowfp.qnnx.paper_rules` (the MLP projections of blocks keep_first ..
    n - keep_last - 1). NVFP4 training arms: the `train.grid.FOUROVERSIX_LAYERS` of every block; stochastic
    rounding draws from ``nnx.Rngs(seed)``. Raises `RuleError` when the rules
    leave no block, match no layer, or a layer's shape does not fit the recipe's blocks.
    """
    if arm.format == "none":
        return None
    n_blocks = model.config.n_layers
    recipe = make_recipe(arm)
    try:
        if arm.training:
            rules = paper_rules(n_blocks, keep_first=0, keep_last=0, recipe=recipe, mlp_names=FOUROVERSIX_LAYERS)
        else:
            rules = paper_rules(n_blocks, keep_first=keep_first, keep_last=keep_last, recipe=recipe)
        report = quantize_model(model, rules, rngs=nnx.Rngs(seed) if recipe.needs_key else None)
    except ValueError as e:
        raise RuleError(f"arm {arm.name!r}: the quantization rules do not fit the model ({n_blocks} blocks): {e}") \
            from e
    if not report.quantized:
        raise RuleError(f"arm {arm.name!r}: the rules quantized no layer; the model has no blocks/<i>/mlp/"
                        f"{{gate,up,down}}_proj linear layers in blocks {keep_first}..{n_blocks - keep_last - 1}")
    return report


def stats_layer(arm: ArmSpec, keep_first: int) -> str | None:
    """The layer whose activation amax the loop logs: the first quantized block's down_proj (its input, the SwiGLU
    product, has the heaviest tails)."""
    if arm.format == "none":
        return None
    return f"blocks/{0 if arm.training else keep_first}/mlp/down_proj"


@functools.lru_cache(maxsize=None)
def _optimizer(lr: float, kind: str, steps: int, lr_warmup_steps: int, weight_decay: float, grad_clip: float
               ) -> tuple[Any, Any]:
    """(schedule, tx), one object per setting: arms that share model structure and setting share a compiled step."""
    schedule = make_schedule(lr, kind=kind, total_steps=steps, warmup_steps=lr_warmup_steps)
    return schedule, make_optimizer(schedule, weight_decay=weight_decay, grad_clip=grad_clip)


def _accepts_microbatches() -> bool:
    return "microbatches" in inspect.signature(train).parameters


def train_arm(model: nnx.Module, arm: ArmSpec, stream: Any, cfg: Any, *, steps: int, lr: float, schedule: str,
              out_dir: str | Path, mesh: Any, stats: str | None, meta: dict[str, Any] | None = None,
              cached_optimizer: bool = False) -> RunResult:
    """Train an (already quantized) `model` in place for one arm with `train.loop.train`.

    The optimizer is AdamW with the config's weight decay and clipping on a `schedule` ("constant" or "cosine"
    with the config's LR warmup) at `lr`; a quantized arm with ``warmup_steps`` runs that many observe-only
    (high-precision) steps first. ``cfg.microbatches`` > 1 accumulates gradients over microbatches, ``cfg.remat``
    rematerialises. ``cached_optimizer`` reuses one optimizer object per setting (real models: arms then share a
    compilation); the byte-level demo builds a fresh one per arm, as it always did.
    """
    args = (lr, schedule, steps, cfg.lr_warmup_steps, cfg.weight_decay, cfg.grad_clip)
    sched, tx = _optimizer(*args) if cached_optimizer else _optimizer.__wrapped__(*args)
    warmup = qat.Warmup(steps=arm.warmup_steps) if arm.format != "none" and arm.warmup_steps > 0 else None
    extra: dict[str, Any] = {}
    if cfg.microbatches > 1:
        if not _accepts_microbatches():
            raise SystemExit("--microbatches > 1 needs train.loop.train(..., microbatches=k), which this checkout's "
                             "train/loop.py does not accept yet (jaxlowfp.training.make_step supports it)")
        extra["microbatches"] = cfg.microbatches
    meta = {"arm": dataclasses.asdict(arm), **(meta or {})}
    return train(model, stream, steps=steps, tx=tx, schedule=sched, loss_fn=loss_function(cfg.remat),
                 out_dir=out_dir, warmup=warmup, stats_layer=stats, mesh=mesh,
                 checkpoint_every=cfg.checkpoint_every, resume=cfg.resume,
                 progress=cfg.progress and jax.process_index() == 0, desc=arm.name, meta=meta, **extra)


# fields that do not change what an arm computes: a finished arm is reused across runs that differ only in these
_NOT_DECISIVE = ("resume", "progress", "arms", "out", "checkpoint_every", "mesh", "cache_dir", "downstream")
_DONE = "arm.json"


def _decisive(cfg: Any) -> dict[str, Any]:
    return {k: v for k, v in cfg.to_json().items() if k not in _NOT_DECISIVE}


def record_arm(arm_dir: str | Path, cfg: Any, entry: dict[str, Any]) -> None:
    """Write ``<arm_dir>/arm.json``: the arm's evaluated summary (`entry`) and the config that produced it."""
    if jax.process_index() == 0:
        Path(arm_dir, _DONE).write_text(json.dumps({"config": _decisive(cfg), "entry": entry}, indent=1,
                                                   default=str))


def finished_arm(arm_dir: str | Path, cfg: Any) -> dict[str, Any] | None:
    """The summary `record_arm` wrote for this arm, if it was written under the same decisive configuration (so
    ``--resume`` skips an arm that already finished: a grid split over several calls, or killed, goes on where it
    stopped); None otherwise."""
    path = Path(arm_dir, _DONE)
    if not path.is_file() or not Path(arm_dir, "metrics.jsonl").is_file():
        return None
    done = json.loads(path.read_text())
    if done.get("config") != json.loads(json.dumps(_decisive(cfg), default=str)):
        return None
    return done["entry"]
