"""Peak memory of GPTQ calibration, sequential against one pass, on tiny Llama models of 2 and 8 blocks.

    .venv/bin/python bench/ptq_memory.py [--d-model 128] [--d-ff 4096] [--no-write]

Each configuration runs in a fresh interpreter (so one run's allocations cannot hide another's): build the model
(d_model 128, d_ff 4096, so the down_proj Hessians [4096, 4096] dominate the statistics), run one jitted forward pass,
record the resident set (RSS), then ``ptq.quantize_model(method=GPTQ(), calibration=tokens, pipeline=...)`` of every
projection to NVFP4 (mse) and read the process's peak RSS (``getrusage`` ru_maxrss). The table gives the peak minus the
RSS before PTQ, and ``PTQResult.peak_stats_bytes`` (the statistics and calibration activations PTQ held at once,
counted). Sequential holds one block's statistics, so both stay flat in the number of blocks; one pass holds every
block's.

Writes the ``## PTQ peak memory (tiny models)`` section of bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jaxlowfp import ptq
from jaxlowfp.models.llama import Llama, ModelConfig

n, pipe, d, ff = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg = ModelConfig(d_model=d, n_layers=n, n_heads=4, n_kv_heads=2, d_ff=ff, max_seq_len=128)
model = Llama(cfg, rngs=nnx.Rngs(0))
tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 128)), jnp.int32)
g, s = nnx.split(model)
jax.block_until_ready(jax.jit(lambda s, x: nnx.merge(g, s)(x))(s, tokens))
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) * 1024
before = rss()
res = ptq.quantize_model(model, [ptq.Rule(path=r"blocks/\d+/(attn|mlp)/\w+_proj", scheme=ptq.scheme("nvfp4-mse"))],
                   method=ptq.GPTQ(), calibration=tokens, pipeline=pipe)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"blocks": n, "pipeline": pipe, "before": before, "peak": peak, "stats": res.peak_stats_bytes,
                  "seconds": res.seconds}))
"""


def main() -> None:
    from _results import machine, markdown_table, write_section

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-ff", type=int, default=4096)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    rows = []
    for n in (2, 8):
        for pipe in ("sequential", "one-pass"):
            out = subprocess.run([sys.executable, "-c", CHILD, str(n), pipe, str(args.d_model), str(args.d_ff)],
                                 capture_output=True, text=True, cwd=ROOT, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(r)
            print(r, flush=True)
    mib = 2 ** 20
    body = "\n\n".join([
        f"`bench/ptq_memory.py` on {machine()}: GPTQ of every projection of a tiny Llama (d_model {args.d_model}, "
        f"d_ff {args.d_ff}, so one block's Hessians are {4 * (args.d_model ** 2 * 2 + args.d_ff ** 2) / mib:.0f} "
        f"MiB, counting q/k/v's and gate/up's shared input once) to NVFP4 4/6 (mse), 8 x 128 calibration tokens, "
        f"each configuration in a fresh interpreter.",
        markdown_table(["blocks", "pipeline", "peak RSS - RSS before PTQ (MiB)", "statistics + activations held "
                        "at once (MiB)", "PTQ s"],
                       [[r["blocks"], r["pipeline"], f"{(r['peak'] - r['before']) / mib:.0f}",
                         f"{r['stats'] / mib:.1f}", f"{r['seconds']:.0f}"] for r in rows]),
        "The one-pass pipeline holds every layer's statistics until the last layer is quantized; the sequential "
        "one holds one block's and the calibration activations (the peak RSS also counts JAX's compilation and "
        "GPTQ's float64 factorization of the largest Hessian, the same for any number of blocks).",
    ])
    if not args.no_write:
        write_section("PTQ peak memory (tiny models)", body)
    print(body)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "bench"))
    main()
