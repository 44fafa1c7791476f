"""`python -m train` (what `make demo` runs): HiF8 W8A8 QAT of a pretrained model, against its failure modes.

1. Pretrain the model on domain A (Shakespeare) in high precision; cached under
   ``<cache_dir>/pretrained-<hash of the pretraining config>/`` and reused by the next run.
2. Continue on domain B (Python source) in several arms from the same parameters, with the same data order and
   learning rate (`train.config`): high precision; HiF8 W8A8 with `most_recent` scaling and no warmup; HiF8 W8A8
   with `max_window` 64 scaling after a high-precision warmup. MLP projections of the middle blocks are quantized
   (`jaxlowfp.qnnx.paper_rules`); the first and last blocks, attention, embeddings, norms and head are not.
3. Evaluate every arm (domain-B and domain-A validation loss: the latter is forgetting; a multiple-choice task
   from held-out domain-A text; loss APE against the high-precision arm), print the table and write
   ``<run_dir>/report.md`` with plots.

Other jobs of the same command (`train.grid` defines their arms): ``--grid paper`` runs the Max-Window paper's
grid in step 2 (scalings x high/low learning rate x warmup, each arm's loss APE against the high-precision arm at
its learning rate); ``--grid fouroversix`` replaces steps 1-2 by pretraining from scratch with NVFP4 training
(static_6 against the Four Over Six rules against high precision); ``--model smollm2-135m`` continues a real
checkpoint on the Python domain (`train.real_qat`). Subcommands (`SUBCOMMANDS`): ``eval``, ``generate``,
``stream`` (delayed scaling on a real model without training, `train.stream_cli`), ``tasks`` (lm-eval tasks on
real validation sets, arms evaluated on them and compared item by item, `train.tasks_cli`).
"""
from __future__ import annotations

import gc
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

from . import GC_THRESHOLD
from . import evaluate as ev
from . import mesh as mesh_lib
from .arms import RuleError, finished_arm, quantize_arm, record_arm, stats_layer, train_arm
from .checkpoint import Checkpointer
from .config import ArmSpec, TrainConfig, arm_specs, parse_args, pretrain_key
from .data import BatchStream, DataError, Domain, load_domain
from .grid import make_recipe  # noqa: F401  (re-exported: the recipe of an arm)
from .loop import RunResult, make_optimizer, make_schedule, split_model, train
from jaxlowfp.models.llama import Llama, loss_fn, preset
from .report import (GRID_COLUMNS, PRETRAIN_COLUMNS, add_final_gaps, format_table, fouroversix_notes,
                          grid_notes, summary_rows, write_report)

_PACKAGE = __package__ or "train"  # `train` in the checkout, `jaxlowfp_train` when installed
log = logging.getLogger(_PACKAGE)


def _stream(tokens: np.ndarray, cfg: TrainConfig, seed: int) -> BatchStream:
    return BatchStream(tokens, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=seed,
                       process_index=jax.process_index(), process_count=jax.process_count())


def _progress(cfg: TrainConfig) -> bool:
    return cfg.progress and jax.process_index() == 0


def _new_model(cfg: TrainConfig) -> Llama:
    return Llama(preset(cfg.preset, dtype=cfg.dtype), rngs=nnx.Rngs(cfg.seed))


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


def evaluate(model: nnx.Module, cfg: TrainConfig, domain_a: Domain, domain_b: Domain, task: ev.ChoiceTask
             ) -> dict[str, float]:
    kw = dict(batch_size=cfg.batch_size, seq_len=cfg.seq_len, max_batches=cfg.eval_batches)
    b = ev.validation_loss(model, domain_b.val, **kw)
    a = ev.validation_loss(model, domain_a.val, **kw)
    mc = ev.score_choices(model, task)
    return {"val_loss_b": float(b["loss"]), "ppl_b": float(b["ppl"]), "val_loss_a": float(a["loss"]),
            "ppl_a": float(a["ppl"]), "acc": float(mc["acc"]), "acc_norm": float(mc["acc_norm"])}


def _stats_layer(cfg: TrainConfig) -> str:
    """The layer whose amax telemetry the report plots (see `train.arms.stats_layer`)."""
    return f"blocks/{cfg.keep_first}/mlp/down_proj"


def run_arm(cfg: TrainConfig, arm: ArmSpec, params: nnx.State, domain_b: Domain, mesh: mesh_lib.Mesh
            ) -> tuple[Llama, RunResult]:
    """One continued-pretraining arm on domain B from the pretrained `params`."""
    model = _new_model(cfg)
    nnx.update(model, params)
    report = quantize_arm(model, arm, keep_first=cfg.keep_first, keep_last=cfg.keep_last, seed=cfg.seed)
    if report is not None:
        log.info("arm %s: %s", arm.name, "; ".join(str(report).splitlines()[-2:]))
    res = train_arm(model, arm, _stream(domain_b.train, cfg, cfg.seed + 1), cfg, steps=cfg.steps, lr=arm.lr,
                    schedule=cfg.schedule, out_dir=Path(cfg.run_dir) / arm.name, mesh=mesh,
                    stats=stats_layer(arm, cfg.keep_first), meta={"config": cfg.to_json()})
    return model, res


def _setup(cfg: TrainConfig) -> tuple[mesh_lib.Mesh, Domain, Domain, Path]:
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
    return mesh, domain_a, domain_b, run_dir


def _choice_task(cfg: TrainConfig, domain_a: Domain) -> ev.ChoiceTask:
    return ev.build_choice_task(domain_a.val, n_items=cfg.mc_items, context_len=cfg.seq_len // 2 + cfg.seq_len // 4,
                                continuation_len=max(cfg.seq_len // 4, 2), seed=cfg.seed)


def run(cfg: TrainConfig) -> list[dict[str, Any]]:
    """The job `cfg` asks for: a real checkpoint (`train.real_qat`), the fouroversix pretraining grid, or
    continued pretraining of the byte-level model (the demo's three arms or the paper's grid)."""
    if cfg.model is not None:
        from . import real_qat

        return real_qat.run(cfg)
    try:
        if cfg.grid == "fouroversix":
            return run_fouroversix(cfg)
        return run_continued(cfg)
    except RuleError as e:
        raise SystemExit(f"error: {e}") from e


def run_continued(cfg: TrainConfig) -> list[dict[str, Any]]:
    """Pretrain on domain A (cached), continue on domain B in every arm, evaluate, print the table, report."""
    t0 = time.perf_counter()
    mesh, domain_a, domain_b, run_dir = _setup(cfg)
    params, pre = pretrain(cfg, domain_a, mesh)
    task = _choice_task(cfg, domain_a)

    base = _new_model(cfg)
    nnx.update(base, params)
    start_row = {"arm": "pretrained (start)", **evaluate(base, cfg, domain_a, domain_b, task),
                 "wall_s": None if pre["cached"] else pre["wall_s"]}
    log.info("pretrained model: domain-B val loss %.4f, domain-A val loss %.4f", start_row["val_loss_b"],
             start_row["val_loss_a"])
    arms = []
    specs = arm_specs(cfg)
    for arm in specs:
        done = finished_arm(run_dir / arm.name, cfg) if cfg.resume else None
        if done is not None:
            log.info("arm %s finished earlier: reused (%s)", arm.name, run_dir / arm.name)
            arms.append(done)
            continue
        t_arm = time.perf_counter()
        log.info("arm %s (%s): %d steps on domain B", arm.name, arm.label, cfg.steps)
        model, res = run_arm(cfg, arm, params, domain_b, mesh)
        metrics = evaluate(model, cfg, domain_a, domain_b, task)
        wall = time.perf_counter() - t_arm
        log.info("arm %s done in %.0f s (training %.0f s, %d skipped steps): domain-B val loss %.4f, domain-A "
                 "val loss %.4f", arm.name, wall, res.wall_s, int(res.state.skipped), metrics["val_loss_b"],
                 metrics["val_loss_a"])
        entry = {"name": arm.name, "label": arm.label, "dir": str(run_dir / arm.name), **metrics, "wall_s": wall}
        if cfg.grid is not None:
            entry |= {"baseline": arm.baseline, "lr": arm.lr, "role": arm.role}
            record_arm(run_dir / arm.name, cfg, entry)
        arms.append(entry)
    baseline = "hp" if "hp" in cfg.arms else None
    columns = GRID_COLUMNS if cfg.grid is not None else None
    rows = [start_row, *summary_rows(arms, baseline=baseline)]
    total = time.perf_counter() - t0
    print(format_table(rows) if columns is None else format_table(rows, columns=columns))
    pre_s = "reused from cache" if pre["cached"] else f"{pre['wall_s']:.0f} s"
    print(f"total wall time {total:.0f} s (pretraining: {pre_s})")
    if jax.process_index() == 0:
        layer = _stats_layer(cfg)
        extra = {}
        if cfg.grid is not None:
            extra = dict(columns=columns, notes=grid_notes(rows, arms, specs),
                         title="The Max-Window paper's grid: HiF8 W8A8 QAT, continued pretraining report")
        path = write_report(run_dir, arms, rows=rows, baseline=baseline, config=cfg.to_json(), total_wall_s=total,
                            amax_layer=layer, **extra)
        (run_dir / "results.json").write_text(json.dumps({"rows": rows, "total_wall_s": total}, indent=1))
        print(f"report: {path}")
    return rows


def run_fouroversix(cfg: TrainConfig) -> list[dict[str, Any]]:
    """Pretrain the byte-level model from scratch on domain A in every arm (`train.grid`: high precision, and
    NVFP4 training with the static_6 and Four Over Six block rules): same initialisation, data order and seed;
    evaluate, print the table (final loss gap to high precision per rule) and write the report."""
    t0 = time.perf_counter()
    mesh, domain_a, domain_b, run_dir = _setup(cfg)
    task = _choice_task(cfg, domain_a)
    arms = []
    for arm in arm_specs(cfg):
        t_arm = time.perf_counter()
        log.info("arm %s (%s): %d pretraining steps on domain A", arm.name, arm.label, cfg.pretrain_steps)
        model = _new_model(cfg)
        report = quantize_arm(model, arm, keep_first=0, keep_last=0, seed=cfg.seed)
        if report is not None:
            log.info("arm %s: %s", arm.name, "; ".join(str(report).splitlines()[-2:]))
        res = train_arm(model, arm, _stream(domain_a.train, cfg, cfg.seed), cfg, steps=cfg.pretrain_steps,
                        lr=arm.lr, schedule="cosine", out_dir=run_dir / arm.name, mesh=mesh,
                        stats=stats_layer(arm, 0), meta={"config": cfg.to_json()})
        metrics = evaluate(model, cfg, domain_a, domain_b, task)
        wall = time.perf_counter() - t_arm
        log.info("arm %s done in %.0f s (%d skipped steps): domain-A val loss %.4f", arm.name, wall,
                 int(res.state.skipped), metrics["val_loss_a"])
        arms.append({"name": arm.name, "label": arm.label, "dir": str(run_dir / arm.name), **metrics,
                     "wall_s": wall, "baseline": arm.baseline, "skipped": int(res.state.skipped)})
    rows = add_final_gaps(summary_rows(arms, baseline="hp" if "hp" in cfg.arms else None), arms)
    total = time.perf_counter() - t0
    print(format_table(rows, columns=PRETRAIN_COLUMNS))
    print(f"total wall time {total:.0f} s")
    if jax.process_index() == 0:
        path = write_report(run_dir, arms, rows=rows, baseline="hp" if "hp" in cfg.arms else None,
                            config=cfg.to_json(), total_wall_s=total, columns=PRETRAIN_COLUMNS,
                            notes=fouroversix_notes(rows, arms),
                            title="NVFP4 pretraining from scratch: static_6 vs Four Over Six vs high precision",
                            loss_title="pretraining on domain A")
        (run_dir / "results.json").write_text(json.dumps({"rows": rows, "total_wall_s": total}, indent=1))
        print(f"report: {path}")
    return rows


# `python -m train <name> ...` runs the subcommand module's `main(argv)`; without a subcommand, the demo job.
# (module names relative to this package: it is `train` in the checkout and `jaxlowfp_train` when installed)
SUBCOMMANDS: dict[str, str] = {
    "eval": ".eval_cli",
    "generate": ".generate_cli",
    "ptq": ".ptq_cli",
    "stream": ".stream_cli",
    "tasks": ".tasks_cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    gc.set_threshold(*GC_THRESHOLD)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]], _PACKAGE).main(argv[1:])
    cfg = parse_args(argv)
    mesh_lib.initialize_distributed()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    for name in (_PACKAGE, f"{_PACKAGE}.loop", f"{_PACKAGE}.checkpoint"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)
        logging.getLogger(name).propagate = False
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
