"""Per-byte and per-flop costs of the host-side steps of loading and GPTQ on this machine, for docs/sharding.md.

    PYTHONPATH=. .venv/bin/python bench/per_byte_costs.py [--mib 256] [--n 2048] [--no-write]

* safetensors: ``safe_open(...).get_slice(name)[rows]`` of a bfloat16 tensor converted to float32, as
  `jaxlowfp.models.hf_loader` reads a shard (MiB of checkpoint bytes per second, one thread);
* GGUF Q4_1: ``gguf.quants.dequantize`` of rows of a memory-mapped tensor, as `jaxlowfp.models.gguf_loader`
  reads a shard (MiB of file bytes per second);
* GPTQ's host factorization (`jaxlowfp.ptq.gptq._inverse_cholesky`: the damped Hessian's Cholesky factor and its
  inverse by a triangular solve, float64, LAPACK through numpy / scipy) of an ``n x n`` matrix, as GFLOP/s counting
  ``n^3 / 3 + n^3``.

Each is timed on files in a temporary directory (the page cache warm: a second read), median of 3. Writes the
``## Per-byte costs (host side)`` section of bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _median(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="tensor size in MiB of checkpoint bytes")
    ap.add_argument("--n", type=int, default=2048, help="Hessian size for the factorization")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    import gguf
    from _results import markdown_table, write_section
    from safetensors import safe_open

    rng = np.random.default_rng(0)
    cols = 4096
    rows = args.mib * 2**20 // (2 * cols)
    rows_q = args.mib * 2**20 // (cols // 32 * 20)
    with tempfile.TemporaryDirectory() as tmp:
        w = rng.standard_normal((rows, cols), np.float32).astype(ml_dtypes.bfloat16)
        from safetensors.numpy import save_file
        save_file({"w": w}, f"{tmp}/w.safetensors")
        del w

        def read_st():
            with safe_open(f"{tmp}/w.safetensors", framework="numpy") as f:
                np.asarray(f.get_slice("w")[0:rows], np.float32)

        st = _median(read_st)
        q = gguf.quants.quantize(rng.standard_normal((rows_q, cols), np.float32), gguf.GGMLQuantizationType.Q4_1)
        q.tofile(f"{tmp}/q.bin")
        del q
        mm = np.memmap(f"{tmp}/q.bin", np.uint8, "r", shape=(rows_q, cols // 32 * 20))
        gg = _median(lambda: gguf.quants.dequantize(np.ascontiguousarray(mm[:]), gguf.GGMLQuantizationType.Q4_1))
    a = rng.standard_normal((args.n, args.n))
    h = a @ a.T + np.eye(args.n)

    from jaxlowfp.ptq.gptq import _inverse_cholesky

    fac = _median(lambda: _inverse_cholesky(h, 0.01))
    flops = args.n**3 / 3 + args.n**3
    rows_out = [["safetensors bf16 -> float32 (get_slice)", f"{args.mib} MiB", f"{st:.2f} s",
                 f"{args.mib / st:.0f} MiB/s"],
                ["GGUF Q4_1 -> float32 (memmap rows, gguf dequantize)", f"{args.mib} MiB", f"{gg:.2f} s",
                 f"{args.mib / gg:.0f} MiB/s"],
                [f"GPTQ host factorization, float64 n={args.n}", f"{flops / 1e9:.0f} GFLOP", f"{fac:.2f} s",
                 f"{flops / fac / 1e9:.1f} GFLOP/s"]]
    body = (f"`PYTHONPATH=. .venv/bin/python bench/per_byte_costs.py --mib {args.mib} --n {args.n}` on x86_64 with "
            f"{os.cpu_count()} CPU cores shared with other jobs (load average {os.getloadavg()[0]:.1f} at the end), "
            "numpy " + np.__version__ + ": one thread of Python reading, the factorization on numpy's LAPACK; median "
            "of 3 after one warm-up (page cache warm). docs/sharding.md extrapolates from these.\n\n"
            + markdown_table(["step", "size", "s", "rate"], rows_out))
    print(body)
    if not args.no_write:
        write_section("Per-byte costs (host side)", body)


if __name__ == "__main__":
    main()
