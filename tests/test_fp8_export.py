"""FP8 E4M3 W8A8 export (compressed-tensors ``float-quantized``, the ``FP8`` preset: one weight scale and a static
``input_scale`` per tensor) checked by its consumers, and read back by `models.load_export` (issue 28: PTQ to FP8,
packed).

Judges (tests/fixtures/fp8/ct_consumer.npz, written by scripts/fp8_ct_consumer.py in a torch venv from the committed
export tests/fixtures/fp8/tiny_llama_fp8): compressed-tensors' ``FloatQuantizationCompressor.decompress`` of every
module, transformers' float32 Llama on those weights with every quantized input fake-quantized by
compressed-tensors' ``fake_quantize`` and the static input scale, and transformers' own load of the directory
(which equals the former: max difference 0.0 when the fixture was made).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8_export_common import EXPORT, FIX, TOKENS, quantized
from jaxlowfp import ptq
from jaxlowfp.models import load, load_export
from jaxlowfp.ptq import checkpoint
from jaxlowfp.ptq.packing import packed_layers

CT = np.load(FIX / "ct_consumer.npz")


def _lp(model):
    return np.asarray(jax.nn.log_softmax(jax.jit(lambda m, x: m(x))(model, jnp.asarray(TOKENS))[0], -1))


def test_the_same_ptq_run_writes_the_committed_codes(tmp_path):
    """Integers bit for bit (the E4M3 code bytes), the float32 scales to one rounding (made on another machine)."""
    model, res = quantized()
    rep = checkpoint.export(model, res, tmp_path, dtype="float32")
    assert rep.quantized_bits == pytest.approx(8.0, abs=0.01)
    got = checkpoint.read_safetensors(tmp_path / checkpoint.WEIGHTS_FILE)
    committed = checkpoint.read_safetensors(EXPORT / checkpoint.WEIGHTS_FILE)
    assert set(got) == set(committed)
    for n, a in got.items():
        if a.dtype == ml_dtypes.float8_e4m3fn:
            np.testing.assert_array_equal(a.view(np.uint8), committed[n].view(np.uint8), err_msg=n)
        elif n.endswith("weight_scale"):  # max |w| / 448 of the same float32 weights: one rounding
            np.testing.assert_allclose(a, committed[n], rtol=2e-7, err_msg=n)
        elif n.endswith("input_scale"):
            # max |x| / 448 of an activation computed through the blocks before it: float32 GEMMs whose summation
            # order is the compiled program's (CPU ISA, fusion), so another machine's value differs by up to about
            # K * eps relative (K <= 256 here: 3e-5); measured 6.8e-7 on this project's CI VM for
            # model.layers.1.mlp.down_proj against the fixture's machine
            np.testing.assert_allclose(a, committed[n], rtol=3e-5, err_msg=n)
    assert sum(n.endswith("input_scale") for n in got) == 14


@pytest.mark.parametrize("packed,gemm", [(False, "auto"), (True, "auto"), (True, "fp8")])
def test_load_model_gives_what_compressed_tensors_and_transformers_compute(packed, gemm):
    """Decoded: every kernel is compressed-tensors' decompression (f32(q) * s, one IEEE rounding each side: within
    one float32 ulp). Log-probs of our load, decoded or packed (the fp8 backend's emulation on CPU multiplies the
    codes and applies the scales to the output), within 2e-5 (measured 1.9e-6) of transformers + compressed-tensors:
    the same quantized values in two programs, float32 rounding of the summation order, and compressed-tensors divides
    by the input scale where we multiply by its reciprocal (an activation code at a rounding tie may differ)."""
    model, _ = load_export(EXPORT, packed=packed, gemm=gemm, tokenizer=None)  # no tokenizer written
    if packed:
        layers = packed_layers(model)
        assert len(layers) == 14 and {lay.kernel.get_value().format.kind for lay in layers.values()} == {"fp8"}
        # gemm="fp8": the static input scale on the float8 GEMM (`backends.fp8_rows`), not the weights-only path
        assert all(lay.rows_gemm for lay in layers.values()) == (gemm == "fp8")
    else:
        for i in range(2):
            k = np.asarray(model.blocks[i].mlp.up_proj.kernel[...]).T
            np.testing.assert_array_max_ulp(k, CT[f"w__model.layers.{i}.mlp.up_proj"], maxulp=1)
    assert int(CT["hf_loaded"]) == 1
    np.testing.assert_array_equal(CT["hf_logprobs"], CT["logprobs"])  # transformers' own load = the manual path
    lp = _lp(model)
    print(f"packed={packed} gemm={gemm}: max |log p - transformers'| = {np.abs(lp - CT['logprobs']).max():.3g}")
    np.testing.assert_allclose(lp, CT["logprobs"], atol=2e-5, rtol=0)


def test_fp8_export_refusals(tmp_path):
    model, res = quantized()
    mixed = dataclasses.replace(res, schemes={**res.schemes, "blocks/0/mlp/up_proj": ptq.scheme("nvfp4-mse")})
    with pytest.raises(ValueError, match="one format per checkpoint"):
        checkpoint.export(model, mixed, tmp_path / "mixed", dtype="float32")
    hif8 = dataclasses.replace(res, schemes={**res.schemes, "blocks/0/mlp/up_proj": ptq.scheme("hif8")})
    with pytest.raises(ValueError, match="NVFP4 and FP8 E4M3 weights"):
        checkpoint.export(model, hif8, tmp_path / "hif8", dtype="float32")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for f in ("config.json", "model.safetensors"):
        (foreign / f).write_bytes((EXPORT / f).read_bytes())
    with pytest.raises(FileNotFoundError, match="not written by jaxlowfp.ptq.export"):
        load_export(foreign, tokenizer=None)
    with pytest.raises(Exception, match=r"format 'float-quantized'.*jaxlowfp.models.load_export"):
        load(EXPORT, tokenizer=None)  # models.load (floor below ptq) points to it
