"""PTQ of mixture-of-experts models (issue 29 item 3): every expert quantized as its own GEMM, calibrated on the
tokens routed to it; experts that no calibration token reaches fall back with a warning, and no 0, NaN or Inf scale
is ever produced."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlowfp import execution, nvfp4, ptq
from jaxlowfp.models import load

FIX = Path(__file__).parent / "fixtures" / "moe"
EXPERTS = r"blocks/\d+/mlp/experts/(gate|up|down)_proj"


def _calib(n=4, t=16, seed=0):
    return np.random.default_rng(seed).integers(0, 100, (n, t)).astype(np.int32)


@pytest.fixture(scope="module")
def rtn():
    model, _ = load(FIX / "qwen3_moe")
    ref = {p: np.asarray(getattr(m, n)[...]) for p, m, n in ptq.experts.grouped_weights(model)}
    res = ptq.quantize_model(model, [ptq.Rule(path=EXPERTS, scheme=ptq.scheme("nvfp4-mse"))], method="rtn",
                       calibration=_calib(), activation_scale="static")
    return model, res, ref


def test_rtn_quantizes_every_expert_as_its_own_matrix(rtn):
    """Independent of the PTQ code: expert e's stored weight is `nvfp4.fake_quantize` of W_e^T (blocks along K),
    its global amax the max of its gate and up weights (vLLM's reconciled w1/w3 scale)."""
    model, res, ref = rtn
    assert {p for p, _ in res.report.quantized} == set(ref) and res.activation_scale == "static"
    for path, mod, name in ptq.experts.grouped_weights(model):
        got = np.asarray(getattr(mod, name)[...])
        pair = {"gate_proj": "up_proj", "up_proj": "gate_proj"}.get(name)
        for e in range(got.shape[0]):
            amax = np.max(np.abs(ref[path][e]))
            if pair:
                amax = max(amax, np.max(np.abs(ref[path.rsplit("/", 1)[0] + "/" + pair][e])))
            want = nvfp4.fake_quantize(jnp.asarray(ref[path][e].T), rule="mse", global_amax=jnp.float32(amax)).T
            np.testing.assert_array_equal(got[e], np.asarray(want))


def test_coverage_static_scales_and_execution(rtn):
    model, res, _ = rtn
    for path, r in res.experts.items():
        assert sum(r.tokens) == 4 * 16 * 2  # every token routed to top-2 experts
        assert r.input_amax is not None and all(np.isfinite(a) and a > 0 for a in r.input_amax)
    logits = jax.jit(lambda m, x: m(x))(model, jnp.asarray(_calib(2, 8, 1)))
    assert np.isfinite(np.asarray(logits)).all()
    assert res.report.not_executed() == () and execution.check_executed(model) == ()


def test_an_expert_no_token_reaches_falls_back_with_a_warning():
    """Calibrate on one repeated token: most experts see nothing. They are named, quantized by RTN, and get the
    other experts' max input amax: no 0, NaN or Inf scale anywhere, and the model still runs."""
    model, _ = load(FIX / "qwen3_moe")
    calib = np.full((2, 8), 7, np.int32)
    with pytest.warns(RuntimeWarning, match=r"experts \[.*\] saw fewer than 1 calibration token"):
        res = ptq.quantize_model(model, [ptq.Rule(path=EXPERTS, scheme=ptq.scheme("nvfp4-mse"))], method="gptq",
                           calibration=calib, activation_scale="static")
    fallbacks = {p: r.fallback for p, r in res.experts.items()}
    assert any(fallbacks.values())
    for path, r in res.experts.items():
        assert all(np.isfinite(a) and a > 0 for a in r.input_amax)
        calibrated = [r.input_amax[e] for e in range(len(r.tokens)) if e not in r.fallback]
        assert all(r.input_amax[e] == max(calibrated) for e in r.fallback)
    logits = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(_calib(2, 8, 3))))
    assert np.isfinite(logits).all()


def test_methods_that_fold_into_linear_layers_are_refused():
    model, _ = load(FIX / "qwen3_moe")
    with pytest.raises(ValueError, match="grouped GEMMs: quantize them with rtn or gptq"):
        ptq.quantize_model(model, [ptq.Rule(path=EXPERTS, scheme=ptq.scheme("nvfp4-mse"))], method="awq",
                     calibration=_calib())
