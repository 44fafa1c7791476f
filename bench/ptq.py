"""PTQ wall time per method on SmolLM2-135M, and the run-time cost of fake-quantized W4A4 evaluation.

1. One calibration pass (`jaxlowfp.ptq.collect`: Hessians, activation maxima, AWQ samples of the 210 attention and
   MLP projections), then `jaxlowfp.ptq.quantize_model(..., stats=...)` of the whole model per method (RTN, GPTQ,
   SmoothQuant, AWQ) to NVFP4 4/6 (mse) W4A4, on a fresh copy each time; the first call of a method includes the
   compilation of its jitted pieces (`--repeat 2` also times a second, warm call).
2. The jitted forward pass ([batch, seq] tokens -> logits) of the high-precision model against the same model with
   W4A4 fake quantization (activations quantized at run time with their current amax; the weights are already
   quantized and cost nothing extra), per format, calls interleaved so machine load hits all alike.

Writes the `## PTQ (SmolLM2-135M)` section of bench/RESULTS.md.

    .venv/bin/python bench/ptq.py [--calib-seqs 8] [--calib-len 256] [--batch 4] [--seq 256] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from _results import machine, markdown_table, write_section
from jaxlowfp import ptq
from jaxlowfp.ptq.calibrate import linear_modules
from jaxlowfp.models import load
from train.ptq_cli import LAYERS, calibration_tokens

METHODS = ("rtn", "gptq", "smoothquant", "awq")
FORMATS = ("nvfp4-static_6", "nvfp4-mse", "mxfp4", "hif8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib-seqs", type=int, default=8)
    ap.add_argument("--calib-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=1, choices=(1, 2), help="PTQ calls per method (2: also warm)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args()

    model, tok = load("smollm2-135m", dtype="float32")
    graphdef, hp_state = nnx.split(model)
    layers = [p for p in linear_modules(model) if ptq.Rule(path=LAYERS, scheme=None).matches(p)]
    calib = calibration_tokens(tok, args.calib_seqs, args.calib_len)
    batches = [calib[i:i + 4] for i in range(0, len(calib), 4)]
    t = time.perf_counter()
    stats = ptq.collect(model, layers, batches, hessian=True, samples_per_batch=-(-512 // len(batches)),
                        progress=False)
    calib_s = time.perf_counter() - t
    rule = [ptq.Rule(path=LAYERS, scheme=ptq.scheme("nvfp4-mse"))]
    rows = []
    for method in METHODS:
        times = []
        for _ in range(args.repeat):
            m = nnx.merge(graphdef, hp_state, copy=True)
            t = time.perf_counter()
            ptq.quantize_model(m, rule, method=method, stats=stats, progress=False)
            times.append(time.perf_counter() - t)
        warm = f"{times[1]:.1f}" if len(times) > 1 else "-"
        rows.append([method, f"{times[0]:.1f}", warm, f"{1000 * times[-1] / len(layers):.0f}"])
        print(rows[-1], flush=True)

    x = jnp.zeros((args.batch, args.seq), jnp.int32)
    fwd = jax.jit(lambda g, s, x: nnx.merge(g, s)(x), static_argnums=0)
    variants = {"high precision": (graphdef, hp_state)}
    for fmt in FORMATS:
        m = nnx.merge(graphdef, hp_state, copy=True)
        ptq.quantize_model(m, [ptq.Rule(path=LAYERS, scheme=ptq.scheme(fmt))], method="rtn", progress=False)
        variants[f"W4A4 {fmt}" if fmt != "hif8" else "W8A8 hif8"] = nnx.split(m)
    for g, s in variants.values():  # compile and warm up
        jax.block_until_ready(fwd(g, s, x))
    samples = {k: [] for k in variants}
    for _ in range(args.reps):
        for k, (g, s) in variants.items():
            t = time.perf_counter()
            jax.block_until_ready(fwd(g, s, x))
            samples[k].append(time.perf_counter() - t)
    hp = statistics.median(samples["high precision"])
    fwd_rows = [[k, f"{1000 * statistics.median(v):.0f}", f"{statistics.median(v) / hp:.2f}x"]
                for k, v in samples.items()]
    for r in fwd_rows:
        print(r)

    loadavg = os.getloadavg()[0]
    body = "\n\n".join([
        f"`bench/ptq.py` on {machine()}: SmolLM2-135M (float32), the {len(layers)} attention and MLP projections, "
        f"NVFP4 4/6 (mse) W4A4. One calibration pass of {args.calib_seqs} x {args.calib_len} tokens (Hessians, "
        f"activation maxima and AWQ samples of every layer) took {calib_s:.0f} s and is shared by the methods.",
        markdown_table(["method", "PTQ s (first call, compiles)", "PTQ s (warm call)", "ms per layer"], rows),
        f"Forward pass of [{args.batch}, {args.seq}] tokens, jitted, median of {args.reps} interleaved calls "
        f"(activations fake-quantized at run time with their current per-tensor amax; weights pre-quantized):",
        markdown_table(["model", "ms", "vs high precision"], fwd_rows),
        f"Load average at the end of the run: {loadavg:.1f} on {os.cpu_count()} cores"
        + (" (a shared machine: these timings, the forward ratios most, are dominated by contention)."
           if loadavg > 1.5 * (os.cpu_count() or 1) else "."),
    ])
    if not args.no_write:
        write_section("PTQ (SmolLM2-135M)", body)
    print(body)


if __name__ == "__main__":
    main()
