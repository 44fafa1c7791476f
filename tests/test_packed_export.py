"""Export of a packed model (issue 44): `ptq.export` (compressed-tensors) and `ptq.export_gguf` after `ptq.pack_model`
write, from the packed codes and scales, the same files as the unpacked model's export, byte for byte; and every
export checks that each quantized layer of the PTQ result is in the file, refusing (nothing written) otherwise.

Judge: the unpacked model's export of the same PTQ result (the path tests/test_export_protocol.py, test_fp8_export.py,
test_gguf_export.py and test_moe_export.py check against compressed-tensors, vLLM and llama.cpp); the files are
compared byte for byte. Before this, the packed export returned normally and wrote no quantized layer at all.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from jaxlowfp import ptq
from jaxlowfp.models import Llama, ModelConfig, load
from jaxlowfp.ptq.packing import packed_layers

CFG = ModelConfig(vocab=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=32)
LINEARS = r"blocks/\d+/(attn|mlp)/\w+_proj"
CALIB = np.random.default_rng(0).integers(0, 96, (4, 16)).astype(np.int32)
MOE = Path(__file__).parent / "fixtures" / "moe" / "qwen3_moe"


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir())}


def _same_files(a, b):
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert fa[name] == fb[name], name


def _quantized(scheme, seed=0, **kw):
    model = Llama(CFG, rngs=nnx.Rngs(seed))
    res = ptq.quantize_model(model, [ptq.Rule(path=LINEARS, scheme=scheme)], calibration=CALIB, **kw)
    return model, res


@pytest.mark.parametrize("scheme,kw", [
    (ptq.scheme("nvfp4-mse", weights_only=True), {}),  # W4A16
    (ptq.scheme("nvfp4-mse"), {}),  # W4A4: input_global_scale
    (ptq.scheme("nvfp4-static_6", weights_only=True), {"arithmetic": "compressed-tensors"}),
    (ptq.scheme("fp8"), {"activation_scale": "static"}),  # W8A8: E4M3 codes and input_scale
], ids=["nvfp4-w4a16", "nvfp4-w4a4", "nvfp4-ct", "fp8-static"])
def test_packed_export_writes_the_unpacked_files(tmp_path, scheme, kw):
    model, res = _quantized(scheme, **kw)
    ptq.export(model, res, tmp_path / "float", dtype="float32")
    ptq.pack_model(model, res)
    assert len(packed_layers(model)) == 14
    ptq.export(model, res, tmp_path / "packed", dtype="float32")
    _same_files(tmp_path / "float", tmp_path / "packed")
    assert len(ptq.load(Llama(CFG, rngs=nnx.Rngs(1)), tmp_path / "packed")) == 14


def test_packed_experts_export_writes_the_unpacked_files(tmp_path):
    model, _ = load(MOE)
    res = ptq.quantize_model(model, [ptq.Rule(path=r".*(router|lm_head).*", scheme=None),
                                     ptq.Rule(path=r".*", scheme=ptq.scheme("nvfp4-mse", weights_only=True))],
                             calibration=CALIB)
    assert len(res.experts) == 6
    ptq.export(model, res, tmp_path / "float")
    ptq.pack_model(model, res)
    ptq.export(model, res, tmp_path / "packed")
    _same_files(tmp_path / "float", tmp_path / "packed")


def _tokenizer(directory):
    from test_gguf_export import _tokenizer as make

    return make(directory)


@pytest.mark.parametrize("name", ["nvfp4-mse", "mxfp4"])
def test_packed_gguf_export_writes_the_unpacked_file(tmp_path, name):
    model, res = _quantized(ptq.scheme(name, weights_only=True))
    tj = _tokenizer(tmp_path / "tok")
    ptq.export_gguf(model, res, tmp_path / "float.gguf", tokenizer_json=tj)
    ptq.pack_model(model, res)
    ptq.export_gguf(model, res, tmp_path / "packed.gguf", tokenizer_json=tj)
    assert (tmp_path / "float.gguf").read_bytes() == (tmp_path / "packed.gguf").read_bytes()


def _hide_kernel(model, path):
    """Put layer `path`'s kernel in a plain nnx.Variable (not an nnx.Param): a parameter the exporters do not take."""
    mod = model
    for part in path.split("/"):
        mod = mod[int(part)] if part.isdigit() else getattr(mod, part)
    mod.kernel = nnx.Variable(mod.kernel[...])


def test_export_that_would_miss_a_layer_raises_and_writes_nothing(tmp_path):
    model, res = _quantized(ptq.scheme("nvfp4-mse", weights_only=True))
    _hide_kernel(model, "blocks/1/mlp/up_proj")
    with pytest.raises(ValueError, match=r"quantized layers \['blocks/1/mlp/up_proj'\].*would not be in the file"):
        ptq.export(model, res, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match="blocks/1/mlp/up_proj"):
        ptq.export_gguf(model, res, tmp_path / "a.gguf", tokenizer_json=_tokenizer(tmp_path / "tok"))
    assert not (tmp_path / "a.gguf").exists()


def test_export_with_two_layers_under_one_name_raises_and_writes_nothing(tmp_path):
    model, res = _quantized(ptq.scheme("nvfp4-mse", weights_only=True))
    ptq.pack_model(model, res)
    names = {"blocks/0/attn/k_proj/kernel": "blocks.0.attn.q_proj.weight"}  # the others: default_name
    with pytest.raises(ValueError, match=r"two tensors would be written as 'blocks\.0\.attn\.q_proj\.weight_"):
        ptq.export(model, res, tmp_path / "a", tensor_names=names)
    assert not (tmp_path / "a").exists()


def test_export_of_a_packed_model_with_another_results_codes_raises(tmp_path):
    model, res = _quantized(ptq.scheme("nvfp4-mse", weights_only=True))
    _, res2 = _quantized(ptq.scheme("nvfp4-mse", weights_only=True), seed=1)  # another model's codes
    ptq.pack_model(model, res)
    first = next(iter(res2.packed))
    with pytest.raises(ValueError, match=f"{first}: the packed model's NVFP4 codes and scales are not the PTQ"):
        ptq.export(model, res2, tmp_path / "a")
    assert not (tmp_path / "a").exists()
