"""Served = evaluated for GGUF too (issue 45, items 1 and 4): `ptq.export_gguf` writes the high-precision tensors in
the dtype the model was quantized and evaluated in (`PTQResult.dtype`, float32 by default) unless told otherwise,
so our loader's reload of the default file scores exactly as the in-memory quantized model; another dtype warns that
the file is not the evaluated model (before, the default was float16 and the reload differed without a word)."""
import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlowfp import ptq
from jaxlowfp.models import load
from jaxlowfp.models.llama import PRESETS, Llama

from test_gguf_export import _tokenizer

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=2, vocab=96)
TOKENS = np.random.default_rng(5).integers(0, 96, (2, 24)).astype(np.int32)
RULES = [ptq.Rule(path=r"blocks/\d+/(attn|mlp)/\w+_proj", scheme=ptq.scheme("nvfp4-mse", weights_only=True))]


@jax.jit
def _log_probs(graphdef, state, tokens):
    return jax.nn.log_softmax(nnx.merge(graphdef, state)(tokens), -1)


def _lp(model):
    graphdef, state = nnx.split(model)
    return np.asarray(_log_probs(graphdef, state, jnp.asarray(TOKENS)))


def _quantized():
    model = Llama(CFG, rngs=nnx.Rngs(0))
    res = ptq.quantize_model(model, RULES, method="rtn", progress=False)
    assert res.dtype == "float32"
    return model, res


def _params(model):
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_default_gguf_export_reloads_as_evaluated(tmp_path):
    model, res = _quantized()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the default file is the evaluated model: nothing to warn
        rep = ptq.export_gguf(model, res, tmp_path / "m.gguf", tokenizer_json=_tokenizer(tmp_path / "tok"))
    assert rep.dtype == "F32" and rep.rounded[0] == 0
    assert rep.types["token_embd.weight"] == "F32" and rep.types["blk.0.ffn_up.weight"] == "NVFP4"
    back, _ = load(tmp_path / "m.gguf")
    mine, theirs = _params(model), _params(back)
    assert sorted(mine) == sorted(theirs)
    for k in mine:  # every parameter bit for bit (NVFP4 decoded by gguf-py, q/k rows un-permuted)
        np.testing.assert_array_equal(theirs[k], mine[k], err_msg=k)
    np.testing.assert_array_equal(_lp(back), _lp(model))
    _refuses_a_bad_decode_scale(tmp_path / "m.gguf", "blk.1.ffn_up.scale", packed_too=True)


def _refuses_a_bad_decode_scale(path, name, packed_too=False):
    """The file at `path` with NVFP4 decode scale `name` overwritten by 0, then NaN: `models.load` (and, with
    `packed_too`, ``load(packed=True)``) refuses it naming the file and the tensor, never a model of NaN / 0."""
    import gguf

    from jaxlowfp.models import CheckpointError

    scale = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    raw = bytearray(path.read_bytes())
    for bad in (0.0, float("nan")):
        raw[scale.data_offset: scale.data_offset + 4] = np.float32(bad).tobytes()
        path.write_bytes(bytes(raw))
        for kw in ({}, {"packed": True}) if packed_too else ({},):
            with pytest.raises(CheckpointError, match=rf"{path.name}: tensor {re.escape(name)} is (0\.0|nan); an "
                                                      r"NVFP4 decode scale must be finite and > 0"):
                load(path, **kw)


def test_another_gguf_dtype_warns(tmp_path):
    model, res = _quantized()
    with pytest.warns(UserWarning, match=r"export_gguf: dtype='float16' but the model was quantized and evaluated in "
                                         r"'float32'.*not the evaluated model \([1-9][0-9]* of [0-9]+ high-precision"):
        rep = ptq.export_gguf(model, res, tmp_path / "m.gguf", tokenizer_json=_tokenizer(tmp_path / "tok"),
                              dtype="float16")
    assert rep.dtype == "F16" and rep.rounded[0] > 0
    back, _ = load(tmp_path / "m.gguf")
    assert np.abs(_lp(back) - _lp(model)).max() > 0  # what the warning is about


def test_without_a_result_the_default_stays_float16(tmp_path):
    """No PTQ result: no evaluated quantized model to match; llama.cpp's converter default (F16), no warning."""
    model = Llama(CFG, rngs=nnx.Rngs(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        rep = ptq.export_gguf(model, None, tmp_path / "m.gguf", tokenizer_json=_tokenizer(tmp_path / "tok"))
    assert rep.dtype == "F16"


MOE_CASES = {  # (family, rules): NVFP4 attention (its F32 <name>.scale) with MXFP4 experts (type-39 [E, out, in]),
    # and Mixtral (RoPE-permuted q/k rows) with moe.rules' NVFP4 experts (F32 in GGUF: one global scale per expert)
    "qwen3_moe-mxfp4-experts": ("qwen3_moe", [
        ptq.Rule(path=r"blocks/\d+/mlp/experts/(gate|up)_proj", scheme=ptq.scheme("mxfp4", weights_only=True)),
        ptq.Rule(path=r"blocks/\d+/attn/\w+_proj", scheme=ptq.scheme("nvfp4-mse", weights_only=True))]),
    "mixtral-nvfp4": ("mixtral", None),  # (its projections are F32 in GGUF: rows not whole 64-value blocks)
}


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_default_moe_gguf_export_reloads_as_evaluated(tmp_path, case):
    """MoE: `export_gguf` then `models.load` gives the in-memory quantized model's parameters and log-probs bit for
    bit (before, the MoE GGUF loader refused the NVFP4 ``blk.N.attn_output.scale`` tensors: "tensors this model
    class does not have"); a decode scale that is 0 or NaN in the file is a CheckpointError naming the tensor."""
    import moe_export_common as moe

    family, rules = MOE_CASES[case]
    model, tok = load(moe.FIX / family)
    res = ptq.quantize_model(model, rules or moe.rules(family), method="rtn", progress=False)
    path = tmp_path / "m.gguf"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        rep = ptq.export_gguf(model, res, path, tokenizer_json=moe.FIX / family / "tokenizer.json")
    assert rep.dtype == "F32" and rep.rounded[0] == 0
    if rules:  # Mixtral's projections (32 x 24, 32 x 32) are not whole 64-value GGUF blocks: F32
        assert rep.types["blk.0.attn_output.weight"] == "NVFP4" and rep.types["blk.0.attn_output.scale"] == "F32"
    assert rep.types["blk.0.ffn_up_exps.weight"] == ("MXFP4" if rules else "F32")
    back, _ = load(path)
    assert dataclasses.replace(back.config, norm_eps=model.config.norm_eps) == model.config
    assert np.float32(back.config.norm_eps) == np.float32(model.config.norm_eps)  # GGUF stores it as float32
    mine, theirs = _params(model), _params(back)
    assert sorted(mine) == sorted(theirs)
    for k in mine:
        np.testing.assert_array_equal(theirs[k], mine[k], err_msg=k)
    tokens = jnp.asarray(moe.TOKENS)
    np.testing.assert_array_equal(_log_probs(*nnx.split(back), tokens), _log_probs(*nnx.split(model), tokens))
    if rules is None:
        return
    _refuses_a_bad_decode_scale(path, "blk.1.attn_output.scale")
