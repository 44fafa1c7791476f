"""Throughput of the HiF8 codec on this machine, side by side in one run.

Rows: `hif8.round` and `hif8.encode` (jitted), a plain copy of the same array (numpy `copyto`, and a jitted negate:
the memory-bandwidth limits of a read-write pass), `en_dtypes` astype to hifloat8 (the oracle), and `ml_dtypes`
astype to float8_e4m3fn. Writes the table to the `## Formats (HiF8 codec)` section of bench/RESULTS.md.

    .venv/bin/python bench/formats.py [--n 4194304 16777216]
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


def measure(n: int, reps: int) -> list[list[str]]:
    rng = np.random.default_rng(0)
    x_np = (rng.standard_normal(n) * 8).astype(np.float32)
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
    secs = {k: time_call(f, a, reps=reps) for k, (f, a) in cases.items()}
    copy, jpass = secs["plain copy (numpy copyto)"], secs["plain pass (jit -x)"]
    rows = []
    for k, s in secs.items():
        rows.append([f"{n:,}", k, f"{n / s / 1e6:,.0f}", f"{s * 1e3:.1f}", f"{copy / s:.2f}", f"{jpass / s:.2f}"])
        print(f"n={n:<10,} {k:34s} {n / s / 1e6:10,.0f} M elem/s  {copy / s:5.2f} x copy  {jpass / s:5.2f} x jit pass")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[1 << 22, 1 << 24], help="element counts (float32)")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    rows = [r for n in args.n for r in measure(n, args.reps)]
    body = (
        f"`.venv/bin/python bench/formats.py` on {machine()}; float32 input N(0, 8^2), median of {args.reps} runs. "
        "Goal: `hif8.round` at >= 50 % of the plain-copy bandwidth. numpy's copy writes into a preallocated buffer; "
        "every jitted call allocates its output, which dominates at 64 MB (compare with the jitted plain pass).\n\n"
        + markdown_table(["elements", "operation", "M elements/s", "ms", "vs numpy copy", "vs jit plain pass"], rows)
    )
    write_section("Formats (HiF8 codec)", body)


if __name__ == "__main__":
    main()
