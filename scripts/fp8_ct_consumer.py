"""Consumer fixtures for the FP8 E4M3 W8A8 export (tests/test_fp8_export.py; CI has no PyTorch):

    /work/venvs/ct/bin/python scripts/fp8_ct_consumer.py    # writes tests/fixtures/fp8/ct_consumer.npz

The venv is scripts/moe_ct_consumer.py's (Python 3.11, torch 2.13.0 CPU, transformers 5.24.0, compressed-tensors
0.20.1). The export ``tests/fixtures/fp8/tiny_llama_fp8`` is written by ``jaxlowfp.ptq.checkpoint.export``
(``PYTHONPATH=. .venv/bin/python tests/fp8_export_common.py``); rerun this script after rewriting it.

1. compressed-tensors' own arithmetic per module: ``FloatQuantizationCompressor.decompress`` (the
   ``float-quantized`` format's decompressor, with the config group's ``QuantizationArgs``) of every quantized
   module, in float32 (``w__<module>`` [out, in]).
2. ``logprobs`` [T, vocab]: transformers' float32 ``LlamaForCausalLM`` of the export's config, its weights those of
   1. and the export's high-precision tensors, every quantized Linear's input fake-quantized by compressed-tensors'
   ``fake_quantize`` with the module's static ``input_scale`` and the group's input ``QuantizationArgs`` (a forward
   pre-hook): what a W8A8 FP8 engine computes, in float32.
3. ``hf_logprobs``: transformers' own load of the directory (``AutoModelForCausalLM.from_pretrained``, its
   compressed-tensors integration), scoring the same tokens; ``hf_loaded`` is 1 if it loaded, else 0 and
   ``hf_error`` says why.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "fp8"
EXPORT = FIX / "tiny_llama_fp8"
TOKENS = np.array([[5, 17, 42, 99, 3, 250, 8, 61, 120, 7, 33, 200]], np.int64)  # as tests/fp8_export_common.py


def main() -> None:
    out: dict[str, np.ndarray] = {}
    tensors = load_file(str(EXPORT / "model.safetensors"))
    qcfg = json.loads((EXPORT / "config.json").read_text())["quantization_config"]
    group = next(iter(qcfg["config_groups"].values()))
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"],
                                input_activations=group["input_activations"])
    w_args, a_args = QuantizationArgs(**group["weights"]), QuantizationArgs(**group["input_activations"])

    # 1. compressed-tensors' decompressor per module
    weights = {}
    for m in group["targets"]:
        sd = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(m + ".")}
        w = FloatQuantizationCompressor.decompress(sd, scheme)["weight"].to(torch.float32)
        weights[m + ".weight"] = w
        out[f"w__{m}"] = w.numpy()

    # 2. transformers' float32 Llama on those weights, inputs fake-quantized by compressed-tensors
    cfg = AutoConfig.from_pretrained(EXPORT)
    cfg.quantization_config = None
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    sd = {k: v.to(torch.float32) for k, v in tensors.items()
          if k.endswith(".weight") and k[: -len(".weight")] not in group["targets"]}
    sd.update(weights)
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    modules = dict(ref.named_modules())
    for m in group["targets"]:
        scale = tensors[m + ".input_scale"].to(torch.float32)
        modules[m].register_forward_pre_hook(
            lambda mod, args, s=scale: (fake_quantize(args[0], scale=s, zero_point=None, args=a_args),))
    with torch.no_grad():
        logits = ref(torch.from_numpy(TOKENS)).logits[0].float()
    out["logprobs"] = torch.log_softmax(logits, -1).numpy().astype(np.float32)

    # 3. transformers' own load
    try:
        hf = AutoModelForCausalLM.from_pretrained(EXPORT, dtype=torch.float32).eval()
        with torch.no_grad():
            out["hf_logprobs"] = torch.log_softmax(hf(torch.from_numpy(TOKENS)).logits[0].float(), -1).numpy()
        out["hf_loaded"] = np.array(1)
    except Exception as e:  # recorded, not trusted: a consumer gap is a finding, not a crash of this script
        out["hf_loaded"], out["hf_error"] = np.array(0), np.array(f"{type(e).__name__}: {e}"[:2000])
    np.savez_compressed(FIX / "ct_consumer.npz", **out)
    print("wrote", FIX / "ct_consumer.npz", sorted(out)[:4], "...", "hf_loaded", int(out["hf_loaded"]),
          str(out.get("hf_error", ""))[:300])
    if int(out["hf_loaded"]):
        print("max |hf - manual| log-probs", float(np.abs(out["hf_logprobs"] - out["logprobs"]).max()))
    _ = w_args


if __name__ == "__main__":
    main()
