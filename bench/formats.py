"""Throughput of the HiF8 codec on this machine, side by side in one run.

Rows: `hif8.round` and `hif8.encode` (jitted), a plain copy of the same array (numpy `copyto`, and a jitted negate:
the memory-bandwidth limits of a read-write pass), `en_dtypes` astype to hifloat8 (the oracle), and `ml_dtypes`
astype to float8_e4m3fn. Writes the table to the `## Formats (HiF8 codec)` section of bench/RESULTS.md.

    .venv/bin/python bench/formats.py [--n 4194304]
"""
from __future__ import annotations

import argparse

import en_dtypes
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from _results import machine, markdown_table, time_call, write_section
from jaxlowfp import hif8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 22, help="elements (float32)")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    x_np = (rng.standard_normal(args.n) * 8).astype(np.float32)
    x = jnp.asarray(x_np)
    out_np = np.empty_like(x_np)

    cases = {
        "plain copy (numpy copyto)": (lambda a: np.copyto(out_np, a), x_np),
        "plain pass (jit -x)": (jax.jit(jnp.negative), x),
        "jaxlowfp hif8.round (jit)": (jax.jit(hif8.round), x),
        "jaxlowfp hif8.encode (jit)": (jax.jit(hif8.encode), x),
        "en_dtypes astype hifloat8": (lambda a: a.astype(en_dtypes.hifloat8), x_np),
        "ml_dtypes astype float8_e4m3fn": (lambda a: a.astype(ml_dtypes.float8_e4m3fn), x_np),
    }
    secs = {k: time_call(f, a, reps=args.reps) for k, (f, a) in cases.items()}
    copy = secs["plain copy (numpy copyto)"]
    rows = []
    for k, s in secs.items():
        rows.append([k, f"{args.n / s / 1e6:,.0f}", f"{s * 1e3:.1f}", f"{copy / s:.2f}"])
        print(f"{k:34s} {args.n / s / 1e6:10,.0f} M elem/s  {s * 1e3:8.1f} ms  {copy / s:5.2f} x copy")
    body = (
        f"`.venv/bin/python bench/formats.py --n {args.n}` on {machine()}; float32 input N(0, 8^2), median of "
        f"{args.reps} runs. Goal: `hif8.round` at >= 50 % of the plain-copy bandwidth.\n\n"
        + markdown_table(["operation", "M elements/s", "ms", "fraction of copy"], rows)
    )
    write_section("Formats (HiF8 codec)", body)


if __name__ == "__main__":
    main()
