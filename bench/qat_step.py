"""Step time of the HiF8 W8A8 QAT train step against the high-precision step, side by side in one run.

The very step `python -m train` runs (`jaxlowfp.training.make_step`: forward, backward, AdamW, non-finite guard,
telemetry), for the demo model ("small") and a larger one, in three variants: high precision; HiF8 W8A8 QAT
(MLP projections of the middle blocks, `max_window` 64, as `paper_rules` selects them); the same model in its
observe-only warmup. HP and QAT calls are interleaved so machine load hits both alike. Goal: QAT <= 1.15x HP.
Writes the `## QAT step` section of bench/RESULTS.md.

    .venv/bin/python bench/qat_step.py [--sizes small,medium] [--batch-size 16] [--seq-len 128] [--reps 10]
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
from jaxlowfp.qnnx import paper_rules, quantize_model
from jaxlowfp.qat import Warmup, hif8_w8a8
from jaxlowfp import training
from train.loop import make_optimizer, make_schedule
from jaxlowfp.models.llama import PRESETS, Llama, ModelConfig, loss_fn

SIZES = {
    "small": PRESETS["small"],  # the demo model
    "medium": ModelConfig(d_model=256, n_layers=6, n_heads=8, n_kv_heads=4, d_ff=768, max_seq_len=256),
    "base": PRESETS["base"],  # GPUs
}


def build(cfg: ModelConfig, variant: str, tx, schedule):
    model = Llama(cfg, rngs=nnx.Rngs(0))
    warmup = None
    if variant != "hp":
        quantize_model(model, paper_rules(cfg.n_layers, keep_first=1, keep_last=1, recipe=hif8_w8a8()))
        warmup = Warmup(steps=10**9) if variant == "observe" else None
    graphdef, state = training.init(model, tx)
    step = jax.jit(training.make_step(graphdef, tx, loss_fn, warmup=warmup, lr_schedule=schedule))
    return step, state


def bench_size(name: str, cfg: ModelConfig, batch: jax.Array, reps: int) -> dict:
    schedule = make_schedule(1e-4)
    tx = make_optimizer(schedule)
    variants = ("hp", "qat", "observe")
    fns = {v: build(cfg, v, tx, schedule) for v in variants}
    t0 = time.perf_counter()
    for v in variants:  # compile and warm up
        step, state = fns[v]
        for _ in range(2):
            jax.block_until_ready(step(state, batch))
    compile_s = time.perf_counter() - t0
    times = {v: [] for v in variants}
    for _ in range(reps):  # interleaved
        for v in variants:
            step, state = fns[v]
            t = time.perf_counter()
            jax.block_until_ready(step(state, batch))
            times[v].append(time.perf_counter() - t)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    tokens = batch.shape[0] * (batch.shape[1] - 1)
    n_params = cfg.num_params()
    return {"name": name, "params": n_params, "ms": {v: 1e3 * m for v, m in med.items()},
            "tok_s": {v: tokens / m for v, m in med.items()}, "compile_s": compile_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_sizes = "small,medium" if jax.default_backend() == "cpu" else "small,medium,base"
    ap.add_argument("--sizes", default=default_sizes, help=f"comma separated, from {', '.join(SIZES)}")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        ap.error(f"unknown size(s) {bad}; allowed: {', '.join(SIZES)}")
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(0, 256, (args.batch_size, args.seq_len + 1)), jnp.int32)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    results = [bench_size(s, SIZES[s], batch, args.reps) for s in sizes]
    rows = []
    for r in results:
        ms = r["ms"]
        rows.append([r["name"], f"{r['params'] / 1e6:.1f} M", f"{ms['hp']:.1f}", f"{ms['qat']:.1f}",
                     f"{ms['qat'] / ms['hp']:.2f}x", f"{ms['observe']:.1f}", f"{ms['observe'] / ms['hp']:.2f}x",
                     f"{r['tok_s']['hp']:.0f}", f"{r['tok_s']['qat']:.0f}"])
    table = markdown_table(["model", "params", "HP ms/step", "QAT ms/step", "QAT / HP", "observe-only ms/step",
                            "observe / HP", "HP tok/s", "QAT tok/s"], rows)
    cmd = "`.venv/bin/python bench/qat_step.py " + " ".join(sys.argv[1:]) + "`"
    body = (
        f"{cmd.replace(' `', '`')} on {machine()}; batch {args.batch_size} x {args.seq_len} bytes, median of "
        f"{args.reps} interleaved steps (load average {load:.1f} at start; {time.perf_counter() - t0:.0f} s).\n\n"
        "The full train step of `train.loop` (forward, backward, AdamW, non-finite guard, telemetry). QAT: HiF8 "
        "W8A8 with `max_window` 64 delayed scaling on the MLP projections of the middle blocks (`paper_rules`, "
        "keep first 1 and last 1); observe-only: the same model during its warmup (amax recorded, nothing "
        "quantized). Goal: QAT <= 1.15x HP.\n\n" + table
    )
    print(body)
    if not args.no_write:
        write_section("QAT step", body)


if __name__ == "__main__":
    main()
