"""Host peak memory, per-device bytes and codes of GPTQ NVFP4 4/6 of a tiny Llama, unsharded and on 2 / 4 / 8 devices.

    PYTHONPATH=. .venv/bin/python bench/sharded_ptq.py [--layers 2 --d-model 256 --d-ff 1024 --rows 8]

Each configuration runs in a fresh interpreter with 8 simulated CPU devices (``jax_num_cpu_devices``), so one
row's allocations cannot hide another's. For each mesh (none, then ``fsdp=n/2, tensor=2`` over the first n
devices) a random ``Llama`` (vocabulary 96) is placed by `jaxlowfp.sharding.llama_rules` and quantized by GPTQ to
NVFP4 4/6 (mse, W4A16) on every projection (sequential calibration, ``rows`` x 32 random tokens, rows over the data
axes), under ``tracemalloc`` (numpy and Python allocations of the host; device buffers and XLA's host buffers are
not counted). Reports the model's largest per-device bytes, the host peak, the process's resident set before
`quantize_model` (``VmRSS``, the model already placed) and its peak (``ru_maxrss``; on simulated devices a
device's memory is host memory, so this counts every device's buffers too), the statistics + activations
`PTQResult.peak_stats_bytes` held at once, the wall time, and how many codes / scale bytes differ from the unsharded
run's, per block. A control row ("1p") quantizes the unsharded model on the same calibration rows in another order:
the codes that summation order alone moves. ``--pipeline one-pass`` takes every layer's statistics from the float
model, so a difference in one block cannot change the next block's inputs.
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import jax
import numpy as np


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024


def _row(name: str, args: argparse.Namespace, save: str) -> dict:
    """One configuration in this (fresh) interpreter; its codes and scale bytes go to ``save`` (.npz)."""
    import resource

    jax.config.update("jax_num_cpu_devices", 8)
    from flax import nnx

    from jaxlowfp import ptq, sharding
    from jaxlowfp.models import Llama, ModelConfig

    cfg = ModelConfig(vocab=96, d_model=args.d_model, n_layers=args.layers, n_heads=4, n_kv_heads=2,
                      d_ff=args.d_ff, max_seq_len=32)
    rules = [ptq.Rule(path=r"blocks/\d+/(attn|mlp)/\w+_proj", scheme=ptq.scheme("nvfp4-mse", weights_only=True))]
    tokens = np.random.default_rng(0).integers(0, 96, (args.rows, 32)).astype(np.int32)
    n = int(name.rstrip("p"))
    calib = tokens[np.random.default_rng(1).permutation(len(tokens))] if name.endswith("p") else tokens
    model = Llama(cfg, rngs=nnx.Rngs(0))
    mesh = None
    if n > 1:
        mesh = sharding.make_mesh(f"fsdp={n // 2},tensor=2", jax.devices()[:n])
        model = sharding.shard_model(model, mesh, sharding.llama_rules())
    per = sharding.device_bytes(model)
    jax.block_until_ready(nnx.state(model))
    before = _rss()
    tracemalloc.start()
    t = time.perf_counter()
    res = ptq.quantize_model(model, rules, method=ptq.GPTQ(), calibration=sharding.put_batch(calib, mesh),
                             pipeline=args.pipeline)
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    arrays = {f"codes:{p}": np.asarray(a.codes) for p, (a, _) in res.packed.items()}
    arrays |= {f"scales:{p}": np.asarray(a.scales).view(np.uint8) for p, (a, _) in res.packed.items()}
    np.savez(save, **arrays)
    return {"max_device_bytes": max(per.values()), "host_peak": peak, "rss_before": before, "peak_rss": peak_rss,
            "seconds": round(seconds, 1), "stats_bytes": res.peak_stats_bytes}


def _nibbles(a: np.ndarray, b: np.ndarray) -> int:
    return int(((a & 15) != (b & 15)).sum() + ((a >> 4) != (b >> 4)).sum())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--devices", default="1,1p,2,4,8",
                    help="device counts; 1 is the unsharded model, 1p the unsharded model on permuted rows")
    ap.add_argument("--pipeline", default="sequential", choices=("sequential", "one-pass"))
    ap.add_argument("--child", metavar="NPZ", help=argparse.SUPPRESS)  # run the one row in --devices, save there
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_row(args.devices, args, args.child)))
        return {}
    out: dict = {"pipeline": args.pipeline, "rows": {}}
    ref = None
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FLAGS")}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[1]), JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.devices.split(","):
            save = f"{tmp}/{name}.npz"
            cmd = [sys.executable, __file__, "--devices", name, "--child", save, "--layers", str(args.layers),
                   "--d-model", str(args.d_model), "--d-ff", str(args.d_ff), "--rows", str(args.rows),
                   "--pipeline", args.pipeline]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if proc.returncode:
                raise SystemExit(f"row {name} failed:\n{proc.stderr[-3000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            with np.load(save) as z:
                codes = {k[6:]: z[k] for k in z.files if k.startswith("codes:")}
                scales = {k[7:]: z[k] for k in z.files if k.startswith("scales:")}
            if ref is None:
                ref = (codes, scales)
            per_layer = {p: _nibbles(codes[p], ref[0][p]) for p in codes}
            by_block: dict[str, int] = {}
            for p, d in per_layer.items():
                by_block[p.split("/")[1]] = by_block.get(p.split("/")[1], 0) + d
            out["rows"][name] = row | {"codes": sum(2 * c.size for c in codes.values()),
                                       "codes_differ": sum(per_layer.values()), "codes_differ_by_block": by_block,
                                       "scales_differ": sum(int((scales[p] != ref[1][p]).sum()) for p in scales)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
