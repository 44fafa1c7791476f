"""Exports ask the model (issue 27 item 2): a model that is not ours (the NNX Mamba2 of ``mamba2-jax``) says its
tensors and config through `jaxlowfp.ptq.protocol` and exports to compressed-tensors NVFP4 (read back with
``safetensors`` and decoded by the format's definition) and to GGUF (read back by ``gguf``'s own NVFP4
dequantizer). `jaxlowfp.ptq` imports nothing of `jaxlowfp.models` at module level; `models.load` takes
``tokenizer=``."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
import mamba2_jax.modeling as mamba  # the test extra installs it: a missing one fails, never skips
from flax import nnx

from jaxlowfp import ptq
from jaxlowfp.ptq.protocol import ExportTensor

FIX = Path(__file__).parent / "fixtures" / "interop"
E2M1 = np.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)  # OCP MX spec, FP4 E2M1 magnitudes


class Mamba2(mamba.Mamba2ForCausalLM):
    """mamba2-jax's model plus the export protocol: Hugging Face's Mamba2 names ("hf") and llama.cpp's mamba2
    names ("gguf", ``ssm_a = -exp(A_log)`` as its converter writes it)."""

    def export_tensors(self, target):
        c = self.cfg
        out = [ExportTensor(name="backbone.embeddings.weight" if target == "hf" else "token_embd.weight",
                            path="backbone/embedder/embedding")]
        for i in range(c.num_hidden_layers):
            p, h, g = f"backbone/layers/{i}", f"backbone.layers.{i}", f"blk.{i}"
            names = {"norm/weight": (f"{h}.norm.weight", f"{g}.attn_norm.weight", None, False),
                     "mixer/in_proj/kernel": (f"{h}.mixer.in_proj.weight", f"{g}.ssm_in.weight", None, True),
                     "mixer/conv1d/conv/kernel": (f"{h}.mixer.conv1d.weight", f"{g}.ssm_conv1d.weight",
                                                  lambda k: k[:, 0, :], True),
                     "mixer/conv1d/conv/bias": (f"{h}.mixer.conv1d.bias", f"{g}.ssm_conv1d.bias", None, False),
                     "mixer/dt_bias": (f"{h}.mixer.dt_bias", f"{g}.ssm_dt.bias", None, False),
                     "mixer/A_log": (f"{h}.mixer.A_log", f"{g}.ssm_a", None, False),
                     "mixer/D": (f"{h}.mixer.D", f"{g}.ssm_d", None, False),
                     "mixer/norm/weight": (f"{h}.mixer.norm.weight", f"{g}.ssm_norm.weight", None, False),
                     "mixer/out_proj/kernel": (f"{h}.mixer.out_proj.weight", f"{g}.ssm_out.weight", None, True)}
            for leaf, (hf, gg, fn, tr) in names.items():
                if target == "gguf" and leaf == "mixer/A_log":
                    fn = lambda a: -np.exp(a)  # noqa: E731
                out.append(ExportTensor(name=hf if target == "hf" else gg, path=f"{p}/{leaf}", transform=fn,
                                        transpose=tr))
        out.append(ExportTensor(name="backbone.norm_f.weight" if target == "hf" else "output_norm.weight",
                                path="backbone/final_norm/weight"))
        return out

    def export_config(self, target):
        c = self.cfg
        if target == "hf":
            return {"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "hidden_size": c.hidden_size,
                    "state_size": c.state_size, "head_dim": c.head_dim, "num_hidden_layers": c.num_hidden_layers,
                    "vocab_size": c.vocab_size, "expand": c.expand, "conv_kernel": c.conv_kernel}
        return {"architecture": "mamba2", "metadata": {
            "mamba2.context_length": 1 << 20, "mamba2.embedding_length": c.hidden_size,
            "mamba2.block_count": c.num_hidden_layers, "mamba2.ssm.conv_kernel": c.conv_kernel,
            "mamba2.ssm.inner_size": c.intermediate_size, "mamba2.ssm.state_size": c.state_size,
            "mamba2.ssm.time_step_rank": c.num_heads, "mamba2.ssm.group_count": 1,
            "mamba2.attention.layer_norm_rms_epsilon": c.layer_norm_epsilon}}


@pytest.fixture(scope="module")
def quantized():
    cfg = mamba.Mamba2Config(vocab_size=128, hidden_size=64, state_size=16, head_dim=16, chunk_size=16,
                             num_hidden_layers=2)
    model = Mamba2(cfg, rngs=nnx.Rngs(0))
    rules = [ptq.Rule(path=r"backbone/layers/\d+/mixer/(in|out)_proj", scheme=ptq.scheme("nvfp4-static_6",
                                                                                        weights_only=True))]
    res = ptq.quantize_model(model, rules, method="rtn")
    assert len(res.packed) == 4
    return model, res


def _kernel(model, i, p):
    return np.asarray(getattr(model.backbone.layers[i].mixer, f"{p}_proj").kernel[...])


def test_foreign_model_exports_to_compressed_tensors(tmp_path, quantized):
    model, res = quantized
    rep = ptq.export(model, res, tmp_path)
    from jaxlowfp.ptq.checkpoint import read_safetensors  # the container only (numpy's safetensors has no fp8)

    t = read_safetensors(tmp_path / "model.safetensors")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "mamba2" and cfg["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert sorted(cfg["quantization_config"]["config_groups"]["group_0"]["targets"]) == sorted(
        f"backbone.layers.{i}.mixer.{p}_proj" for i in range(2) for p in ("in", "out"))
    for i in range(2):
        for p in ("in", "out"):
            m = f"backbone.layers.{i}.mixer.{p}_proj"
            codes = t[f"{m}.weight_packed"]
            nib = np.stack([codes & 0xF, codes >> 4], -1).reshape(codes.shape[0], -1)  # element 2j: low nibble
            q = E2M1[nib & 7] * np.where(nib & 8, -1.0, 1.0).astype(np.float32)
            s = t[f"{m}.weight_scale"].view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
            w = q * np.repeat(s, 16, axis=1) / t[f"{m}.weight_global_scale"][0]  # the convention: q * s / g
            np.testing.assert_allclose(w, _kernel(model, i, p).T, rtol=2e-7, atol=0)
    # high precision in the dtype the model was quantized (and evaluated) in, PTQResult.dtype: float32 by default
    assert t["backbone.embeddings.weight"].dtype == np.float32 and t["backbone.norm_f.weight"].dtype == np.float32
    assert rep.quantized_fraction > 0.5


def test_foreign_model_exports_to_gguf(tmp_path, quantized):
    model, res = quantized
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())[:126])}
    vocab["ab"] = 126
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.save(str(tmp_path / "tokenizer.json"))
    rep = ptq.export_gguf(model, res, tmp_path / "m.gguf", tokenizer_json=tmp_path / "tokenizer.json")
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    assert r.fields["general.architecture"].contents() == "mamba2"
    tensors = {x.name: x for x in r.tensors}
    for i in range(2):
        for p, g in (("in", "ssm_in"), ("out", "ssm_out")):
            x = tensors[f"blk.{i}.{g}.weight"]
            assert x.tensor_type.name == "NVFP4" == rep.types[f"blk.{i}.{g}.weight"]
            w = gguf.quants.dequantize(x.data, x.tensor_type).reshape(tuple(int(n) for n in reversed(x.shape)))
            w = w * np.asarray(tensors[f"blk.{i}.{g}.scale"].data, np.float32)[0]
            np.testing.assert_array_equal(w, _kernel(model, i, p).T)
        a = np.asarray(tensors[f"blk.{i}.ssm_a"].data, np.float32)
        np.testing.assert_array_equal(a, -np.exp(np.asarray(model.backbone.layers[i].mixer.A_log[...])))
    assert tensors["token_embd.weight"].tensor_type.name == "F32"  # the evaluated dtype (PTQResult.dtype)


def test_protocol_errors(tmp_path, quantized):
    model, res = quantized

    class Partial(Mamba2):
        def export_tensors(self, target):
            return super().export_tensors(target)[:-1]

    part = Partial(model.cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"does not write the parameters \['backbone/final_norm/weight'\]"):
        ptq.export_gguf(part, None, tmp_path / "a.gguf", tokenizer_json=tmp_path / "none.json")
    plain = mamba.Mamba2ForCausalLM(model.cfg, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"does not say how it is exported; implement export_tensors"):
        ptq.export_gguf(plain, None, tmp_path / "a.gguf", tokenizer_json=tmp_path / "none.json")
    with pytest.raises(ValueError, match="give exactly one of path"):
        ExportTensor(name="x")


def test_ptq_does_not_import_models():
    code = ("import sys, jaxlowfp.ptq; from jaxlowfp.ptq import checkpoint, gguf_export, protocol; "
            "print([m for m in sys.modules if m.startswith('jaxlowfp.models')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_load_takes_a_tokenizer(tmp_path):
    """A compressed-tensors directory saved without tokenizer.json (as llm-compressor saves one given no
    tokenizer): a clear error, tokenizer=None, or a tokenizer from elsewhere."""
    from jaxlowfp.models import CheckpointError, Llama, ModelConfig, load

    cfg = ModelConfig(vocab=300, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32)
    m = Llama(cfg, rngs=nnx.Rngs(0))
    res = ptq.quantize_model(m, [ptq.Rule(path=r".*/mlp/\w+_proj", scheme=ptq.scheme("nvfp4-mse", weights_only=True))])
    ptq.export(m, res, tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"tokenizer.json: file not found \(llm-compressor saves none.*"
                                              r"tokenizer=None"):
        load(tmp_path / "ck")
    model, tok = load(tmp_path / "ck", tokenizer=None)
    assert tok is None and model.config.vocab == 300
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    (tmp_path / "tok").mkdir()
    tk.save(str(tmp_path / "tok" / "tokenizer.json"))
    model, tok = load(tmp_path / "ck", tokenizer=tmp_path / "tok")
    assert tok.vocab_size == 256 and tok.encode("ab") == [vocab["a"], vocab["b"]]


def test_compressed_tensors_decodes_the_foreign_export():
    """compressed-tensors 0.20's own decoder (``unpack_fp4_from_uint8`` + ``dequantize``, float32) on the Mamba2
    export's stored tensors (fixture by ``scripts/interop_live.py v31-ct``): ours in its order, bit for bit."""
    import jax.numpy as jnp

    import jaxlowfp
    from jaxlowfp.ptq import serving

    fx = np.load(FIX / "mamba2_ct_decoded.npz")
    keys = [k for k in fx.files if k.endswith("/ct_decoded")]
    assert len(keys) == 4
    for key in keys:
        m = key[: -len("/ct_decoded")]
        codes, g = fx[f"{m}/weight_packed"], fx[f"{m}/weight_global_scale"]
        scales = fx[f"{m}/weight_scale"].view(ml_dtypes.float8_e4m3fn)
        arr = jaxlowfp.QArray(codes=jnp.asarray(codes), scales=jnp.asarray(scales), global_scale=1.0 / g[0],
                              format=jaxlowfp.Format(kind="nvfp4"), dtype=jnp.dtype(jnp.float32),
                              shape=(codes.shape[0], codes.shape[1] * 2))
        ours = np.asarray(serving.decode(arr, jnp.float32(g[0]), "compressed-tensors"))
        np.testing.assert_array_equal(ours.view(np.uint32), fx[key].view(np.uint32), err_msg=m)
