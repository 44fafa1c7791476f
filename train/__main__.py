"""`python -m train` (what `make demo` runs): HiF8 W8A8 QAT of a pretrained model, against its failure modes.

1. Pretrain the model on domain A (Shakespeare) in high precision; cached under
   ``<cache_dir>/pretrained-<hash of the pretraining config>/`` and reused by the next run.
2. Continue on domain B (Python source) in several arms from the same parameters, with the same data order and
   learning rate (`train.config`): high precision; HiF8 W8A8 with `most_recent` scaling and no warmup; HiF8 W8A8
   with `max_window` 64 scaling after a high-precision warmup. MLP projections of the middle blocks are quantized
   (`jaxlowfp.nnx.paper_rules`); the first and last blocks, attention, embeddings, norms and head are not.
3. Evaluate every arm (domain-B and domain-A validation loss: the latter is forgetting; a multiple-choice task
   from held-out domain-A text; loss APE against the high-precision arm), print the table and write
   ``<run_dir>/report.md`` with plots.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxlowfp import qat
from jaxlowfp.nnx import paper_rules, quantize
from train import evaluate as ev
from train import mesh as mesh_lib
from train.checkpoint import Checkpointer
from train.config import ArmSpec, TrainConfig, arm_specs, parse_args, pretrain_key
from train.data import BatchStream, DataError, Domain, load_domain
from train.loop import RunResult, make_optimizer, make_schedule, split_model, train
from train.model import PRESETS, Llama, loss_fn
from train.report import format_table, summary_rows, write_report

log = logging.getLogger("train")


def make_recipe(arm: ArmSpec) -> qat.Recipe:
    """The `jaxlowfp.qat.Recipe` of a quantized arm: HiF8 W8A8 with the arm's delayed scaling, or NVFP4 W4A4
    with Four Over Six block scaling (the MAE rule, which the Four Over Six paper prefers for training)."""
    if arm.format == "hif8":
        return qat.hif8_w8a8(algorithm=arm.algorithm, history_len=arm.history_len, target_max=15.0)
    if arm.format == "nvfp4":
        return qat.nvfp4_w4a4(rule="mae")
    raise ValueError(f"arm {arm.name!r} has format {arm.format!r}; no recipe for it")


def _stream(tokens: np.ndarray, cfg: TrainConfig, seed: int) -> BatchStream:
    return BatchStream(tokens, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=seed,
                       process_index=jax.process_index(), process_count=jax.process_count())


def _progress(cfg: TrainConfig) -> bool:
    return cfg.progress and jax.process_index() == 0


def _new_model(cfg: TrainConfig) -> Llama:
    return Llama(PRESETS[cfg.preset], rngs=nnx.Rngs(cfg.seed))


def pretrain(cfg: TrainConfig, domain_a: Domain, mesh: mesh_lib.Mesh) -> tuple[nnx.State, dict[str, Any]]:
    """High-precision pretraining on domain A, cached by `pretrain_key`; returns (params, info)."""
    model = _new_model(cfg)
    if cfg.pretrain_steps == 0:
        return split_model(model)[1], {"cached": False, "steps": 0, "wall_s": 0.0}
    key = pretrain_key(cfg, domain_a.fingerprint)
    root = Path(cfg.cache_dir) / f"pretrained-{key}"
    done = root / "done.json"
    final = Checkpointer(root / "final", checked=("params",))
    try:
        if done.exists() and final.latest_step() is not None:
            target = {"params": split_model(model)[1]}
            restored, _ = final.restore(target)
            info = json.loads(done.read_text())
            log.info("pretrained model reused from %s", root)
            return restored["params"], {**info, "cached": True}
        log.info("pretraining %s on domain A for %d steps (cached in %s)", cfg.preset, cfg.pretrain_steps, root)
        schedule = make_schedule(cfg.pretrain_lr, kind="cosine", total_steps=cfg.pretrain_steps,
                                 warmup_steps=cfg.lr_warmup_steps)
        tx = make_optimizer(schedule, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip)
        # resume=True: the directory is keyed by the pretraining config, so a killed pretraining continues exactly
        res = train(model, _stream(domain_a.train, cfg, cfg.seed), steps=cfg.pretrain_steps, tx=tx,
                    schedule=schedule, loss_fn=loss_fn, out_dir=root, mesh=mesh,
                    checkpoint_every=cfg.checkpoint_every, resume=True, progress=_progress(cfg),
                    desc="pretrain A", meta={"config": cfg.to_json()})
        params = split_model(model)[1]
        final.save(cfg.pretrain_steps, {"params": params}, {"key": key})
        info = {"steps": cfg.pretrain_steps, "wall_s": res.wall_s,
                "final_loss": float(np.nanmean(res.losses[-10:])) if res.losses else None}
        if jax.process_index() == 0:
            done.write_text(json.dumps(info))
        return params, {**info, "cached": False}
    finally:
        final.close()


def evaluate(model: nnx.Module, cfg: TrainConfig, domain_a: Domain, domain_b: Domain, task: ev.ChoiceTask) -> dict[str, float]:
    kw = dict(batch_size=cfg.batch_size, seq_len=cfg.seq_len, max_batches=cfg.eval_batches)
    b = ev.validation_loss(model, domain_b.val, **kw)
    a = ev.validation_loss(model, domain_a.val, **kw)
    mc = ev.score_choices(model, task)
    return {"val_loss_b": float(b["loss"]), "ppl_b": float(b["ppl"]), "val_loss_a": float(a["loss"]),
            "ppl_a": float(a["ppl"]), "acc": float(mc["acc"]), "acc_norm": float(mc["acc_norm"])}


def _stats_layer(cfg: TrainConfig) -> str:
    """The layer whose amax telemetry is logged: the first quantized block's down_proj (its input, the SwiGLU
    product, has the heaviest tails)."""
    return f"blocks/{cfg.keep_first}/mlp/down_proj"


def run_arm(cfg: TrainConfig, arm: ArmSpec, params: nnx.State, domain_b: Domain, mesh: mesh_lib.Mesh
            ) -> tuple[Llama, RunResult]:
    model = _new_model(cfg)
    nnx.update(model, params)
    n_blocks = PRESETS[cfg.preset].n_layers
    stats_layer = None
    if arm.format != "none":
        report = quantize(model, paper_rules(n_blocks, keep_first=cfg.keep_first, keep_last=cfg.keep_last,
                                             recipe=make_recipe(arm)))
        log.info("arm %s: %s", arm.name, "; ".join(str(report).splitlines()[-2:]))
        stats_layer = _stats_layer(cfg)
    schedule = make_schedule(cfg.lr, kind=cfg.schedule, total_steps=cfg.steps, warmup_steps=cfg.lr_warmup_steps)
    tx = make_optimizer(schedule, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip)
    warmup = qat.Warmup(steps=arm.warmup_steps) if arm.format != "none" and arm.warmup_steps > 0 else None
    res = train(model, _stream(domain_b.train, cfg, cfg.seed + 1), steps=cfg.steps, tx=tx, schedule=schedule,
                loss_fn=loss_fn, out_dir=Path(cfg.run_dir) / arm.name, warmup=warmup, stats_layer=stats_layer,
                mesh=mesh, checkpoint_every=cfg.checkpoint_every, resume=cfg.resume,
                progress=_progress(cfg), desc=arm.name, meta={"config": cfg.to_json(), "arm": dataclasses.asdict(arm)})
    return model, res


def run(cfg: TrainConfig) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    mesh = mesh_lib.make_mesh(cfg.mesh)
    if cfg.batch_size % (mesh.shape["data"] * mesh.shape["fsdp"]):
        raise SystemExit(f"--batch-size {cfg.batch_size} is not divisible by the {mesh.size} devices of the mesh")
    try:
        domain_a = load_domain("shakespeare", max_bytes=cfg.max_bytes)
        domain_b = load_domain("python", max_bytes=cfg.max_bytes)
    except DataError as e:
        raise SystemExit(f"data: {e}") from e
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_json(), indent=1))

    log.info("domain A: %d train / %d val bytes; domain B: %d train / %d val bytes; mesh %s",
             len(domain_a.train), len(domain_a.val), len(domain_b.train), len(domain_b.val), dict(mesh.shape))
    params, pre = pretrain(cfg, domain_a, mesh)
    task = ev.build_choice_task(domain_a.val, n_items=cfg.mc_items, context_len=cfg.seq_len // 2 + cfg.seq_len // 4,
                             continuation_len=max(cfg.seq_len // 4, 2), seed=cfg.seed)

    base = _new_model(cfg)
    nnx.update(base, params)
    start_row = {"arm": "pretrained (start)", **evaluate(base, cfg, domain_a, domain_b, task),
                 "wall_s": None if pre["cached"] else pre["wall_s"]}
    log.info("pretrained model: domain-B val loss %.4f, domain-A val loss %.4f", start_row["val_loss_b"],
             start_row["val_loss_a"])
    arms = []
    for arm in arm_specs(cfg):
        t_arm = time.perf_counter()
        log.info("arm %s (%s): %d steps on domain B", arm.name, arm.label, cfg.steps)
        model, res = run_arm(cfg, arm, params, domain_b, mesh)
        metrics = evaluate(model, cfg, domain_a, domain_b, task)
        wall = time.perf_counter() - t_arm
        log.info("arm %s done in %.0f s (training %.0f s, %d skipped steps): domain-B val loss %.4f, domain-A "
                 "val loss %.4f", arm.name, wall, res.wall_s, int(res.state.skipped), metrics["val_loss_b"],
                 metrics["val_loss_a"])
        arms.append({"name": arm.name, "label": arm.label, "dir": str(run_dir / arm.name), **metrics,
                     "wall_s": wall})
    rows = [start_row, *summary_rows(arms, baseline="hp" if "hp" in cfg.arms else None)]
    total = time.perf_counter() - t0
    print(format_table(rows))
    pre_s = "reused from cache" if pre["cached"] else f"{pre['wall_s']:.0f} s"
    print(f"total wall time {total:.0f} s (pretraining: {pre_s})")
    if jax.process_index() == 0:
        layer = _stats_layer(cfg)
        path = write_report(run_dir, arms, rows=rows, baseline="hp" if "hp" in cfg.arms else None,
                            config=cfg.to_json(), total_wall_s=total, amax_layer=layer)
        (run_dir / "results.json").write_text(json.dumps({"rows": rows, "total_wall_s": total}, indent=1))
        print(f"report: {path}")
    return rows


# `python -m train <name> ...` runs the subcommand module's `main(argv)`; without a subcommand, the demo job.
SUBCOMMANDS: dict[str, str] = {"eval": "train.eval_cli", "generate": "train.generate_cli", "ptq": "train.ptq_cli"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    cfg = parse_args(argv)
    mesh_lib.initialize_distributed()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    for name in ("train", "train.loop", "train.checkpoint"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)
        logging.getLogger(name).propagate = False
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
