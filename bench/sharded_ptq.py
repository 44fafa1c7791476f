"""Host peak memory, per-device bytes and codes of GPTQ NVFP4 4/6 of a tiny Llama, unsharded and on 2 / 4 / 8 devices.

    PYTHONPATH=. .venv/bin/python bench/sharded_ptq.py [--layers 2 --d-model 256 --d-ff 1024 --rows 8]

One interpreter with 8 simulated CPU devices (``jax_num_cpu_devices``). For each mesh (none, then ``fsdp=n/2,
tensor=2`` over the first n devices) a random ``Llama`` (vocabulary 96) is placed by `jaxlowfp.sharding.llama_rules`
and quantized by GPTQ to NVFP4 4/6 (mse, W4A16) on every projection (sequential calibration, ``rows`` x 32 random
tokens, rows over the data axes), under ``tracemalloc`` (numpy and Python allocations of the host; device buffers
and XLA's host buffers are not counted). Reports the model's largest per-device bytes, the host peak, the
statistics + activations `PTQResult.peak_stats_bytes` held at once, the wall time, and how many codes / scale bytes
differ from the unsharded run's, per block. A control row ("1p") quantizes the unsharded model on the same
calibration rows in another order: the codes that summation order alone moves. ``--pipeline one-pass`` takes every
layer's statistics from the float model, so a difference in one block cannot change the next block's inputs.
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc

import jax
import numpy as np


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--devices", default="1,1p,2,4,8",
                    help="device counts; 1 is the unsharded model, 1p the unsharded model on permuted rows")
    ap.add_argument("--pipeline", default="sequential", choices=("sequential", "one-pass"))
    args = ap.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)
    from flax import nnx

    from jaxlowfp import ptq, sharding
    from jaxlowfp.models import Llama, ModelConfig

    cfg = ModelConfig(vocab=96, d_model=args.d_model, n_layers=args.layers, n_heads=4, n_kv_heads=2,
                      d_ff=args.d_ff, max_seq_len=32)
    rules = [ptq.Rule(path=r"blocks/\d+/(attn|mlp)/\w+_proj", scheme=ptq.scheme("nvfp4-mse", weights_only=True))]
    tokens = np.random.default_rng(0).integers(0, 96, (args.rows, 32)).astype(np.int32)
    out: dict = {"pipeline": args.pipeline, "rows": {}}
    ref = None
    for name in args.devices.split(","):
        n = int(name.rstrip("p"))
        calib = tokens[np.random.default_rng(1).permutation(len(tokens))] if name.endswith("p") else tokens
        model = Llama(cfg, rngs=nnx.Rngs(0))
        mesh = None
        if n > 1:
            mesh = sharding.make_mesh(f"fsdp={n // 2},tensor=2", jax.devices()[:n])
            model = sharding.shard_model(model, mesh, sharding.llama_rules())
        per = sharding.device_bytes(model)
        tracemalloc.start()
        t = time.perf_counter()
        res = ptq.quantize_model(model, rules, method=ptq.GPTQ(), calibration=sharding.put_batch(calib, mesh),
                                 pipeline=args.pipeline)
        seconds = time.perf_counter() - t
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        codes = {p: np.asarray(a.codes) for p, (a, _) in res.packed.items()}
        scales = {p: np.asarray(a.scales).view(np.uint8) for p, (a, _) in res.packed.items()}
        if ref is None:
            ref = (codes, scales)
        per_layer = {p: int(((codes[p] & 15) != (ref[0][p] & 15)).sum() + ((codes[p] >> 4) != (ref[0][p] >> 4)).sum())
                     for p in codes}
        by_block: dict[str, int] = {}
        for p, d in per_layer.items():
            by_block[p.split("/")[1]] = by_block.get(p.split("/")[1], 0) + d
        differ = sum(per_layer.values())
        out["rows"][name] = {"max_device_bytes": max(per.values()), "host_peak": peak, "seconds": round(seconds, 1),
                          "stats_bytes": res.peak_stats_bytes, "codes": sum(2 * c.size for c in codes.values()),
                          "codes_differ": differ, "codes_differ_by_block": by_block,
                          "scales_differ": sum(int((scales[p] != ref[1][p]).sum()) for p in scales)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
