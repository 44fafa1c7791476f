"""`ptq.export` / `ptq.export_gguf` of a sharded model write tensor by tensor (`jaxlowfp.ptq.stream`): the files are
byte for byte the unsharded model's, the safetensors file byte for byte what ``safetensors.numpy.save_file``
writes for the same tensors, and the host's peak (tracemalloc) is a fraction of the file, on 4 simulated devices
here (conftest) and on 8 in a subprocess (bench/sharded_export.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import numpy as np
from flax import nnx

from test_gguf_export import _tokenizer
from jaxlowfp import ptq, sharding
from jaxlowfp.models import Llama, ModelConfig
from jaxlowfp.ptq import stream
from conftest import child_xla_flags

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig(vocab=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=32)
RULES = [ptq.Rule(path=r"blocks/\d+/(attn|mlp)/\w+_proj", scheme=ptq.scheme("nvfp4-mse", weights_only=True))]


def _export_both(model, tmp: Path, tj: Path) -> tuple[bytes, bytes]:
    res = ptq.quantize_model(model, RULES, method="rtn", dtype="float16")  # both files' high precision in F16
    ptq.export(model, res, tmp / "st")
    ptq.export_gguf(model, res, tmp / "m.gguf", tokenizer_json=tj)
    return (tmp / "st" / "model.safetensors").read_bytes(), (tmp / "m.gguf").read_bytes()


def test_sharded_export_is_the_unsharded_file(tmp_path):
    tj = _tokenizer(tmp_path / "tok")
    mesh = sharding.make_mesh("fsdp=2,tensor=2")
    sharded = sharding.shard_model(Llama(CFG, rngs=nnx.Rngs(0)), mesh, sharding.llama_rules())
    assert sharded.blocks[0].mlp.up_proj.kernel.get_value().sharding.spec == sharding.P("fsdp", "tensor")
    want = _export_both(Llama(CFG, rngs=nnx.Rngs(0)), tmp_path / "one", tj)
    got = _export_both(sharded, tmp_path / "mesh", tj)
    assert got[0] == want[0] and got[1] == want[1]
    # np.asarray of a sharded array caches a whole host copy on it (jax.Array._value): quantize's checks and the
    # exports fetch through jaxlowfp.ptq.stream.fetch, so no parameter keeps one
    kept = [p for p, v in sharding.variable_paths(sharded).items() if getattr(v.get_value(), "_npy_value", None)
            is not None]
    assert not kept, kept
    # the streamed safetensors file is what the safetensors library writes for the same tensors
    from safetensors.numpy import save_file

    tensors = ptq.checkpoint.read_safetensors(tmp_path / "one" / "st" / "model.safetensors")
    assert {str(t.dtype) for t in tensors.values()} >= {"uint8", "float8_e4m3fn", "float16", "float32"}
    save_file(tensors, str(tmp_path / "lib.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "lib.safetensors").read_bytes() == want[0]
    # and the GGUF file is one the gguf package reads, with every tensor
    reader = gguf.GGUFReader(tmp_path / "mesh" / "m.gguf")
    assert {t.tensor_type.name for t in reader.tensors} == {"NVFP4", "F32", "F16"}


def test_spool_roundtrip_and_safetensors_errors(tmp_path):
    import ml_dtypes
    import pytest

    with stream.Spool(near=tmp_path / "not" / "yet") as sp:
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        b = np.asarray([1.5, -2], ml_dtypes.float8_e4m3fn)
        ea, eb = sp.put(a), sp.put(b)
        assert np.array_equal(sp.get(ea), a) and sp.get(eb).tobytes() == b.tobytes()
        with pytest.raises(TypeError, match="x: safetensors has no dtype for complex64"):
            stream.write_safetensors(tmp_path / "x.safetensors", sp, {"x": sp.put(np.zeros(2, np.complex64))})
    assert not (tmp_path / "not").exists()
    assert isinstance(stream.fetch(jax.numpy.ones(3)), np.ndarray)


def test_eight_devices_export_holds_a_few_tensors_not_the_model():
    """bench/sharded_export.py in a subprocess with 8 CPU devices: 2 and 8 layers, unsharded and fsdp=4 x
    tensor=2: the same bytes, and a host peak (tracemalloc) that hardly grows with the model (8 layers write a file
    about 3.5 times larger; the gathering writers held every tensor until the end)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FLAGS")} | {
        "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": child_xla_flags()}
    proc = subprocess.run([sys.executable, "bench/sharded_export.py", "--layers", "2,8", "--d-model", "128",
                           "--d-ff", "512", "--devices", "1,8"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same"], out
    rows = out["rows"]
    assert [rows[k]["devices"] for k in ("2x1", "2x8", "8x1", "8x8")] == [1, 8, 1, 8]
    assert rows["8x8"]["max_device_bytes"] < rows["8x1"]["max_device_bytes"] / 6
    for kind in ("safetensors", "gguf"):
        small, big = rows["2x1"][kind]["bytes"], rows["8x1"][kind]["bytes"]
        assert big > 3.5 * small
        for n in ("1", "8"):
            # measured: the peak grows by 3-15 % of the file's growth (per-tensor metadata: names, spool entries,
            # the header; ~0.5 KiB a tensor), from ~0.4 MiB (safetensors) / ~0.7-0.9 MiB (GGUF): one to three
            # copies of the largest tensor (a [128, 512] float32 kernel, 256 KiB) and the fixed costs
            p2, p8 = rows[f"2x{n}"][kind]["peak"], rows[f"8x{n}"][kind]["peak"]
            assert p8 < p2 + 0.25 * (big - small), (kind, n, p2, p8, small, big)
