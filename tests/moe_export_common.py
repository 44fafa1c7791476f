"""The MoE NVFP4 exports that scripts/moe_ct_consumer.py reads with transformers + compressed-tensors and that
tests/test_moe_export.py rebuilds: a tiny Qwen3-MoE and Mixtral (tests/fixtures/moe), GPTQ NVFP4 weights (4/6
"mse" blocks, W4A16) on every Linear and expert weight except the router and the head (and Mixtral's down_proj, of
24 inputs: not whole 16-value blocks)."""
from pathlib import Path

import numpy as np

from jaxlowfp import ptq
from jaxlowfp.models import load

FIX = Path(__file__).parent / "fixtures" / "moe"
FAMILIES = ("qwen3_moe", "mixtral")
TOKENS = np.array([[5, 17, 42, 99, 3, 250, 8, 61, 120, 7, 33, 200]], np.int32)  # the fixed sequence scored


def rules(family):
    keep = r".*(router|lm_head).*" + (r"|blocks/\d+/mlp/experts/down_proj" if family == "mixtral" else "")
    return [ptq.Rule(path=keep, scheme=None),
            ptq.Rule(path=r".*", scheme=ptq.scheme("nvfp4-mse", weights_only=True))]


def quantized(family):
    """(model, PTQResult) of the family's fixture after GPTQ on fixed random calibration tokens."""
    model, tok = load(FIX / family)
    calib = np.random.default_rng(0).integers(0, 280, (4, 16)).astype(np.int32)
    res = ptq.quantize_model(model, rules(family), method="gptq", calibration=calib)
    return model, res, tok


def write_fixtures() -> None:
    """Rewrite tests/fixtures/moe/{qwen3_moe,mixtral}_nvfp4 (then rerun scripts/moe_ct_consumer.py in its torch
    venv for ct_consumer.npz):

        PYTHONPATH=. .venv/bin/python tests/moe_export_common.py
    """
    import shutil

    for fam in FAMILIES:
        model, res, tok = quantized(fam)
        out = FIX / f"{fam}_nvfp4"
        shutil.rmtree(out, ignore_errors=True)
        ptq.checkpoint.export(model, res, out, tokenizer=tok, dtype="float32")
        print(f"wrote {out} ({res.pipeline} pipeline)")


if __name__ == "__main__":
    write_fixtures()
