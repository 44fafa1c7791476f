"""llm-compressor's NVFP4 PTQ (RTN, GPTQ, AWQ) of a Hugging Face model on given calibration tokens, for
``bench/ptq_vs_llmcompressor.py``. Runs in a PyTorch venv, not in the project's:

    python3.11 -m venv /work/venvs/lc && /work/venvs/lc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    /work/venvs/lc/bin/python scripts/llmcompressor_ptq.py --model runs/smollm2-135m-hf \\
        --calib runs/ptq-vs-llmc/calib.npy --out runs/ptq-vs-llmc/llmc [--methods rtn,gptq,awq]

(the bench runs it so; versions used here: llmcompressor 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17.0,
torch 2.13.0+cpu). For each method it loads the float32 model, runs ``llmcompressor.oneshot`` with the sequential
pipeline on the token rows of ``--calib`` (int32 [n, seq]; every row one calibration sample, no shuffling, no
padding) and the recipe

    rtn   QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"])
    gptq  GPTQModifier(..., block_size=128, dampening_frac=0.01, actorder=<--actorder, default "static">)
    awq   AWQModifier(n_grid=20, duo_scaling=True) then the QuantizationModifier

(``--blocks N``: GPTQ of the first N decoder layers' projections only, the rest in high precision, and AWQ's
mappings (llm-compressor's default Llama mappings) restricted to those layers, the RTN after it on every layer: its
GPTQ took about 30 s per 576-column projection and its AWQ grid 7 s per point here, on a loaded 2-core CPU) and saves
the compressed-tensors checkpoint (``save_compressed=True``) under ``<out>/<method>``. On a machine without an
accelerator the AWQ cache's
``pin_memory`` (for host-to-device copies; it raises without a device) is made a no-op. ``results.json``
there records each run's wall time (oneshot only), the versions and the logits of the float model on the first
calibration row (its first 8 positions, first 16 vocabulary entries) for the bench's cross-check of the conversion.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--calib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--methods", default="rtn,gptq,awq")
    ap.add_argument("--actorder", default="static", help='GPTQ actorder: "static" (default), "weight" or "none"')
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=None,
                    help="GPTQ and AWQ only in the first N decoder layers (their CPU loops are slow)")
    args = ap.parse_args(argv)

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQMapping, AWQModifier
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.accelerator.is_available():  # AWQ pins its cache for host-to-device copies; pin_memory() needs
        IntermediatesCache.pin_memory = lambda self, *a, **k: None  # an accelerator, and there is nothing to copy
    calib = np.load(args.calib).astype(np.int64)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ds = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": np.ones_like(calib).tolist()})
    quant = dict(targets="Linear", scheme="NVFP4", ignore=["lm_head"])
    actorder = None if args.actorder == "none" else args.actorder
    gptq_quant, awq = dict(quant), {}
    if args.blocks is not None:
        idx = "|".join(map(str, range(args.blocks)))
        gptq_quant["targets"] = [f"re:model\\.layers\\.({idx})\\..*_proj$"]
        lay = f"re:.*layers\\.({idx})\\."
        awq["mappings"] = [AWQMapping(f"{lay}input_layernorm$", [f"{lay}self_attn\\.{p}_proj$" for p in "qkv"]),
                           AWQMapping(f"{lay}self_attn\\.v_proj$", [f"{lay}self_attn\\.o_proj$"]),
                           AWQMapping(f"{lay}post_attention_layernorm$",
                                      [f"{lay}mlp\\.gate_proj$", f"{lay}mlp\\.up_proj$"]),
                           AWQMapping(f"{lay}mlp\\.up_proj$", [f"{lay}mlp\\.down_proj$"])]
    recipes = {
        "rtn": lambda: QuantizationModifier(**quant),
        "gptq": lambda: GPTQModifier(**gptq_quant, block_size=128, dampening_frac=0.01, actorder=actorder),
        "awq": lambda: [AWQModifier(n_grid=20, duo_scaling=True, **awq), QuantizationModifier(**quant)],
    }
    previous = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    results = {"versions": {p: version(p) for p in ("llmcompressor", "compressed-tensors", "transformers", "torch")},
               "calib_shape": list(calib.shape), "actorder": args.actorder, "blocks": args.blocks,
               "runs": previous.get("runs", {})}
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        logits = ref(torch.from_numpy(calib[:1])).logits[0, :8, :16].numpy()
        results["float_logits"] = logits.tolist()
        del ref
    for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
        if method not in recipes:
            raise SystemExit(f"error: unknown method {method!r}; allowed: {', '.join(recipes)}")
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        t0 = time.perf_counter()
        oneshot(model=model, dataset=ds, recipe=recipes[method](), num_calibration_samples=len(calib),
                max_seq_length=calib.shape[1], shuffle_calibration_samples=False, pipeline="sequential")
        seconds = time.perf_counter() - t0
        model.save_pretrained(out / method, save_compressed=True)
        results["runs"][method] = {"seconds": seconds}
        print(f"{method}: oneshot {seconds:.1f} s -> {out / method}", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
