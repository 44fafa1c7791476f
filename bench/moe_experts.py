"""One mixture-of-experts layer's experts (`jaxlowfp.models.moe.Experts`) on this machine: the ``jax.lax.ragged_dot``
path (tokens sorted by expert, three grouped GEMMs) against the dense reference (every token through every expert,
E times the work), and, as the floor a true grouped GEMM could reach, the same three GEMMs on the ``N * k`` sorted
rows with a single expert's weights (plain ``jnp.dot``: the FLOPs of the routed work and nothing else). Calls
interleaved; median wall time. Writes the ``## MoE experts (ragged_dot vs dense)`` section of bench/RESULTS.md.

    .venv/bin/python bench/moe_experts.py [--experts 16] [--top-k 2] [--d-model 256] [--d-expert 512]
                                          [--tokens 1024] [--reps 5] [--dtype float32]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from _results import machine, markdown_table, write_section
from jaxlowfp.models.moe import Experts, route


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-expert", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args()
    load_avg = os.getloadavg()[0]
    e, k, d, f, n = args.experts, args.top_k, args.d_model, args.d_expert, args.tokens
    dt = jnp.dtype(args.dtype)
    ex = Experts(e, d, f, dt, jnp.float32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (n, d), jnp.float32)
    weights, experts = route(jax.random.normal(jax.random.key(2), (n, e)), k, True)

    def floor(m, x, w, sel):  # the routed FLOPs with one expert's weights: no grouping, no masking
        xs = x[jnp.argsort(sel.reshape(-1)) // k].astype(dt)
        g = jnp.dot(xs, m.gate_proj[0].astype(dt))
        h = nnx.silu(g) * jnp.dot(xs, m.up_proj[0].astype(dt))
        y = jnp.dot(h, m.down_proj[0].astype(dt)).reshape(n, k, d).astype(jnp.float32)
        return jnp.einsum("nk,nkd->nd", w, y)

    fns = {"ragged_dot": jax.jit(lambda m, x, w, s: m(x, w, s, "ragged")),
           "dense reference": jax.jit(lambda m, x, w, s: m(x, w, s, "dense")),
           "floor (one expert's GEMMs on N*k rows)": jax.jit(floor)}
    for fn in fns.values():
        for _ in range(2):
            jax.block_until_ready(fn(ex, x, weights, experts))
    times = {name: [] for name in fns}
    for _ in range(args.reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(ex, x, weights, experts))
            times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    routed = 3 * 2 * n * k * d * f  # FLOPs of the routed work
    rows = [[name, f"{1e3 * m:.1f}", f"{n / m:.0f}", f"{routed / m / 1e9:.1f}", f"{m / med['ragged_dot']:.2f}x"]
            for name, m in med.items()]
    table = markdown_table(["experts", "ms", "tokens/s", "routed GFLOP/s", "vs ragged_dot"], rows)
    cmd = "`.venv/bin/python bench/moe_experts.py" + "".join(" " + a for a in sys.argv[1:]) + "`"
    body = (
        f"{cmd} on {machine()}; {n} tokens, {e} experts of {d} -> {f} -> {d} (SwiGLU), top-{k}, compute "
        f"{args.dtype}; median of {args.reps} interleaved calls (load average {load_avg:.1f} at start).\n\n"
        "`ragged_dot` is `jaxlowfp.models.moe.Experts` as the models run it; the dense reference does E/k times "
        "the routed work; the floor is the routed FLOPs as plain GEMMs. On CPU, `ragged_dot` costs about what the "
        "dense reference costs: JAX's default lowering (`_ragged_dot_general_impl` in jax/_src/lax/lax.py, used "
        "for every platform but GPU and TPU, which lower to XLA's `chlo.ragged_dot`) broadcasts the rows to every "
        "group, masks them, and runs a batched dot: E/k times the routed work plus the mask. Not measured on a "
        "GPU.\n\n" + table
    )
    print(body)
    if not args.no_write:
        write_section("MoE experts (ragged_dot vs dense)", body)


if __name__ == "__main__":
    main()
