"""Exhaustive check of `jaxlowfp.hif8.encode` against `en_dtypes.hifloat8` (Huawei's golden numpy dtype).

Every float32 bit pattern (2^32, in chunks, with a progress bar), and every float16 and bfloat16 pattern, with
saturate off (en_dtypes' default mode). Prints the mismatches (at most a few per chunk) and a summary line; exits 1
on any mismatch.

    .venv/bin/python bench/verify_hif8.py            # all 2^32 float32 patterns (a few minutes on 2 cores)
    .venv/bin/python bench/verify_hif8.py --chunks 16  # only the first 16 chunks of 2^24 (a quick look)
"""
from __future__ import annotations

import argparse
import sys
import time

import en_dtypes
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm import tqdm

from _results import machine, write_section
from jaxlowfp import hif8

CHUNK = 1 << 24


def oracle(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(np.float32).astype(en_dtypes.hifloat8).view(np.uint8)


def report(name: str, x: np.ndarray, got: np.ndarray, want: np.ndarray) -> int:
    bad = np.flatnonzero(got != want)
    for i in bad[:5]:
        bits = x.view(np.uint16 if x.itemsize == 2 else np.uint32)[i]
        print(f"  MISMATCH {name}: bits=0x{int(bits):0{2 * x.itemsize}x} x={x[i]!r} ours=0x{got[i]:02x} "
              f"en_dtypes=0x{want[i]:02x}")
    return int(bad.size)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=(1 << 32) // CHUNK, help="number of 2^24-pattern float32 chunks")
    args = ap.parse_args()
    encode = jax.jit(hif8.encode)
    t0 = time.time()
    total = 0
    for dtype, name in ((np.float16, "float16"), (ml_dtypes.bfloat16, "bfloat16")):
        x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)
        n = report(name, x, np.asarray(encode(jnp.asarray(x))), oracle(x))
        print(f"{name}: all 65536 patterns, {n} mismatches")
        total += n
    f32_bad = 0
    checked = 0
    for c in tqdm(range(args.chunks), desc="float32 chunks of 2^24", unit="chunk"):
        bits = np.arange(c * CHUNK, (c + 1) * CHUNK, dtype=np.uint64).astype(np.uint32)
        x = bits.view(np.float32)
        f32_bad += report("float32", x, np.asarray(encode(x)), oracle(x))
        checked += x.size
    total += f32_bad
    print(f"float32: {checked} of {1 << 32} patterns checked, {f32_bad} mismatches")
    summary = f"TOTAL mismatches: {total}  ({time.time() - t0:.0f} s, jax {jax.__version__}, en_dtypes 0.0.4)"
    print(summary)
    if checked == 1 << 32:
        write_section("HiF8 exhaustive verification", (
            f"`.venv/bin/python bench/verify_hif8.py` on {machine()}: `jaxlowfp.hif8.encode` (jit, saturate off) vs "
            f"`en_dtypes.hifloat8` astype.\n\n- float32: all {checked} bit patterns, {f32_bad} mismatches\n"
            f"- float16 and bfloat16: all 65536 patterns each, {total - f32_bad} mismatches\n- {summary}"))
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
