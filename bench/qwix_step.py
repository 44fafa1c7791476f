"""Train-step time of the Qwix-provider path against our own QAT path and high precision, on the same model.

The demo Llama ("small") and a larger one, trained with `jaxlowfp.training.make_step` (forward, backward, AdamW,
non-finite guard, telemetry) in four variants: high precision; our QAT (`qnnx.quantize_model`: the MLP projections of
the middle blocks become `QuantLinear`, as `paper_rules` selects them); the same selection quantized by interception
(`qwix.quantize_model` with `jaxlowfp.qwix_provider.RecipeProvider`, the rules' regexes as `module_path`); and, for
the recipe NVFP4 4/6, both paths again. Calls are interleaved so machine load hits all variants alike. Both paths
run the same `jaxlowfp.qat` op, so the provider should cost what our layers cost (the interception happens at
trace time only). Writes the `## Qwix provider step` section of bench/RESULTS.md.

    .venv/bin/python bench/qwix_step.py [--sizes small,medium] [--batch-size 16] [--seq-len 128] [--reps 10]
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
import qwix
from flax import nnx

from _results import machine, markdown_table, write_section
from jaxlowfp import qat, training
from jaxlowfp.models.llama import PRESETS, Llama, ModelConfig, loss_fn
from jaxlowfp.qnnx import paper_rules, quantize_model
from jaxlowfp.qwix_provider import RecipeProvider, RecipeRule
from train.loop import make_optimizer, make_schedule

SIZES = {
    "small": PRESETS["small"],
    "medium": ModelConfig(d_model=256, n_layers=6, n_heads=8, n_kv_heads=4, d_ff=768, max_seq_len=256),
}
RECIPES = {"hif8": qat.hif8_w8a8(), "nvfp4": qat.nvfp4_w4a4("mse")}


def build(cfg: ModelConfig, variant: str, tx, schedule, batch: jax.Array):
    """(step, state) for variant "hp", "<recipe>/ours" or "<recipe>/qwix"."""
    model = Llama(cfg, rngs=nnx.Rngs(0))
    if variant != "hp":
        recipe_name, path = variant.split("/")
        rules = paper_rules(cfg.n_layers, keep_first=1, keep_last=1, recipe=RECIPES[recipe_name])
        if path == "ours":
            quantize_model(model, rules)
        else:
            provider = RecipeProvider([RecipeRule(module_path=r.path, recipe=r.recipe) for r in rules])
            model = qwix.quantize_model(model, provider, batch[:1, :-1])
    graphdef, state = training.init(model, tx)
    step = jax.jit(training.make_step(graphdef, tx, loss_fn, lr_schedule=schedule))
    return step, state


def bench_size(name: str, cfg: ModelConfig, batch: jax.Array, reps: int, variants: tuple[str, ...]) -> dict:
    schedule = make_schedule(1e-4)
    tx = make_optimizer(schedule)
    fns = {v: build(cfg, v, tx, schedule, batch) for v in variants}
    t0 = time.perf_counter()
    for v in variants:  # compile and warm up
        step, state = fns[v]
        for _ in range(2):
            jax.block_until_ready(step(state, batch))
    compile_s = time.perf_counter() - t0
    times = {v: [] for v in variants}
    for _ in range(reps):
        for v in variants:
            step, state = fns[v]
            t = time.perf_counter()
            jax.block_until_ready(step(state, batch))
            times[v].append(time.perf_counter() - t)
    return {"name": name, "params": cfg.num_params(), "compile_s": compile_s,
            "ms": {v: 1e3 * statistics.median(ts) for v, ts in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="small,medium", help=f"comma separated, from {', '.join(SIZES)}")
    ap.add_argument("--recipes", default="hif8,nvfp4", help=f"comma separated, from {', '.join(RECIPES)}")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    for given, allowed, what in ((sizes, SIZES, "size"), (recipes, RECIPES, "recipe")):
        bad = [s for s in given if s not in allowed]
        if bad:
            ap.error(f"unknown {what}(s) {bad}; allowed: {', '.join(allowed)}")
    variants = ("hp", *(f"{r}/{p}" for r in recipes for p in ("ours", "qwix")))
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(0, 256, (args.batch_size, args.seq_len + 1)), jnp.int32)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    rows = []
    for s in sizes:
        r = bench_size(s, SIZES[s], batch, args.reps, variants)
        ms = r["ms"]
        for rec in recipes:
            ours, theirs = ms[f"{rec}/ours"], ms[f"{rec}/qwix"]
            rows.append([s, f"{r['params'] / 1e6:.1f} M", RECIPES[rec].name, f"{ms['hp']:.1f}", f"{ours:.1f}",
                         f"{theirs:.1f}", f"{ours / ms['hp']:.2f}x", f"{theirs / ms['hp']:.2f}x",
                         f"{theirs / ours:.2f}x"])
    table = markdown_table(["model", "params", "recipe", "HP ms/step", "ours ms/step", "Qwix provider ms/step",
                            "ours / HP", "provider / HP", "provider / ours"], rows)
    cmd = "`.venv/bin/python bench/qwix_step.py " + " ".join(sys.argv[1:]) + "`"
    body = (
        f"{cmd.replace(' `', '`')} on {machine()}, Qwix {qwix.__version__}; batch {args.batch_size} x "
        f"{args.seq_len} bytes, median of {args.reps} interleaved steps (load average {load:.1f} at start; "
        f"{time.perf_counter() - t0:.0f} s).\n\n"
        "The full train step of `jaxlowfp.training.make_step` on the MLP projections of the middle blocks "
        "(`paper_rules`, keep first 1 and last 1): ours = `qnnx.quantize_model` (QuantLinear), provider = "
        "`qwix.quantize_model(model, RecipeProvider(...))` with the same regexes; both run the same `jaxlowfp.qat` "
        "op (tests/test_qwix_provider.py checks they agree bit for bit).\n\n" + table
    )
    print(body)
    if not args.no_write:
        write_section("Qwix provider step", body)


if __name__ == "__main__":
    main()
