"""Step time of HiF8 W8A8 QAT against the high-precision step on a real checkpoint (SmolLM2-135M), side by side.

The step `python -m train --model smollm2-135m` runs (`jaxlowfp.training.make_step` via `train.loop`: forward,
backward, AdamW, non-finite guard, telemetry) on the loaded model in three variants: high precision; HiF8 W8A8 QAT of
the MLP projections of blocks 3..27 (`paper_rules(30, keep_first=3, keep_last=2)`, `max_window` 64); the same model
in its observe-only warmup. Calls are interleaved so machine load hits all variants alike; the CPU time of the
process is reported next to the wall time (on a shared machine the wall time also counts waiting for a core).
Goal: QAT <= 1.15x HP. Writes the `## QAT step (real model)` section of bench/RESULTS.md.

    .venv/bin/python bench/qat_step_real.py [--model smollm2-135m] [--batch-size 4] [--seq-len 128] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _results import machine, markdown_table, write_section
from jaxlowfp.qat import Warmup
from train.arms import quantize_arm
from train.config import TrainConfig, arm_specs
from train.loop import init_state, jit_train_step, make_optimizer, make_schedule
from jaxlowfp.models.llama import loss_fn
from jaxlowfp.models import load

VARIANTS = ("hp", "qat", "observe")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args()
    t_start = time.perf_counter()
    model, _ = load(args.model, dtype=args.dtype)
    vocab = model.config.vocab
    graphdef0, state0 = nnx.split(model)
    del model
    paper = next(a for a in arm_specs(TrainConfig(model=args.model)) if a.name == "paper")
    schedule = make_schedule(1e-5)
    tx = make_optimizer(schedule)
    steps, states = {}, {}
    for v in VARIANTS:
        m = nnx.merge(graphdef0, state0, copy=True)
        if v != "hp":
            quantize_arm(m, paper, keep_first=3, keep_last=2)  # SmolLM2: blocks 3..27 of 30
        graphdef, state = init_state(m, tx)
        states[v] = jax.tree.map(jnp.copy, state)  # fresh buffers: no two leaves alias
        warmup = Warmup(steps=10**9) if v == "observe" else None
        steps[v] = jit_train_step(graphdef, tx, loss_fn=loss_fn, schedule=schedule, warmup=warmup, donate=False)
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(0, vocab, (args.batch_size, args.seq_len + 1)), jnp.int32)
    load_avg = os.getloadavg()[0]
    t0 = time.perf_counter()
    for v in VARIANTS:  # compile and warm up
        jax.block_until_ready(steps[v](states[v], batch))
    compile_s = time.perf_counter() - t0
    wall = {v: [] for v in VARIANTS}
    cpu = {v: [] for v in VARIANTS}
    for _ in range(args.reps):  # interleaved
        for v in VARIANTS:
            t, c = time.perf_counter(), time.process_time()
            jax.block_until_ready(steps[v](states[v], batch))
            wall[v].append(time.perf_counter() - t)
            cpu[v].append(time.process_time() - c)
    med = {v: statistics.median(ts) for v, ts in wall.items()}
    med_cpu = {v: statistics.median(ts) for v, ts in cpu.items()}
    tokens = args.batch_size * args.seq_len
    rows = [[v, f"{1e3 * med[v]:.0f}", f"{med[v] / med['hp']:.2f}x", f"{1e3 * med_cpu[v]:.0f}",
             f"{med_cpu[v] / med_cpu['hp']:.2f}x", f"{tokens / med[v]:.0f}"] for v in VARIANTS]
    table = markdown_table(["variant", "wall ms/step", "wall / HP", "CPU ms/step", "CPU / HP", "tok/s (wall)"], rows)
    cmd = "`.venv/bin/python bench/qat_step_real.py" + "".join(" " + a for a in sys.argv[1:]) + "`"
    body = (
        f"{cmd} on {machine()}; {args.model} ({args.dtype} compute), batch {args.batch_size} x {args.seq_len} "
        f"tokens, median of {args.reps} interleaved steps (load average {load_avg:.1f} at start; compilation "
        f"{compile_s:.0f} s; {time.perf_counter() - t_start:.0f} s in all).\n\n"
        "The full train step of `train.loop` on the loaded checkpoint. QAT: HiF8 W8A8 with `max_window` 64 delayed "
        "scaling on the MLP projections of blocks 3..27 of 30 (`paper_rules(30, keep_first=3, keep_last=2)`); "
        "observe-only: the same model during its warmup. CPU ms: process CPU time per step (all threads), which a "
        "busy machine does not inflate the way it inflates wall time. Goal: QAT <= 1.15x HP.\n\n" + table
    )
    print(body)
    if not args.no_write:
        write_section("QAT step (real model)", body)


if __name__ == "__main__":
    main()
