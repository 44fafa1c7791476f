"""jaxlowfp.models Hugging Face loading: tiny sharded safetensors directories (random weights; untied, tied, Qwen2
biases, Qwen3 q/k norms, Llama-3 rope scaling) give the logits of the numpy oracle; tokenizer.json; clear errors."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from safetensors.numpy import save_file

from test_models_oracle import forward, random_weights, read_hf, tiny_bpe
from jaxlowfp.models import CheckpointError, load

CFG = dict(vocab=272, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96, tied=False,
           theta=10_000.0, eps=1e-5)


def write_tokenizer(path) -> None:
    tokens, merges, types = tiny_bpe()
    tk = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    tk.add_special_tokens([tokenizers.AddedToken(t, special=True) for t, ty in zip(tokens, types) if ty == 3])
    tk.save(str(path))


def write_hf(directory, weights: dict, cfg: dict = CFG, *, model_type: str = "llama", shards: int = 2,
             index: bool = True, config: dict | None = None, skip: tuple = (), tokenizer: bool = True) -> None:
    """config.json, weights split over ``shards`` safetensors files (with model.safetensors.index.json), tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    c = {"model_type": model_type, "architectures": ["LlamaForCausalLM"], "vocab_size": cfg["vocab"],
         "hidden_size": cfg["d_model"], "intermediate_size": cfg["d_ff"], "num_hidden_layers": cfg["n_layers"],
         "num_attention_heads": cfg["n_heads"], "num_key_value_heads": cfg["n_kv_heads"], "rms_norm_eps": cfg["eps"],
         "rope_theta": cfg["theta"], "max_position_embeddings": 128, "tie_word_embeddings": cfg["tied"],
         "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
    if cfg["head_dim"] * cfg["n_heads"] != cfg["d_model"]:
        c["head_dim"] = cfg["head_dim"]
    (directory / "config.json").write_text(json.dumps(c | (config or {})))
    names = [n for n in sorted(weights) if n not in skip]
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = {("" if n == "lm_head.weight" else "model.") + n: weights[n] for n in names[s::shards]}
        save_file(part, str(directory / file))
        weight_map |= {n: file for n in part}
    if index:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if tokenizer:
        write_tokenizer(directory / "tokenizer.json")


@pytest.mark.parametrize("model_type,extra", [
    ("llama", {}),
    ("llama", {"tied": True, "shards": 1}),
    ("mistral", {"shards": 3, "index": False}),
    ("qwen2", {"bias": True}),
    ("qwen3", {"qk_norm": True, "head_dim": 32, "tied": True}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16}, "theta": 500_000.0}),
])
def test_hf_logits_match_the_numpy_oracle(tmp_path, model_type, extra):
    cfg = CFG | {k: v for k, v in extra.items() if k in CFG}
    weights = random_weights(cfg, seed=3, bias=extra.get("bias", False), qk_norm=extra.get("qk_norm", False))
    config = {"rope_scaling": extra["rope_scaling"]} if "rope_scaling" in extra else None
    write_hf(tmp_path, weights, cfg, model_type=model_type, shards=extra.get("shards", 2),
             index=extra.get("index", True), config=config)
    model, tok = load(tmp_path)
    assert (model.config.tie_embeddings, model.config.qkv_bias, model.config.qk_norm) == (
        cfg["tied"], model_type == "qwen2", model_type == "qwen3")
    assert (model.config.rope_freq_factors is None) == (config is None)
    ids = np.random.default_rng(2).integers(0, cfg["vocab"], 40)
    ours = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(ids[None], jnp.int32)))[0]
    w, ocfg = read_hf(tmp_path)
    np.testing.assert_allclose(ours, forward(w, ocfg, ids, "half"), rtol=1e-4, atol=1e-4)
    if config is not None:  # the scaling changes the logits (long wavelengths are stretched)
        plain = forward(w, ocfg | {"factors": None}, ids, "half")
        assert np.abs(plain - ours).max() > 1e-3


def test_hf_bfloat16_weights_load_as_float32(tmp_path):
    import ml_dtypes

    weights = {k: v.astype(ml_dtypes.bfloat16) for k, v in random_weights(CFG).items()}
    write_hf(tmp_path, weights)
    model, _ = load(tmp_path)
    got = np.asarray(model.blocks[1].mlp.up_proj.kernel[...])
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, weights["layers.1.mlp.up_proj.weight"].astype(np.float32).T)


def test_loads_of_one_configuration_are_independent_models(tmp_path):
    """Every load of a configuration fills a clone of one abstract model (`jaxlowfp.models.common.abstract_model`,
    built once): changing a loaded model (a weight set, weights quantized in place, a module replaced by QAT
    quantization) changes no other load."""
    from jaxlowfp import ptq, qat, qnnx
    from jaxlowfp.models.common import _template

    weights = random_weights(CFG, seed=5)
    write_hf(tmp_path, weights)
    first, _ = load(tmp_path)
    hits = _template.cache_info().hits
    second, _ = load(tmp_path)
    assert _template.cache_info().hits == hits + 1  # the second load reused the abstract model
    linear = type(second.blocks[1].attn.q_proj)
    first.blocks[0].mlp.up_proj.kernel[...] = jnp.zeros_like(first.blocks[0].mlp.up_proj.kernel[...])
    ptq.quantize_model(first, [ptq.Rule(path=r"blocks/1/mlp/\w+_proj", scheme=ptq.scheme("nvfp4-mse"))],
                       method="rtn", progress=False)
    qnnx.quantize_model(first, [qnnx.Rule(path=r"blocks/1/attn/q_proj", recipe=qat.hif8_w8a8())])
    assert type(first.blocks[1].attn.q_proj) is not linear  # QAT quantization replaced the module in `first`
    w = "layers.1.mlp.down_proj.weight"
    assert not np.array_equal(np.asarray(first.blocks[1].mlp.down_proj.kernel[...]), weights[w].T)  # PTQ changed it
    for model in (second, load(tmp_path)[0]):  # and nothing else
        assert type(model.blocks[1].attn.q_proj) is linear
        for i, proj in ((0, "up_proj"), (1, "up_proj"), (1, "down_proj")):
            got = np.asarray(getattr(model.blocks[i].mlp, proj).kernel[...])
            np.testing.assert_array_equal(got, weights[f"layers.{i}.mlp.{proj}.weight"].T)
    assert not np.asarray(first.blocks[0].mlp.up_proj.kernel[...]).any()


def test_hf_tokenizer_round_trips(tmp_path):
    write_hf(tmp_path, random_weights(CFG))
    _, tok = load(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 264)
    for text in ["the thin cat", " indented\n\ttext ", "café 東京 🙂 <|im_end|>"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_end|>") == [2]


@pytest.mark.parametrize("kw,match", [
    (dict(model_type="gpt2"), r"config\.json: model_type 'gpt2' .* is not supported; allowed: 'llama'"),
    (dict(skip=("layers.1.mlp.up_proj.weight",)), r"tensor model\.layers\.1\.mlp\.up_proj\.weight is missing"),
    (dict(config={"intermediate_size": 80}), r"model-0000\d-of-00002\.safetensors: tensor "
                                             r"model\.layers\.\d\.mlp\.\w+_proj\.weight has shape"),
    (dict(config={"vocab_size": 200}), r"tokenizer\.json: the tokenizer has 264 tokens but the model's vocabulary"),
    (dict(tokenizer=False), r"tokenizer\.json: file not found"),
    (dict(config={"hidden_act": "gelu"}), r"hidden_act 'gelu' is not supported"),
    (dict(config={"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}), r"rope scaling type 'yarn'"),
])
def test_hf_bad_inputs_are_clear_errors(tmp_path, kw, match):
    write_hf(tmp_path, random_weights(CFG), **kw)
    with pytest.raises(CheckpointError, match=match):
        load(tmp_path)


def test_hf_broken_files_are_clear_errors(tmp_path):
    write_hf(tmp_path / "a", random_weights(CFG))
    shard = tmp_path / "a" / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])  # truncated
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: not a readable safetensors file "
                                              r"\(truncated or corrupt\?\)"):
        load(tmp_path / "a")
    write_hf(tmp_path / "b", random_weights(CFG))
    (tmp_path / "b" / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors: shard listed in "
                                              r"model\.safetensors\.index\.json not found"):
        load(tmp_path / "b")
    (tmp_path / "c").mkdir()
    with pytest.raises(CheckpointError, match=r"c/config\.json: file not found"):
        load(tmp_path / "c")
    write_hf(tmp_path / "d", random_weights(CFG) | {"layers.0.mlp.extra.weight": np.ones(3, np.float32)})
    with pytest.raises(CheckpointError, match=r"tensors this model class does not have: model\.layers\.0\.mlp\.extra"):
        load(tmp_path / "d")
