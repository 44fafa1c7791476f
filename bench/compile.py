"""Compile time of one QAT training step per recipe, side by side in one run: what a quantized operand costs XLA.

XLA inlines one quantizer per quantized operand, so a recipe's compile cost grows with the operands. The step is
`jaxlowfp.training.make_step` on the tiny 4-block Llama (`PRESETS["tiny"]`), every `*_proj` quantized (56 operands:
7 projections x 4 blocks x weight and activation), for: no quantization, HiF8 W8A8, NVFP4 W4A4 `static_6` and NVFP4
W4A4 Four Over Six (`mse`). Compile seconds are XLA's backend compile time (`jax.monitoring`), for each LLVM level
asked; StableHLO ops are the lowered step's. Writes the `## Compile` section of bench/RESULTS.md.

    .venv/bin/python bench/compile.py [--levels 0,2] [--reps 5] [--no-write]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

RECIPES = ("none", "hif8_w8a8", "nvfp4_w4a4 static_6", "nvfp4_w4a4 mse")


def _one(recipe: str, reps: int) -> dict:
    """In this process (its XLA_FLAGS set by the parent): compile seconds, StableHLO ops and warm ms of the step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from jaxlowfp import qat, qnnx, training
    from jaxlowfp.models.llama import PRESETS, Llama

    compile_s = [0.0]

    def listen(event: str, duration: float, **_) -> None:
        if event.endswith("backend_compile_duration"):
            compile_s[0] += duration

    jax.monitoring.register_event_duration_secs_listener(listen)
    model = Llama(PRESETS["tiny"], rngs=nnx.Rngs(0))
    if recipe != "none":
        name, *rule = recipe.split()
        qnnx.quantize_model(model, [qnnx.Rule(path=r".*_proj", recipe=getattr(qat, name)(*rule))])

    def loss(m, batch):
        lp = jax.nn.log_softmax(m(batch[:, :-1]).astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(lp, batch[:, 1:, None], -1)), {}

    tx = optax.adam(1e-4)
    graphdef, state = training.init(model, tx)
    step = jax.jit(training.make_step(graphdef, tx, loss))
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 200, (4, 33)), jnp.int32)
    ops = sum(1 for line in step.lower(state, batch).as_text().splitlines() if " = stablehlo." in line)
    compile_s[0] = 0.0
    state, _ = step(state, batch)
    jax.block_until_ready(state)
    seconds = compile_s[0]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
    return {"compile_s": seconds, "ops": ops, "step_ms": 1e3 * sorted(times)[len(times) // 2]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", default="0,2", help="LLVM levels (--xla_backend_optimization_level), comma-separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_one(args.child, args.reps)))
        return
    t0 = time.perf_counter()
    load = os.getloadavg()[0]
    rows = []
    for level in args.levels.split(","):
        for recipe in RECIPES:  # one fresh process each: no cache or earlier program shares the work
            env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_backend_optimization_level={level}")
            out = subprocess.run([sys.executable, __file__, "--child", recipe, "--reps", str(args.reps)], env=env,
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append([f"-O{level}", recipe, r["ops"], f"{r['compile_s']:.2f}", f"{r['step_ms']:.1f}"])
            print(rows[-1], flush=True)
    from _results import machine, markdown_table, write_section

    table = markdown_table(["LLVM level", "recipe (every *_proj)", "StableHLO ops (step)", "compile s",
                            "warm step ms (median)"], rows)
    cmd = "`.venv/bin/python bench/compile.py " + " ".join(sys.argv[1:]) + "`"
    body = (f"{cmd.replace(' `', '`')} on {machine()} (load average {load:.1f} at start; "
            f"{time.perf_counter() - t0:.0f} s).\n\n"
            "One training step of the tiny 4-block Llama (forward, backward, Adam), every projection quantized: 56 "
            "quantized operands. Compile s: XLA's backend compile of the step, in a fresh process per row. "
            "docs/limits.md says where a Four Over Six program's size comes from.\n\n" + table)
    print(body)
    if not args.no_write:
        write_section("Compile", body)


if __name__ == "__main__":
    main()
