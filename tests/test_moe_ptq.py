"""PTQ of mixture-of-experts models (issue 29 item 3): every expert quantized as its own GEMM, calibrated on the
tokens routed to it; experts that no calibration token reaches fall back with a warning, and no 0, NaN or Inf scale
is ever produced."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

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
    # nnx.jit: the ops' execution records are state, written back with the model's (jax.jit would drop them)
    logits = nnx.jit(lambda m, x: m(x))(model, jnp.asarray(_calib(2, 8, 1)))
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



def test_gptq_calibrates_experts_block_by_block(monkeypatch):
    """Sequential GPTQ (the default for a model with ptq_blocks()): block 1's experts are calibrated on what the
    already quantized block 0 outputs, not on the float model's activations. The inputs the experts' calibration
    gets for block 1 are compared with block 0 of the quantized result run by hand on the embedded tokens (the
    same weights, another XLA program: within float32 rounding, measured 2.5e-7 of the largest value) and with the
    float model's block 0 output (block 0's quantization error: measured 0.42 of the largest value; random tiny
    weights quantize coarsely)."""
    calib = _calib(8, 16, 5)
    rules = [ptq.Rule(path=r".*(router|lm_head).*", scheme=None),
             ptq.Rule(path=r".*", scheme=ptq.scheme("nvfp4-mse", weights_only=True))]
    seen = []
    collect = ptq.experts.collect

    def spy(block, paths, batches, **kw):
        seen.append((tuple(paths), np.concatenate([np.asarray(b) for b in batches])))
        return collect(block, paths, batches, **kw)

    monkeypatch.setattr(ptq.experts, "collect", spy)
    model, _ = load(FIX / "qwen3_moe")
    float_model, _ = load(FIX / "qwen3_moe")
    res = ptq.quantize_model(model, rules, method="gptq", calibration=calib)
    assert res.pipeline == "sequential" and len(res.experts) == 6
    assert [p for p, _ in seen] == [("mlp/experts/gate_proj", "mlp/experts/up_proj", "mlp/experts/down_proj")] * 2
    got = seen[1][1]  # block 1's calibration inputs

    def block0_out(m):
        return np.asarray(jax.jit(lambda m, x: m.blocks[0](m.embed(x))[0])(m, jnp.asarray(calib)))

    want, before = block0_out(model), block0_out(float_model)
    scale = np.max(np.abs(want))
    assert np.max(np.abs(got - want)) <= 1e-5 * scale, np.max(np.abs(got - want)) / scale
    assert np.max(np.abs(got - before)) > 1e-3 * scale  # the float model's activations are not what was used
    emb = np.asarray(float_model.embed(jnp.asarray(calib)))
    np.testing.assert_array_equal(seen[0][1], emb)  # block 0: the embedding (a gather, exact)
