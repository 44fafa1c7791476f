"""PTQ to FP8 E4M3 (per-tensor scale amax / 448) and MXFP8 (E4M3 elements, an E8M0 scale per 32), RTN and GPTQ,
packed and run on the low-precision backends (issue 28: PTQ could not produce FP8 / MXFP8 packed models).

Judges we did not write: ml_dtypes' float8_e4m3fn and float8_e8m0fnu decode the packed codes and scales (numpy
arithmetic), and ml_dtypes' E4M3 cast says whether a value is on the grid. The packed products against the
fake-quant model: within float32 rounding of the summation order (per layer, `tests/test_packed.py`'s bound), on a
two-layer MLP where no activation code can flip between the two arithmetics by more than that.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxlowfp import ptq
from jaxlowfp.ptq.packing import packed_layers
from test_ptq_pack import _MLP  # the two-layer MLP the other pack tests use

E4M3 = ml_dtypes.float8_e4m3fn


X = jax.random.normal(jax.random.key(1), (8, 64), jnp.float32)
CAL = jax.random.normal(jax.random.key(2), (512, 64), jnp.float32)  # full-rank Hessians for GPTQ


def _on_e4m3_grid(v: np.ndarray) -> bool:
    return bool(np.all(v.astype(E4M3).astype(np.float32) == v))


def _quantized(name, method):
    model = _MLP(nnx.Rngs(0))
    kw = {"method": ptq.GPTQ(), "calibration": [CAL], "forward": lambda m, b: m(b)} if method == "gptq" else {}
    res = ptq.quantize_model(model, [ptq.Rule(path=r".*_proj", scheme=ptq.scheme(name))], progress=False,
                             activation_scale="tensor", **kw)
    return model, res


@pytest.mark.parametrize("method", ["rtn", "gptq"])
@pytest.mark.parametrize("name", ["fp8", "mxfp8"])
def test_weights_are_on_the_grid_and_pack_to_codes_ml_dtypes_decodes(name, method):
    model, res = _quantized(name, method)
    kernels = {p: np.asarray(getattr(model, p.split("/")[-1]).kernel[...]) for p in ("up_proj", "down_proj")}
    original = _MLP(nnx.Rngs(0))
    # quantized, not trivially: RTN moves a weight by at most half an E4M3 step of the tensor max (1/32), MXFP8 by the
    # floor rule's saturation of its block max (448 for up to 512: 1/8); GPTQ feeds each column's error on
    bound = 0.2 if method == "gptq" else (0.04 if name == "fp8" else 0.13)
    for path, k in kernels.items():
        wt = k.T  # [out, in]: blocks along in
        if name == "fp8":  # w = q s for one float32 s: the max is 448 s, so s is within ulps of max|w| / 448
            s0 = np.float32(np.max(np.abs(wt)) / np.float32(448))
            near = [s0, *(np.float32(s0 + d * np.spacing(s0)) for d in (-3, -2, -1, 1, 2, 3))]
            assert any(np.array_equal((wt / s).astype(E4M3).astype(np.float32) * s, wt) for s in near)
        else:
            blocks = wt.reshape(wt.shape[0], -1, 32)
            e = np.floor(np.log2(np.max(np.abs(blocks), axis=-1, keepdims=True))) - 8  # OCP: 2^(floor log2 amax - 8)
            assert _on_e4m3_grid(blocks / np.exp2(e).astype(np.float32))
        w0 = np.asarray(getattr(original, path).kernel[...])
        assert 0 < np.max(np.abs(k - w0)) < bound * np.max(np.abs(w0))
    fake = model(X)
    report = ptq.pack_model(model, res, gemm="dequant")
    assert report.bits_per_param == pytest.approx(8.0 if name == "fp8" else 8.25, abs=0.01)
    for path, layer in packed_layers(model).items():
        a = layer.kernel.get_value().array  # W'^T [N, K]
        codes = np.asarray(a.codes).view(np.uint8).view(E4M3).astype(np.float32)
        if name == "fp8":
            decoded = codes * np.float32(a.scale)
        else:
            scales = np.asarray(a.scales).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
            decoded = (codes.reshape(codes.shape[0], -1, 32) * scales[..., None]).reshape(codes.shape)
        np.testing.assert_array_equal(decoded.T, kernels[path])
    got = np.asarray(model(X))
    if name == "fp8":  # M = 8 on CPU: the native GEMV (same weight values, its own float32 summation order)
        np.testing.assert_allclose(got, np.asarray(fake), rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_array_equal(got, np.asarray(fake))  # dequant: the same program's values


@pytest.mark.parametrize("name,backend", [("fp8", "fp8"), ("mxfp8", "scaled_matmul")])
def test_packed_fp8_and_mxfp8_run_their_gemm_backend(name, backend):
    model, res = _quantized(name, "rtn")
    fake = model(X)
    report = ptq.pack_model(model, res, gemm=backend)
    assert {b for _, _, b, _ in report.layers} == {backend}
    y = jax.jit(lambda m, x: m(x))(model, X)
    np.testing.assert_allclose(np.asarray(y), np.asarray(fake), rtol=0, atol=2e-5 * float(jnp.max(jnp.abs(fake))))


def test_gptq_of_fp8_beats_rtn_on_the_calibration_output():
    """GPTQ's per-tensor FP8 path (the HiF8 one with E4M3): same scale, error fed forward, lower output error."""
    ref = _MLP(nnx.Rngs(0))
    y_ref = ref.up_proj(CAL)
    errs = {}
    for method in ("rtn", "gptq"):
        model, _ = _quantized("fp8", method)
        errs[method] = float(jnp.mean((CAL @ model.up_proj.kernel[...] + model.up_proj.bias[...][None] - y_ref) ** 2))
    assert errs["gptq"] < errs["rtn"]


@pytest.mark.parametrize("activation_scale", ["token", "static"])
def test_fp8_per_token_and_static_activations_on_the_fp8_gemm(activation_scale):
    """Per-token / static activation scales on the float8 GEMM (`backends.fp8_rows`): each row's codes are those the
    op layer's quantizer rounds to, its scale applied to the output; equal to the fake-quant model within float32
    rounding."""
    model = _MLP(nnx.Rngs(0))
    res = ptq.quantize_model(model, [ptq.Rule(path=r".*_proj", scheme=ptq.scheme("fp8"))], progress=False,
                             calibration=[CAL], forward=lambda m, b: m(b), activation_scale=activation_scale)
    fake = model(X)
    report = ptq.pack_model(model, res, gemm="fp8")
    assert {b for _, _, b, _ in report.layers} == {"fp8"}
    assert all(layer.rows_gemm for layer in packed_layers(model).values())
    y = jax.jit(lambda m, x: m(x))(model, X)
    np.testing.assert_allclose(np.asarray(y), np.asarray(fake), rtol=0, atol=2e-5 * float(jnp.max(jnp.abs(fake))))
