"""What `ptq.quantize` and the exporters refuse (issue 31): non-finite and all-zero weights at quantize, for every
method, before anything changes, naming the parameter; non-finite calibration inputs, naming the layer where they
enter; non-finite tensors at export (the high-precision ones too), naming the tensor."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlowfp import ptq
from jaxlowfp.models import Llama, ModelConfig

CFG = ModelConfig(vocab=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32,
                  tie_embeddings=False)
LINEARS = r"blocks/\d+/(attn|mlp)/\w+_proj"
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 16)), jnp.int32)
METHODS = ["rtn", "gptq", "smoothquant", "awq"]


def _rules(weights_only=False):
    return [ptq.Rule(path=LINEARS, scheme=ptq.scheme("nvfp4-mse", weights_only=weights_only))]


def _kernels(model):
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}


def _set(model, path, fn):
    var = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}[path]
    var.set_value(fn(var[...]))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_quantize_refuses_nonfinite_weights_before_changing_anything(method, value):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    _set(model, "blocks/1/mlp/up_proj/kernel", lambda k: k.at[3, 5].set(value))
    before = _kernels(model)
    what = "1 NaN and 0 Inf" if np.isnan(value) else "0 NaN and 1 Inf"
    with pytest.raises(ValueError, match=rf"blocks/1/mlp/up_proj/kernel: {what} of 4096 values \(first at index "
                                         rf"\(3, 5\)\).*Nothing was changed"):
        ptq.quantize_model(model, _rules(), method=method, calibration=TOKENS)
    after = _kernels(model)
    assert all(np.array_equal(before[p], after[p], equal_nan=True) for p in before)
    for _, mod in nnx.iter_graph(model):  # no hook was installed
        if isinstance(mod, nnx.Linear):
            assert not isinstance(mod.dot_general, ptq.ActQuant)


def test_quantize_refuses_nonfinite_high_precision_parameters():
    """A NaN norm scale (kept in high precision) poisons the calibration of every layer after it: refused too."""
    model = Llama(CFG, rngs=nnx.Rngs(0))
    _set(model, "blocks/0/mlp_norm/scale", lambda s: s.at[7].set(np.nan))
    with pytest.raises(ValueError, match=r"blocks/0/mlp_norm/scale: 1 NaN and 0 Inf of 64 values"):
        ptq.quantize_model(model, _rules(weights_only=True), method="rtn")


@pytest.mark.parametrize("method", METHODS)
def test_quantize_refuses_an_all_zero_layer(method):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    _set(model, "blocks/0/attn/k_proj/kernel", jnp.zeros_like)
    with pytest.raises(ValueError, match=r"kernels of blocks/0/attn/k_proj are all zero.*scheme=None"):
        ptq.quantize_model(model, _rules(), method=method, calibration=TOKENS)
    # the way out the message names: keep it in high precision
    keep = [ptq.Rule(path="blocks/0/attn/k_proj", scheme=None)] + _rules()
    res = ptq.quantize_model(model, keep, method="rtn", calibration=TOKENS)
    assert ("blocks/0/attn/k_proj", "blocks/0/attn/k_proj") in res.report.kept


class _Stack(nnx.Module):
    """x -> a -> relu -> b -> c: the input of b and c is non-finite when a's output overflows."""

    def __init__(self, rngs):
        self.a, self.b, self.c = (nnx.Linear(32, 32, rngs=rngs) for _ in range(3))

    def __call__(self, x):
        return self.c(self.b(nnx.relu(self.a(x))))


@pytest.mark.parametrize("pipeline", ["one-pass", "sequential"])
def test_gptq_names_the_layer_whose_input_is_nonfinite(pipeline):
    """Finite weights, an input that overflows after `a`: the first layer with a non-finite input (`b`) is named,
    not a later one (before, GPTQ named the last layer whose Hessian it built)."""
    if pipeline == "sequential":  # the Llama says its blocks: silu(gate) * up overflows in block 0
        model = Llama(CFG, rngs=nnx.Rngs(0))
        for p in ("gate", "up"):
            _set(model, f"blocks/0/mlp/{p}_proj/kernel", lambda k: k * 1e20)
        with pytest.raises(ValueError, match=r"calibration inputs of blocks/0/mlp/down_proj hold NaN or Inf .*; the "
                                             r"first of them in the model, blocks/0/mlp/down_proj, is where"):
            ptq.quantize_model(model, _rules(), method="gptq", calibration=TOKENS, pipeline="sequential")
        return
    model = _Stack(nnx.Rngs(0))
    model.a.kernel.set_value(model.a.kernel[...] * 1e37)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 8, 32)) * 10, jnp.float32)
    rules = [ptq.Rule(path="a|b|c", scheme=ptq.scheme("nvfp4-mse"))]
    with pytest.raises(ValueError, match=r"calibration inputs of b, c hold NaN or Inf .*; the first of them in "
                                         r"the model, b, is where"):
        ptq.quantize_model(model, rules, method="gptq", calibration=[x], forward=lambda m, b: m(b))


def test_export_refuses_nonfinite_tensors_and_names_them(tmp_path):
    """A model changed after quantize: a NaN embedding (kept in high precision) and an Inf quantized kernel are
    refused by both exporters with the tensor's name, before anything is written."""
    model = Llama(CFG, rngs=nnx.Rngs(0))
    res = ptq.quantize_model(model, _rules(weights_only=True), method="rtn")
    _set(model, "embed/embedding", lambda e: e.at[2, 1].set(np.nan))
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight \(parameter embed/embedding\): 1 NaN and 0 Inf "
                                         r"of 6144 values \(first at index \(2, 1\)\); refusing to export"):
        ptq.export(model, res, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()
    with pytest.raises(ValueError, match=r"token_embd.weight \(parameter embed/embedding\): 1 NaN and 0 Inf.*"
                                         r"refusing to export"):
        ptq.export_gguf(model, res, tmp_path / "m.gguf", tokenizer_json=_tokenizer(tmp_path))
    assert not (tmp_path / "m.gguf").exists()
    _set(model, "embed/embedding", lambda e: jnp.nan_to_num(e))
    _set(model, "blocks/1/mlp/down_proj/kernel", lambda k: k.at[0, 0].set(np.inf))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.weight \(parameter "
                                         r"blocks/1/mlp/down_proj/kernel\): 0 NaN and 1 Inf"):
        ptq.export(model, res, tmp_path / "ct")


def test_export_refuses_zero_and_nonfinite_scales(tmp_path):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    res = ptq.quantize_model(model, _rules(weights_only=True), method="rtn")
    arr, s = res.packed["blocks/0/mlp/gate_proj"]
    zero = type(arr)(codes=jnp.zeros_like(arr.codes), scales=arr.scales, global_scale=arr.global_scale,
                     format=arr.format, dtype=arr.dtype, shape=arr.shape)
    r = type(res)(**{**res.__dict__, "packed": {**res.packed, "blocks/0/mlp/gate_proj": (zero, s)}})
    with pytest.raises(ValueError, match=r"blocks/0/mlp/gate_proj: the quantized weight is all zero"):
        ptq.export(model, r, tmp_path / "a")
    with pytest.raises(ValueError, match=r"blocks/0/mlp/gate_proj: the quantized weight is all zero"):
        ptq.export_gguf(model, r, tmp_path / "a.gguf", tokenizer_json=_tokenizer(tmp_path))
    r = type(res)(**{**res.__dict__, "packed": {**res.packed, "blocks/0/mlp/gate_proj": (arr, jnp.float32(np.nan))}})
    with pytest.raises(ValueError, match=r"blocks/0/mlp/gate_proj: weight_global_scale is nan"):
        ptq.export(model, r, tmp_path / "b")


def _tokenizer(tmp_path):
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[:94]
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["ab"] = len(vocab)
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    path = tmp_path / "tokenizer.json"
    tk.save(str(path))
    return path
