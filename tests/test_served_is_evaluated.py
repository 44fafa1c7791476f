"""Served = evaluated by default (issue 45): the storage dtype of the high-precision tensors is chosen at
`ptq.quantize_model` (``dtype=``, default float32, recorded in `PTQResult.dtype`), `ptq.export` writes it by
default, and `models.load_export` of that export gives the in-memory quantized model's log-probs bit for bit (one
jitted program applied to both models: the same XLA program), dense and mixture of experts; another export dtype
warns that the file is not the evaluated model."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlowfp import models, ptq
from jaxlowfp.models.llama import PRESETS, Llama

import moe_export_common as moe

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=2, dtype="float32")  # as load_export records it: one graphdef
TOKENS = np.random.default_rng(5).integers(0, 256, (2, 24)).astype(np.int32)
pytestmark = pytest.mark.filterwarnings("ignore:export. compressed-tensors")


@jax.jit
def _log_probs(graphdef, state, tokens):
    return jax.nn.log_softmax(nnx.merge(graphdef, state)(tokens), -1)


def _lp(model, tokens=TOKENS):
    """One jitted program for every model of the same structure (graphdef static, state traced)."""
    graphdef, state = nnx.split(model)
    return np.asarray(_log_probs(graphdef, state, jnp.asarray(tokens)))


def _dense(dtype=None, scheme="nvfp4-mse", method="gptq"):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    kw = {} if dtype is None else {"dtype": dtype}
    res = ptq.quantize_model(model, [ptq.Rule(path=r"blocks/\d+/(attn|mlp)/\w+_proj", scheme=ptq.scheme(scheme))],
                             method=method, calibration=TOKENS, progress=False, **kw)
    return model, res


@pytest.mark.parametrize("scheme,method", [("nvfp4-mse", "gptq"), ("nvfp4-mse", "rtn"), ("fp8", "rtn")])
def test_dense_export_reloads_as_evaluated_by_default(tmp_path, scheme, method):
    model, res = _dense(scheme=scheme, method=method)
    assert res.dtype == "float32"
    rep = ptq.export(model, res, tmp_path / "out")
    assert rep.dtype == "float32" and rep.rounded[0] == 0
    loaded, _ = models.load_export(tmp_path / "out", tokenizer=None)
    assert nnx.split(loaded)[0] == nnx.split(model)[0]  # one graphdef: `_log_probs` runs one program on both
    np.testing.assert_array_equal(_lp(loaded), _lp(model))


def test_a_smaller_dtype_is_chosen_at_quantize_time_and_evaluated(tmp_path):
    """dtype="bfloat16" at quantize time: the unquantized tensors are rounded before calibration (the embedding
    is, the quantized kernels are NVFP4), the export writes bfloat16 and reloads bit for bit."""
    ref = Llama(CFG, rngs=nnx.Rngs(0))
    model, res = _dense(dtype="bfloat16")
    assert res.dtype == "bfloat16"
    emb = np.asarray(model.embed.embedding[...])
    np.testing.assert_array_equal(emb, np.asarray(jnp.asarray(ref.embed.embedding[...]).astype(jnp.bfloat16)
                                                  .astype(jnp.float32)))
    assert not np.array_equal(emb, np.asarray(ref.embed.embedding[...]))
    norm = np.asarray(model.blocks[0].attn_norm.scale[...])  # 1-D: stays float32
    np.testing.assert_array_equal(norm, np.asarray(ref.blocks[0].attn_norm.scale[...]))
    rep = ptq.export(model, res, tmp_path / "out")
    assert rep.dtype == "bfloat16" and rep.rounded[0] == 0
    loaded, _ = models.load_export(tmp_path / "out", tokenizer=None)
    np.testing.assert_array_equal(_lp(loaded), _lp(model))


def test_export_in_another_dtype_warns(tmp_path):
    model, res = _dense(method="rtn")
    with pytest.warns(UserWarning, match=r"dtype='float16' but the model was quantized and evaluated in 'float32'.*"
                                         r"not the evaluated model \([1-9][0-9]* of [0-9]+ high-precision values"):
        rep = ptq.export(model, res, tmp_path / "out", dtype="float16")
    assert rep.dtype == "float16" and rep.rounded[0] > 0
    loaded, _ = models.load_export(tmp_path / "out", tokenizer=None)
    assert not np.array_equal(_lp(loaded), _lp(model))  # what the warning is about


def test_storage_dtype_refusals():
    model = Llama(CFG, rngs=nnx.Rngs(0))
    rules = [ptq.Rule(path=r"blocks/\d+/mlp/\w+_proj", scheme=ptq.scheme("nvfp4-mse"))]
    with pytest.raises(ValueError, match=r"dtype='int8' is not supported; allowed: 'float32', 'bfloat16', "
                                         r"'float16'"):
        ptq.quantize_model(model, rules, dtype="int8")
    model.embed.embedding.set_value(model.embed.embedding[...].at[3, 4].set(1e6))  # overflows float16
    before = jax.tree.map(np.asarray, nnx.state(model))
    with pytest.raises(ValueError, match=r"embed/embedding rounded to float16: .*1 Inf.*nothing was changed"):
        ptq.quantize_model(model, rules, dtype="float16", calibration=TOKENS)
    after = jax.tree.map(np.asarray, nnx.state(model))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


@pytest.mark.parametrize("family", moe.FAMILIES)
def test_moe_export_reloads_as_evaluated_by_default(tmp_path, family):
    model, res, tok = moe.quantized(family)
    ptq.export(model, res, tmp_path / "out", tokenizer=tok)
    loaded, _ = models.load_export(tmp_path / "out")
    np.testing.assert_array_equal(_lp(loaded, moe.TOKENS), _lp(model, moe.TOKENS))
