"""The FP8 E4M3 W8A8 export that scripts/fp8_ct_consumer.py reads with compressed-tensors + transformers and that
tests/test_fp8_export.py rebuilds: a two-block tiny Llama (random weights, seed 0), RTN FP8 on every projection
(one scale amax / 448 per tensor), static activation scales calibrated on fixed random tokens (compressed-tensors'
``FP8`` preset: ``input_scale`` per tensor), written by `jaxlowfp.ptq.checkpoint.export`.

    PYTHONPATH=. .venv/bin/python tests/fp8_export_common.py     # rewrites tests/fixtures/fp8/tiny_llama_fp8
    /work/venvs/ct/bin/python scripts/fp8_ct_consumer.py          # then tests/fixtures/fp8/ct_consumer.npz
"""
from pathlib import Path

import numpy as np
from flax import nnx

from jaxlowfp import ptq
from jaxlowfp.models.llama import Llama, preset

FIX = Path(__file__).parent / "fixtures" / "fp8"
EXPORT = FIX / "tiny_llama_fp8"
TOKENS = np.array([[5, 17, 42, 99, 3, 250, 8, 61, 120, 7, 33, 200]], np.int32)  # the fixed sequence scored
CALIB = np.random.default_rng(1).integers(0, 256, (4, 16)).astype(np.int32)


def config():
    return preset("tiny", n_layers=2)


def quantized():
    """(model, PTQResult): the tiny Llama after FP8 W8A8 RTN with static activation scales."""
    model = Llama(config(), rngs=nnx.Rngs(0))
    res = ptq.quantize_model(model, [ptq.Rule(path=r".*_proj", scheme=ptq.scheme("fp8"))], calibration=CALIB,
                             activation_scale="static", progress=False)
    return model, res


def write_fixture() -> None:
    import shutil

    model, res = quantized()
    shutil.rmtree(EXPORT, ignore_errors=True)
    rep = ptq.checkpoint.export(model, res, EXPORT, dtype="float32")
    print(f"wrote {EXPORT}: {rep.quantized_bits:.3f} bits per quantized weight")


if __name__ == "__main__":
    write_fixture()
