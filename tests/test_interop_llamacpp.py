"""llama.cpp ran our GGUF export of SmolLM2-135M with our 4/6 weights (issue 20): its per-token log-probs, recorded by
``scripts/interop_live.py`` with llama-cpp-python 0.3.36 built for CPU (fixture), against our forward of the same
weights, recomputed here."""
from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxlowfp import ptq

FIX = Path(__file__).parent / "fixtures" / "interop"
LINEARS = r"blocks/\d+/(attn|mlp)/\w+_proj"


def _logprobs(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_llamacpp_ran_our_gguf_with_our_weights(smollm2):
    """llama.cpp's per-token log-probs (fixture) of the float32 control GGUF (our 4/6 weights as F32) against our
    forward of the same model: 1e-4 (two float32 forwards, different summation orders; llama.cpp run with an F32 KV
    cache); the NVFP4 file 0.15 nats per token on average (llama.cpp's CPU backend quantizes activations to Q8_0
    for NVFP4 dot products: 0.067 measured)."""
    fx = np.load(FIX / "smollm2_consumers.npz")
    model, _ = smollm2  # conftest's fresh copy of the worker's SmolLM2 (quantized in place below)
    rules = [ptq.Rule(path=LINEARS, scheme=ptq.scheme("nvfp4-mse", weights_only=True))]
    ptq.quantize_model(model, rules, method="rtn")
    ids = fx["llamacpp/tokens"]
    ours = _logprobs(np.asarray(model(jnp.asarray([ids], jnp.int32))[0], np.float32))
    ours = ours[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(fx["llamacpp/smollm2-f32-control/token_logprobs"], ours, atol=1e-4, rtol=0)
    assert np.abs(fx["llamacpp/smollm2-nvfp4-mse/token_logprobs"] - ours).mean() < 0.15


def test_llamacpp_record():
    rec = json.loads((FIX / "record.json").read_text())
    assert rec["llamacpp_smollm2-f32-control"]["max_abs_token_logprob_diff_vs_ours"] < 1e-4
    assert "Paris" in rec["llamacpp_smollm2-nvfp4-mse"]["greedy_chat"]
