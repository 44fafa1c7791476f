"""Host peak memory of `jaxlowfp.ptq.export` / `export_gguf` of a tiny Llama, unsharded and on 2 / 4 / 8 devices.

    PYTHONPATH=. .venv/bin/python bench/sharded_export.py [--layers 8 --d-model 256 --d-ff 1024]

One interpreter with 8 simulated CPU devices (``jax_num_cpu_devices``). For each mesh (none, then ``fsdp=n/2,
tensor=2`` over the first n devices) a random ``Llama`` (vocabulary 96, so a 96-token byte-level BPE tokenizer fits
it) is placed by `jaxlowfp.sharding.llama_rules`, quantized by RTN to NVFP4 4/6 (mse, W4A16) on every projection,
exported once to warm JAX's caches, then exported again under ``tracemalloc`` (every numpy and Python allocation
of the host; device buffers and XLA's own host copies are not counted): the peak, the file size and the file's
SHA-256; and ``rss``: the peak resident set during the export minus the resident set before it (``VmHWM``
reset through ``/proc/self/clear_refs``), which also counts the host buffers XLA allocates (tracemalloc does not:
a device array's host copy, or an unsharded CPU array's zero-copy view, is invisible to it). Prints one JSON
object (rows ``<layers>x<devices>``); ``same`` says every sharded file's bytes equal the unsharded one's.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import tempfile
import tracemalloc
from pathlib import Path

import jax


def _tokenizer(directory: Path) -> Path:
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())[:94])}
    vocab["ab"] = 94
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<s>"])  # id 95
    tk.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _peak(fn) -> tuple[int, int]:
    """(tracemalloc peak, peak RSS - RSS before): the second counts XLA's host buffers too (VmHWM, reset through
    /proc/self/clear_refs)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    rss = _status("VmRSS")
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1], _status("VmHWM") - rss
    finally:
        tracemalloc.stop()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="8", help="layer counts (comma-separated): the peak should not grow with them")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--devices", default="1,2,4,8", help="device counts; 1 is the unsharded model")
    args = ap.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)
    from flax import nnx

    from jaxlowfp import ptq, sharding
    from jaxlowfp.models import Llama, ModelConfig

    rules = [ptq.Rule(path=r"blocks/\d+/(attn|mlp)/\w+_proj", scheme=ptq.scheme("nvfp4-mse", weights_only=True))]
    out: dict = {"rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tj = _tokenizer(root)
        for layers, n in ((int(k), int(x)) for k in args.layers.split(",") for x in args.devices.split(",")):
            cfg = ModelConfig(vocab=96, d_model=args.d_model, n_layers=layers, n_heads=4, n_kv_heads=2,
                              d_ff=args.d_ff, max_seq_len=32)
            model = Llama(cfg, rngs=nnx.Rngs(0))
            if n > 1:
                mesh = sharding.make_mesh(f"fsdp={n // 2},tensor=2", jax.devices()[:n])
                model = sharding.shard_model(model, mesh, sharding.llama_rules())
            # float16 storage, chosen at quantize time (what export writes by default): the configuration measured
            res = ptq.quantize_model(model, rules, method="rtn", progress=False, dtype="float16")
            d = root / f"{layers}-{n}"
            ptq.export(model, res, d / "warm")
            ptq.export_gguf(model, res, d / "warm.gguf", tokenizer_json=tj)
            st = _peak(lambda: ptq.export(model, res, d / "st"))
            gg = _peak(lambda: ptq.export_gguf(model, res, d / "m.gguf", tokenizer_json=tj))
            per = sharding.device_bytes(model)
            out["rows"][f"{layers}x{n}"] = {"layers": layers,
                "params": sum(int(v.get_value().size) for v in sharding.variable_paths(model).values()),
                "max_device_bytes": max(per.values()), "devices": len(per),
                "safetensors": {"bytes": (d / "st" / "model.safetensors").stat().st_size, "peak": st[0], "rss": st[1],
                                "sha": _sha(d / "st" / "model.safetensors")},
                "gguf": {"bytes": (d / "m.gguf").stat().st_size, "peak": gg[0], "rss": gg[1],
                         "sha": _sha(d / "m.gguf")}}
    rows = list(out["rows"].values())
    out["same"] = all(r[k]["sha"] == q[k]["sha"] for r in rows for q in rows if q["layers"] == r["layers"]
                      for k in ("safetensors", "gguf"))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
