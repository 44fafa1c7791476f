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


def test_llamacpp_ran_our_gguf_with_our_weights(smollm2, tmp_path):
    """llama.cpp's per-token log-probs (fixture) of the float32 control GGUF (our 4/6 weights as F32) against our
    forward of the same model: 2.2e-5 measured here (1.8e-5 when recorded, record.json), bar 5e-5 (two float32
    forwards, different summation orders; llama.cpp run with an F32 KV cache); the NVFP4 file 0.0669 nats per token
    on average and 0.421 at most, measured (llama.cpp's CPU backend quantizes activations to Q8_0 for NVFP4 dot
    products), bars 0.08 and 0.5. Then the file is exported again with today's `export_gguf` (the call that wrote
    the one llama.cpp ran, scripts/interop_live.py): the same tensor types, and its NVFP4 weights, decoded by
    llama.cpp's own gguf-py (``gguf.quants.dequantize``, times the ``.scale`` tensor), are our quantized kernels bit
    for bit, so the fixture's numbers are about what the exporter writes now."""
    import gguf

    from jaxlowfp.models import smollm2_135m_path

    fx = np.load(FIX / "smollm2_consumers.npz")
    rec = json.loads((FIX / "record.json").read_text())
    model, _ = smollm2  # conftest's fresh copy of the worker's SmolLM2 (quantized in place below)
    rules = [ptq.Rule(path=LINEARS, scheme=ptq.scheme("nvfp4-mse", weights_only=True))]
    res = ptq.quantize_model(model, rules, method="rtn")
    ids = fx["llamacpp/tokens"]
    ours = _logprobs(np.asarray(model(jnp.asarray([ids], jnp.int32))[0], np.float32))
    ours = ours[np.arange(len(ids) - 1), ids[1:]]
    control = np.abs(fx["llamacpp/smollm2-f32-control/token_logprobs"] - ours)
    nvfp4 = np.abs(fx["llamacpp/smollm2-nvfp4-mse/token_logprobs"] - ours)
    assert control.max() < 5e-5
    assert nvfp4.mean() < 0.08 and nvfp4.max() < 0.5
    # the record's figures are the ones measured here (to the float32 summation order of this machine)
    assert abs(rec["llamacpp_smollm2-nvfp4-mse"]["mean_abs_token_logprob_diff_vs_ours"] - nvfp4.mean()) < 1e-4
    assert rec["llamacpp_smollm2-f32-control"]["max_abs_token_logprob_diff_vs_ours"] < 5e-5

    rep = ptq.export_gguf(model, res, tmp_path / "m.gguf", source_gguf=smollm2_135m_path())
    assert sorted(set(rep.types.values())) == ["F32", "NVFP4", "Q8_0"] and rep.rounded == (0, 0)
    assert sum(t == "NVFP4" for t in rep.types.values()) == 210  # the 7 projections of 30 blocks
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    for i in (0, 29):  # not the q / k rows, which llama.cpp's layout permutes
        for name, proj in (("ffn_up", "mlp/up_proj"), ("ffn_down", "mlp/down_proj"), ("attn_v", "attn/v_proj"),
                           ("attn_output", "attn/o_proj")):
            t = tensors[f"blk.{i}.{name}.weight"]
            scale = np.float32(np.asarray(tensors[f"blk.{i}.{name}.scale"].data).reshape(()))
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32) * scale
            kernel = np.asarray(getattr(getattr(model.blocks[i], proj.split("/")[0]), proj.split("/")[1])
                                .kernel[...])
            np.testing.assert_array_equal(w, kernel.T, err_msg=t.name)
