"""Consumer fixtures for the mixture-of-experts NVFP4 exports (tests/test_moe_export.py; CI has no PyTorch):

    /work/venvs/ct/bin/python scripts/moe_ct_consumer.py    # writes tests/fixtures/moe/ct_consumer.npz

The venv: Python 3.11, ``pip install torch==2.13.0`` (the CPU build), then ``compressed-tensors transformers
safetensors numpy`` (made with transformers 5.24.0, compressed-tensors 0.20.1). The exports
``tests/fixtures/moe/{qwen3_moe,mixtral}_nvfp4`` are written by ``jaxlowfp.ptq.export``
(``PYTHONPATH=. .venv/bin/python tests/moe_export_common.py``); rerun this script after rewriting them.

1. transformers' own load (``AutoModelForCausalLM.from_pretrained`` of the export, its compressed-tensors
   integration): recorded, not trusted. transformers 5 keeps experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H],
   ``down_proj`` [E, H, I], not ``nn.Linear``), so ``integrations/compressed_tensors.py: CompressedTensorsDequantize``
   decompresses the per-expert tensors itself through a ``DummyModule`` holding only ``weight_packed``,
   ``weight_scale`` and ``weight_shape``: ``weight_global_scale`` never reaches the decompressor, and every NVFP4
   expert comes out ``q * s``, S_enc times too large (and in bfloat16: ``compressors/nvfp4/base.py: decompress``
   unpacks with ``unpack_fp4_from_uint8``'s default ``dtype=torch.bfloat16``). ``{fam}_hf_ratio``: its first
   expert's gate weight over ours (= that expert's weight_global_scale), ``{fam}_hf_names/dtypes/shapes``: its
   state dict.
2. compressed-tensors' own arithmetic per tensor (the fallback): every packed module of the export decoded by
   ``unpack_fp4_from_uint8`` + ``quantization.lifecycle.forward.dequantize`` (the NVFP4 compressor's two steps) in
   float32 with the config group's ``QuantizationArgs`` and the module's ``weight_global_scale``
   (``{fam}_w__<module>`` [out, in]), and ``NVFP4PackedCompressor.decompress`` itself (bfloat16,
   ``{fam}_bf16__<module>``); ``{fam}_ct_names/dtypes/shapes``: the tensors of the export as safetensors reads them.
3. ``{fam}_logprobs`` [T, vocab]: transformers' float32 model of the family (the unquantized fixture's config),
   its weights those of 2. (experts stacked into transformers' fused layout) and the export's high-precision
   tensors, scoring ``TOKENS``.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "moe"
TOKENS = np.array([[5, 17, 42, 99, 3, 250, 8, 61, 120, 7, 33, 200]], np.int64)  # as tests/moe_export_common.py
EXPERT_NAMES = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


def _record(out: dict, key: str, sd: dict) -> None:
    names = sorted(sd)
    out[f"{key}_names"] = np.array(names)
    out[f"{key}_dtypes"] = np.array([str(sd[n].dtype).replace("torch.", "") for n in names])
    out[f"{key}_shapes"] = np.array([str(tuple(sd[n].shape)) for n in names])


def main() -> None:
    out = {}
    for fam in ("qwen3_moe", "mixtral"):
        d = FIX / f"{fam}_nvfp4"
        mlp, g, u, dn = EXPERT_NAMES[fam]
        tensors = load_file(str(d / "model.safetensors"))
        _record(out, f"{fam}_ct", tensors)
        qcfg = json.loads((d / "config.json").read_text())["quantization_config"]
        group = next(iter(qcfg["config_groups"].values()))
        scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])

        # 1. transformers' own load
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        _record(out, f"{fam}_hf", hf.state_dict())

        # 2. compressed-tensors' arithmetic per module
        weights = {}
        for m in sorted(k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed")):
            packed, scale = tensors[m + ".weight_packed"], tensors[m + ".weight_scale"]
            rows, half = packed.shape
            q = unpack_fp4_from_uint8(packed, rows, 2 * half, dtype=torch.float32)
            w = dequantize(x_q=q, scale=scale.to(torch.float32), args=scheme.weights, dtype=torch.float32,
                           global_scale=tensors[m + ".weight_global_scale"])
            weights[m + ".weight"] = w
            out[f"{fam}_w__{m}"] = w.numpy()
            sd = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(m + ".")}
            out[f"{fam}_bf16__{m}"] = NVFP4PackedCompressor.decompress(sd, scheme)["weight"].float().numpy()
        gate0 = weights[f"model.layers.0.{mlp}.experts.0.{g}.weight"]
        hf_gate0 = hf.model.layers[0].mlp.experts.gate_up_proj[0, : gate0.shape[0]].detach().float()
        out[f"{fam}_hf_ratio"] = (hf_gate0 / torch.where(gate0 == 0, 1, gate0)).numpy()

        # 3. transformers' float32 model on those weights
        cfg = AutoConfig.from_pretrained(FIX / fam)
        ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        dense = {k: v.to(torch.float32) for k, v in tensors.items() if k.endswith(".weight") and
                 not k.endswith("_packed")}
        dense.update(weights)
        sd = {}
        for i in range(cfg.num_hidden_layers):
            pre = f"model.layers.{i}.{mlp}.experts."
            n_e = sum(1 for k in dense if k.startswith(pre) and k.endswith(f".{g}.weight"))
            gate_up = torch.stack([torch.cat([dense.pop(f"{pre}{e}.{g}.weight"), dense.pop(f"{pre}{e}.{u}.weight")])
                                   for e in range(n_e)])
            down = torch.stack([dense.pop(f"{pre}{e}.{dn}.weight") for e in range(n_e)])
            sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = gate_up
            sd[f"model.layers.{i}.mlp.experts.down_proj"] = down
            sd[f"model.layers.{i}.mlp.gate.weight"] = dense.pop(f"model.layers.{i}.{mlp}.gate.weight")
        sd.update(dense)
        missing, unexpected = ref.load_state_dict(sd, strict=False)
        assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
        with torch.no_grad():
            logits = ref(torch.from_numpy(TOKENS)).logits[0].float()
        out[f"{fam}_logprobs"] = torch.log_softmax(logits, -1).numpy().astype(np.float32)
        print(fam, "hf ratio (expert 0 gate)", float(out[f"{fam}_hf_ratio"].flat[0]),
              "global scale", float(tensors[f"model.layers.0.{mlp}.experts.0.{g}.weight_global_scale"][0]))
    np.savez_compressed(FIX / "ct_consumer.npz", **out)
    print("wrote", FIX / "ct_consumer.npz", len(out), "arrays")


if __name__ == "__main__":
    main()
