"""Loaders validate before they trust (issue 45): damaged copies of a small export written here (a truncated file,
a corrupt header, a 4 KiB block of 0xFF, config.json and weights that disagree either way, a directory mixing two
exports, a non-positive global scale) each give a `CheckpointError` naming the file and the tensor, never a NaN
model; a mixture-of-experts checkpoint without tokenizer.json loads with ``tokenizer=None``."""
from __future__ import annotations

import json
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlowfp import models, ptq
from jaxlowfp.models import CheckpointError
from jaxlowfp.models.llama import PRESETS, Llama
from jaxlowfp.models.quantized import read_safetensors
from jaxlowfp.ptq import checkpoint

from moe_export_common import FIX as MOE_FIX

pytestmark = pytest.mark.filterwarnings("ignore:export. compressed-tensors")
TOKENS = np.random.default_rng(3).integers(0, 256, (2, 16)).astype(np.int32)
RULES = [ptq.Rule(path=r"blocks/\d+/mlp/\w+_proj", scheme=ptq.scheme("nvfp4-mse"))]


def _export(out, seed: int = 0):
    model = Llama(PRESETS["tiny"], rngs=nnx.Rngs(seed))
    res = ptq.quantize_model(model, RULES, method="rtn", calibration=TOKENS, progress=False)
    ptq.export(model, res, out)
    return model


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "tiny"
    _export(out)
    return out


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another export of the same architecture (other weights)."""
    out = tmp_path_factory.mktemp("other") / "tiny"
    _export(out, seed=1)
    return out


def _copy(src, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def _finite(model) -> bool:
    return bool(np.isfinite(np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(TOKENS)))).all())


LOADERS = {"models.load_export": lambda d: models.load_export(d, tokenizer=None),
           "models.load": lambda d: models.load(d, tokenizer=None)}


def test_intact_export_loads(export):
    for load in LOADERS.values():
        model, _ = load(export)
        assert _finite(model)


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_file(export, tmp_path, loader, keep):
    d = _copy(export, tmp_path)
    f = d / checkpoint.WEIGHTS_FILE
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        LOADERS[loader](d)


@pytest.mark.parametrize("loader", LOADERS)
def test_corrupt_header(export, tmp_path, loader):
    d = _copy(export, tmp_path)
    f = d / checkpoint.WEIGHTS_FILE
    data = bytearray(f.read_bytes())
    data[20:60] = b"\xff" * 40
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        LOADERS[loader](d)


def test_header_length_past_the_end(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(CheckpointError, match="header length 10000 does not fit"):
        read_safetensors(f)


def test_offsets_that_do_not_tile_the_data(tmp_path):
    head = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                       "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", len(head)) + head + bytes(12))
    with pytest.raises(CheckpointError, match="tensor b starts at byte 4 .* overlap"):
        read_safetensors(f)


def _blocks(export):
    """Offsets of 4 KiB blocks spread over the data section of the export's weights file."""
    f = export / checkpoint.WEIGHTS_FILE
    (n,) = struct.unpack("<Q", f.read_bytes()[:8])
    size = f.stat().st_size
    return [int(x) for x in np.linspace(8 + n, size - 4096, 7)]


def _ff_block(export, dest, at: int):
    """A copy of `export` at `dest` with 4 KiB of 0xFF written at byte `at` of its weights file."""
    d = _copy(export, dest)
    f = d / checkpoint.WEIGHTS_FILE
    data = bytearray(f.read_bytes())
    data[at: at + 4096] = b"\xff" * 4096
    f.write_bytes(bytes(data))
    return d


def test_0xff_block_always_refused_by_load_export(export, tmp_path):
    """Wherever the 4 KiB land (codes, scales, float tensors), the per-tensor SHA-256 the export recorded names
    the damaged tensor."""
    for i, at in enumerate(_blocks(export)):
        d = _ff_block(export, tmp_path / str(i), at)
        with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor \S+ .*differs from what export wrote"):
            LOADERS["models.load_export"](d)


def test_0xff_block_never_gives_a_nan_model(export, tmp_path):
    """Any loader (models.load reads compressed-tensors checkpoints of any producer: no digest): a CheckpointError
    naming the tensor, or (when the block hit only uint8 codes, which 0xFF leaves valid) a finite model."""
    refused = 0
    for i, at in enumerate(_blocks(export)):
        d = _ff_block(export, tmp_path / str(i), at)
        (d / checkpoint.META_FILE).unlink()  # as a foreign compressed-tensors checkpoint: no digests
        try:
            model, _ = LOADERS["models.load"](d)
        except CheckpointError as e:
            assert "model.safetensors: tensor" in str(e), e
            refused += 1
            continue
        assert _finite(model), at
    assert refused >= 4  # the float tensors and the scales fill most of the file


def test_non_finite_tensor_named(tmp_path):
    f = tmp_path / "x.safetensors"
    head = json.dumps({"w": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}}).encode()
    f.write_bytes(struct.pack("<Q", len(head)) + head + b"\x00\x3c" * 3 + b"\xff\xff")
    with pytest.raises(CheckpointError, match=r"x\.safetensors: tensor w \(F16 \[4\]\) has 1 NaN/Inf"):
        read_safetensors(f)
    assert read_safetensors(f, check_finite=False)["w"].shape == (4,)


def _set_tensor(f, name, value):
    """Overwrite tensor `name` of safetensors file `f` in place (same dtype and shape)."""
    data = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    info = json.loads(data[8: 8 + n])[name]
    a, b = info["data_offsets"]
    arr = np.asarray(value, read_safetensors(f)[name].dtype)
    data[8 + n + a: 8 + n + b] = arr.tobytes()
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("value", [-1.0, 0.0])
def test_non_positive_global_scale(export, tmp_path, value):
    d = _copy(export, tmp_path)
    m = "model.layers.1.mlp.down_proj"
    _set_tensor(d / checkpoint.WEIGHTS_FILE, f"{m}.weight_global_scale", [value])
    with pytest.raises(CheckpointError, match="differs from what export wrote"):
        LOADERS["models.load_export"](d)
    meta = json.loads((d / checkpoint.META_FILE).read_text())
    del meta["sha256"]  # an export without digests (an older version): the scale check itself
    (d / checkpoint.META_FILE).write_text(json.dumps(meta))
    for load in LOADERS.values():
        with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor {m}\.weight_global_scale has 1 "
                                                  r"scales that are not finite and > 0"):
            load(d)


def test_negative_block_scale(export, tmp_path):
    d = _copy(export, tmp_path)
    (d / checkpoint.META_FILE).unlink()
    m = "model.layers.2.mlp.up_proj"
    s = np.asarray(read_safetensors(d / checkpoint.WEIGHTS_FILE)[f"{m}.weight_scale"], np.float32).copy()
    s[3, 1] = -s[3, 1] if s[3, 1] else -1.0
    _set_tensor(d / checkpoint.WEIGHTS_FILE, f"{m}.weight_scale", s)
    with pytest.raises(CheckpointError, match=rf"tensor {m}\.weight_scale has 1 scales that are not finite and >= 0"):
        LOADERS["models.load"](d)


def _layers(d, n):
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = n
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("loader", LOADERS)
def test_config_with_fewer_layers_than_the_file(export, tmp_path, loader):
    d = _copy(export, tmp_path)
    _layers(d, 3)
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\."):
        LOADERS[loader](d)


@pytest.mark.parametrize("loader", LOADERS)
def test_config_with_more_layers_than_the_file(export, tmp_path, loader):
    d = _copy(export, tmp_path)
    _layers(d, 5)
    with pytest.raises(CheckpointError, match=r"(blocks/4|model\.layers\.4)"):
        LOADERS[loader](d)


def test_directory_mixing_two_exports(export, other, tmp_path):
    """A stale directory: the weights of one export beside the description (jaxlowfp_ptq.json) of another."""
    d = _copy(export, tmp_path)
    shutil.copy(other / checkpoint.WEIGHTS_FILE, d / checkpoint.WEIGHTS_FILE)
    with pytest.raises(CheckpointError, match="damaged or from another export"):
        LOADERS["models.load_export"](d)


def test_corrupt_meta(export, tmp_path):
    d = _copy(export, tmp_path)
    (d / checkpoint.META_FILE).write_text('{"format": "jaxlowfp-ptq/2", "layers": ')
    with pytest.raises(CheckpointError, match=r"jaxlowfp_ptq\.json: corrupt"):
        LOADERS["models.load_export"](d)


def test_moe_checkpoint_without_tokenizer(tmp_path):
    d = tmp_path / "qwen3_moe"
    shutil.copytree(MOE_FIX / "qwen3_moe", d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer=None"):
        models.load(d)
    model, tok = models.load(d, tokenizer=None)
    assert tok is None and _finite(model)
    model, tok = models.load(d, tokenizer=MOE_FIX / "qwen3_moe")  # the tokenizer of the source model
    assert tok is not None and tok.vocab_size <= model.config.vocab


def test_truncated_float_moe_checkpoint(tmp_path):
    d = tmp_path / "qwen3_moe"
    shutil.copytree(MOE_FIX / "qwen3_moe", d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        models.load(d)
