"""Step time of QAT on a mixture-of-experts decoder (issue 29): the train step of `jaxlowfp.training.make_step` on a
Qwen3-MoE-shaped `jaxlowfp.models.moe.MoEDecoder` (random weights), high precision against HiF8 W8A8 and NVFP4
W4A4 Four Over Six (MSE) on every expert weight, whose grouped GEMMs run as `jaxlowfp.ops.ragged_dot` (per-expert
scales). Calls interleaved so machine load hits every variant alike; median wall time. Writes the
``## MoE QAT step`` section of bench/RESULTS.md.

    .venv/bin/python bench/moe_qat_step.py [--experts 8] [--top-k 2] [--d-model 128] [--d-expert 256]
                                           [--layers 2] [--batch-size 8] [--seq-len 64] [--reps 5]

On CPU JAX lowers ``ragged_dot`` to a dense masked dot over all experts, so the expert GEMMs cost E / k times their
routed FLOPs on every variant (`bench/moe_experts.py`); the ratios here are what the quantizers add on top.
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
import optax
from flax import nnx

from _results import machine, markdown_table, write_section
from jaxlowfp import qat, qnnx, training
from jaxlowfp.models.llama import loss_fn
from jaxlowfp.models.moe import MoEConfig, MoEDecoder

EXPERTS = r"blocks/\d+/mlp/experts/(gate|up|down)_proj"
RECIPES = {"hp": None, "hif8": qat.hif8_w8a8(), "nvfp4_4over6": qat.nvfp4_w4a4("mse")}


def build(cfg: MoEConfig, variant: str, tx):
    model = MoEDecoder(cfg, rngs=nnx.Rngs(0))
    if RECIPES[variant] is not None:
        report = qnnx.quantize_model(model, [qnnx.Rule(path=EXPERTS, recipe=RECIPES[variant])])
        assert report.quantized, "no expert weight matched"
    graphdef, state = training.init(model, tx)
    return jax.jit(training.make_step(graphdef, tx, loss_fn)), state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-expert", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    cfg = MoEConfig(vocab=256, d_model=args.d_model, n_layers=args.layers, n_heads=4, n_kv_heads=2,
                    d_ff=args.d_expert, max_seq_len=max(128, args.seq_len), qk_norm=True, dtype="float32",
                    n_experts=args.experts, n_experts_per_tok=args.top_k, d_expert=args.d_expert)
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (args.batch_size, args.seq_len + 1)), jnp.int32)
    tx = optax.adamw(1e-5)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    fns = {v: build(cfg, v, tx) for v in RECIPES}
    states = {}
    for v, (step, state) in fns.items():  # compile, then one more step
        for _ in range(2):
            state, metrics = step(state, batch)
        assert np.isfinite(float(metrics["loss"])), (v, metrics["loss"])
        states[v] = state
    compile_s = time.perf_counter() - t0
    times: dict[str, list[float]] = {v: [] for v in RECIPES}
    for _ in range(args.reps):
        for v, (step, _) in fns.items():
            t = time.perf_counter()
            states[v], metrics = jax.block_until_ready(step(states[v], batch))
            times[v].append(time.perf_counter() - t)
    ms = {v: 1e3 * statistics.median(ts) for v, ts in times.items()}
    rows = [[v, f"{ms[v]:.1f}", f"{ms[v] / ms['hp']:.2f}x"] for v in RECIPES]
    cmd = "`.venv/bin/python bench/moe_qat_step.py" + "".join(" " + a for a in sys.argv[1:]) + "`"
    body = (f"{cmd} on {machine()} (load average {load:.1f} at start; compile and warm-up {compile_s:.0f} s). "
            f"Qwen3-MoE-shaped decoder, random weights: {args.layers} layers, d_model {args.d_model}, {args.experts} "
            f"experts of width {args.d_expert}, top-{args.top_k}, {cfg.num_params() / 1e6:.2f} M parameters; batch "
            f"{args.batch_size} x {args.seq_len} tokens; median of {args.reps} interleaved steps of the full train "
            "step (forward, backward, AdamW, non-finite guard). Quantized: every expert weight (gate / up / down, "
            "per-expert delayed scaling for HiF8, per-expert current scaling for NVFP4), router and attention "
            "in high precision. On CPU `ragged_dot` is a masked dense dot over all experts.\n\n"
            + markdown_table(["variant", "ms/step", "vs HP"], rows))
    print(body)
    if not args.no_write:
        write_section("MoE QAT step", body)


if __name__ == "__main__":
    main()
