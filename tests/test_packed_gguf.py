"""`models.load(gguf, packed=True)`: GGUF NVFP4 (type 40) and MXFP4 (type 39) projections become `PackedLinear`
layers holding the file's codes and scales, re-laid out but never decoded, and packed loads keep a mesh's sharding
(`jaxlowfp.sharding.packed_shardings`), for GGUF and compressed-tensors alike.

The judge is ``gguf.quants.dequantize`` (llama.cpp's gguf-py, not ours): the float load decodes every tensor with
it, and each packed kernel must dequantize to those values bit for bit (E2M1 x E4M3 or 2^e is exact in float32, and
the NVFP4 ``.scale`` multiply rounds once in both). The MXFP4 files are written by gguf-py's own quantizer. gguf-py
has no NVFP4 quantizer, so the NVFP4 tensors are random bytes in the block layout, scale bytes drawn from a
realistic range plus the edge cases gguf-py decodes specially (a sign bit set, which it ignores; 0x7F, which it
reads as 0; 0xFF, 480 to gguf-py and no E4M3 value, is refused). Log-probs of the packed and float models are two
XLA programs over the same values (the float one's kernels are constants, the packed one decodes them inside): compared
relative to the largest log-prob, within float32 rounding (measured 1.5e-6 NVFP4, 7e-7 MXFP4).
"""
from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_models_gguf import CFG, T, write_gguf
from test_models_oracle import random_weights

from jaxlowfp import models, sharding
from jaxlowfp.models import CheckpointError, gguf_loader
from jaxlowfp.packed_layer import PackedLinear

CFG4 = CFG | {"d_ff": 128}  # GGUF NVFP4 rows are multiples of 64 values
PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
TOL = 1e-5


def _random_nvfp4(seed: int):
    rng = np.random.default_rng(seed)

    def quantize(a, qtype):
        if qtype != T.NVFP4:
            return gguf.quants.quantize(a, qtype)
        n, k = a.shape
        b = rng.integers(0, 256, (n, k // 64, 36), dtype=np.uint8)
        b[..., :4] = rng.integers(0x10, 0x28, (n, k // 64, 4))  # UE4M3 scales 2^-5 .. 2^-2
        b[0, 0, :3] = [0x7F, 0xB0, 0x00]  # gguf-py: 0x7F reads 0, the sign bit is ignored
        return b.reshape(n, -1)

    return quantize


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    w = random_weights(CFG4)
    out = {}
    for qt in (T.NVFP4, T.MXFP4):
        path = d / f"{qt.name}.gguf"
        extra = {"blk.0.ffn_down.scale": np.array([0.37], np.float32)} if qt == T.NVFP4 else None
        write_gguf(path, w, CFG4, qtype=qt, extra=extra, quantize=_random_nvfp4(0))
        out[qt.name] = path
    return out


@nnx.jit
def _lp(model, tokens):
    return jax.nn.log_softmax(model(tokens), axis=-1)


def _tokens():
    return jnp.asarray(np.random.default_rng(1).integers(0, CFG4["vocab"], (2, 16)), jnp.int32)


def _layers(model):
    return {"/".join(map(str, p)): m for p, m in nnx.iter_graph(model) if isinstance(m, (nnx.Linear, PackedLinear))}


@pytest.mark.parametrize("kind", ["NVFP4", "MXFP4"])
def test_gguf_loads_packed_with_the_files_codes(files, kind, monkeypatch):
    ref, _ = models.load(files[kind])
    read = []
    orig = gguf_loader._read
    monkeypatch.setattr(gguf_loader, "_read", lambda t, *a: (read.append(t.name), orig(t, *a))[1])
    model, tok = models.load(files[kind], packed=True)
    assert tok is not None
    assert not [n for n in read if n.endswith(".weight") and (any(f".{p}." in n for p in PROJ) or n == "output.weight")]
    layers, float_layers = _layers(model), _layers(ref)
    assert set(layers) == set(float_layers)
    assert all(isinstance(m, PackedLinear) for m in layers.values())  # 14 projections and the head
    for path, m in layers.items():
        w = m.kernel.get_value()
        assert w.format.kind == kind.lower() and w.array.codes.dtype == jnp.uint8
        np.testing.assert_array_equal(np.asarray(w.dequantize()), np.asarray(float_layers[path].kernel[...]),
                                      err_msg=path)
    down = layers["blocks/0/mlp/down_proj"].kernel.get_value()
    if kind == "NVFP4":
        assert float(down.array.global_scale) == np.float32(0.37)  # the .scale tensor, llama.cpp's S_dec
    tokens = _tokens()
    a, b = _lp(model, tokens), _lp(ref, tokens)
    diff, size = float(jnp.max(jnp.abs(a - b))), float(jnp.max(jnp.abs(b)))
    print(f"GGUF {kind}: packed vs float load: max |d log p| = {diff} (max |log p| {size})")
    assert diff <= TOL * size


@pytest.mark.parametrize("kind", ["NVFP4", "MXFP4"])
def test_packed_load_on_a_mesh_keeps_the_kernels_sharding(files, kind):
    single, _ = models.load(files[kind], packed=True)
    mesh = sharding.make_mesh("fsdp=2,tensor=2")
    model, _ = models.load(files[kind], packed=True, mesh=mesh)
    for path, spec in [("blocks/0/attn/q_proj", ("tensor", "fsdp")), ("blocks/1/mlp/down_proj", ("fsdp", "tensor"))]:
        w = _layers(model)[path].kernel.get_value()  # W'^T: the column-parallel kernel P(fsdp, tensor) transposed
        assert w.array.codes.sharding.spec == jax.sharding.PartitionSpec(*spec)
        assert w.array.scales.sharding.spec == jax.sharding.PartitionSpec(*spec)
        np.testing.assert_array_equal(np.asarray(w.array.codes), np.asarray(_layers(single)[path].kernel.get_value()
                                                                            .array.codes))
    per_device = sharding.device_bytes(model)
    total = sum(sharding.device_bytes(single).values())
    print(f"GGUF {kind} packed: {total} B on one device; per device on 4: {sorted(per_device.values())}")
    assert len(per_device) == 4 and max(per_device.values()) < total / 3
    tokens = _tokens()
    a, b = np.asarray(_lp(model, tokens)), np.asarray(_lp(single, tokens))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-3)  # sharded sums: float32 summation order


def test_compressed_tensors_packed_load_on_a_mesh():
    from test_packed_load import LLMC

    single, _ = models.load(LLMC, packed=True, tokenizer=None)
    model, _ = models.load(LLMC, packed=True, tokenizer=None, mesh=sharding.make_mesh("fsdp=2,tensor=2"))
    w = _layers(model)["blocks/0/mlp/up_proj"].kernel.get_value()
    assert w.array.codes.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, model.config.vocab, (2, 16)), jnp.int32)
    np.testing.assert_allclose(np.asarray(_lp(model, tokens)), np.asarray(_lp(single, tokens)), rtol=1e-5, atol=1e-4)


def test_bad_input_is_a_clear_error(files, tmp_path):
    plain = tmp_path / "f32.gguf"
    write_gguf(plain, random_weights(CFG4), CFG4)
    with pytest.raises(CheckpointError, match="this file has none .tensor types F32"):
        models.load(plain, packed=True)
    # K = 64 has 2 MXFP4 blocks per row: fsdp=4 divides K but would split a block from its scale
    with pytest.raises(sharding.ShardingError, match=r"mesh axis 'fsdp' \(size 4\).*does not divide its dimension 1 "
                                                     r"\(2\).*whole blocks"):
        models.load(files["MXFP4"], packed=True, mesh=sharding.make_mesh("fsdp=4"))
    reader = gguf.GGUFReader(files["MXFP4"])
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")

    class NaNScale:  # an E8M0 byte 0xFF (NaN in the OCP MX specification)
        name, tensor_type, shape = t.name, t.tensor_type, t.shape
        data = np.array(t.data).copy()
        data[0, 0] = 0xFF

    with pytest.raises(CheckpointError, match="E8M0 block scale is 0xFF"):
        gguf_loader.packed_weight(NaNScale, files["MXFP4"])
    t = next(t for t in gguf.GGUFReader(files["NVFP4"]).tensors if t.name == "blk.0.ffn_up.weight")

    class BigScale:  # UE4M3 0xFF: gguf-py reads 480, which no E4M3 scale is
        name, tensor_type, shape = t.name, t.tensor_type, t.shape
        data = np.array(t.data).copy()
        data[0, 0] = 0xFF

    assert gguf.quants.dequantize(BigScale.data[:1, :36], T.NVFP4).max() > 0  # what gguf-py makes of it
    with pytest.raises(CheckpointError, match="UE4M3 block scale byte is 0xFF"):
        gguf_loader.packed_weight(BigScale, files["NVFP4"])
