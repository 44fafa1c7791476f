"""Inputs checked where they enter (issue 45), each refusal naming what was given and what is allowed: NaN / Inf
calibration data for every PTQ method (RTN's amax used to drop a NaN on XLA:CPU), calibration rows longer than
the model's maximum sequence length, token ids outside the vocabulary (PTQ calibration, evaluation, the QAT
step), and a negative or non-finite concrete NVFP4 ``global_amax`` (traced ones keep working)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxlowfp import evaluation, nvfp4, ptq, qat, qnnx, training
from jaxlowfp.models.llama import PRESETS, Llama, loss_fn
from jaxlowfp.ptq import calibrate

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=2)
TOKENS = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
RULES = [ptq.Rule(path=r"blocks/\d+/mlp/\w+_proj", scheme=ptq.scheme("nvfp4-mse"))]


class FloatIn(nnx.Module):
    """A model fed float features (a judge's own model): two Linears."""

    def __init__(self):
        self.norm = nnx.RMSNorm(32, rngs=nnx.Rngs(0))
        self.a = nnx.Linear(32, 32, rngs=nnx.Rngs(0))
        self.b = nnx.Linear(32, 16, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.b(jax.nn.relu(self.a(self.norm(x))))

    def smoothing_folds(self):
        return [("norm", ("a",))], []


def _state(model):
    return jax.tree.map(lambda x: np.array(x, copy=True), nnx.state(model))


def _same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
                                      for x, y in zip(la, lb))


@pytest.mark.parametrize("method", ptq.METHODS)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_calibration_refused_by_every_method(method, bad):
    model = FloatIn()
    x = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    x[17, 5] = bad
    before = _state(model)
    rules = [ptq.Rule(path=r"a|b", scheme=ptq.scheme("nvfp4-mse"))]
    with pytest.raises(ValueError, match=r"calibration batch 0: .*1 (NaN|Inf).*first at index \(17, 5\)"):
        ptq.quantize_model(model, rules, method=method, calibration=[jnp.asarray(x)],
                           forward=lambda m, b: m(b), progress=False)
    assert _same(_state(model), before)


def test_amax_keeps_a_nan_that_arises_inside_the_model():
    """The statistic itself: a NaN input value gives a NaN amax in its column (XLA:CPU's max reduction over 64 or
    more rows drops it), so check_calibration_inputs names the layer even when the NaN is made inside the model."""
    model = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).standard_normal((512, 64)).astype(np.float32)
    x[1, 5] = np.nan
    st = calibrate.collect(model, [""], [jnp.asarray(x)], forward=lambda m, b: m(b))
    amax = st[""].amax
    assert np.isnan(amax[5]) and np.isfinite(np.delete(amax, 5)).all()
    with pytest.raises(ValueError, match="hold NaN or Inf"):
        ptq.checks.check_calibration_inputs(st, [""])


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_calibration_rows_longer_than_the_model(method):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    before = _state(model)
    long = np.random.default_rng(2).integers(0, 256, (2, 100)).astype(np.int32)
    with pytest.raises(ValueError, match=r"rows of 100 tokens; the model's maximum sequence length is 64"):
        ptq.quantize_model(model, RULES, method=method, calibration=long, progress=False)
    assert _same(_state(model), before)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
@pytest.mark.parametrize("bad", [256, -1])
def test_calibration_token_ids_out_of_range(method, bad):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    before = _state(model)
    t = TOKENS.copy()
    t[1, 3] = bad
    with pytest.raises(ValueError, match=rf"calibration batch 0 holds token ids from {min(bad, 0)} to "
                                         rf"{bad if bad > 0 else '[0-9]+'}; allowed: 0 to 255"):
        ptq.quantize_model(model, RULES, method=method, calibration=t, progress=False)
    assert _same(_state(model), before)


def test_evaluation_refuses_ids_out_of_range_before_scoring():
    model = Llama(CFG, rngs=nnx.Rngs(0))
    ok = evaluation.Request(tokens=tuple(range(10)), n_pred=3)
    bad = evaluation.Request(tokens=(1, 2, 300, 4), n_pred=2)
    calls = []
    forward = evaluation._Forward.__call__
    try:
        evaluation._Forward.__call__ = lambda self, *a: calls.append(1) or forward(self, *a)
        with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\).*request 9 has 1\.\.300"):
            evaluation.score_requests(model, [ok] * 9 + [bad], batch_size=1)
    finally:
        evaluation._Forward.__call__ = forward
    assert calls == []  # refused before any batch ran


def test_qat_step_names_invalid_token_ids():
    model = Llama(CFG, rngs=nnx.Rngs(0))
    # a QAT model: one NVFP4 W4A4 projection per block (the token check and the skip are the step's, not the layers';
    # all 14 projections only made the step's compilation twice as long)
    qnnx.quantize_model(model, [qnnx.Rule(path=r"blocks/\d+/mlp/up_proj", recipe=qat.nvfp4_w4a4())])
    tx = optax.adam(1e-3)
    graphdef, state = training.init(model, tx)
    step = jax.jit(training.make_step(graphdef, tx, loss_fn))
    good = jnp.asarray(np.random.default_rng(3).integers(0, 256, (2, 17)), jnp.int32)
    state, m = step(state, good)
    assert int(m["invalid_token_ids"]) == 0 and bool(m["finite"])
    params = jax.tree.map(np.asarray, state.params)
    state, m = step(state, good.at[0, 5].set(256))
    assert int(m["invalid_token_ids"]) == 1 and int(m["skipped"]) == 1  # skipped, and the metric says why
    assert _same(jax.tree.map(np.asarray, state.params), params)
    with pytest.raises(ValueError, match=r"batch: 1 token ids outside \[0, 256\).*from \d+ to 256"):
        training.check_tokens(good.at[0, 5].set(256), 256)
    with pytest.raises(ValueError, match="rows of 17 tokens; the model takes at most 16"):
        training.check_tokens(good, 256, max_len=16)


@pytest.mark.parametrize("bad", [-1.0, -0.5])
def test_nvfp4_global_amax_must_be_non_negative(bad):
    """A negative amax is refused; a NaN / Inf one follows the non-finite policy (NaN scales: tests/test_nvfp4.py and
    the Pallas kernels' equivalence tests compare it)."""
    x = jnp.ones((4, 32), jnp.float32)
    with pytest.raises(ValueError, match=rf"global_amax must be >= 0 .*got {bad}"):
        nvfp4.quantize(x, global_amax=bad)
    with pytest.raises(ValueError, match="global_amax must be >= 0"):
        nvfp4.fake_quantize(x, global_amax=jnp.float32(bad))
    assert np.isnan(np.asarray(nvfp4.quantize(x, global_amax=np.nan).scales, np.float32)).all()


def test_nvfp4_traced_global_amax_still_works():
    x = jnp.linspace(-3.0, 3.0, 64, dtype=jnp.float32).reshape(2, 32)
    eager = nvfp4.fake_quantize(x, global_amax=3.0)
    traced = jax.jit(lambda x, g: nvfp4.fake_quantize(x, global_amax=g))(x, jnp.float32(3.0))
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(eager))
    assert np.isfinite(np.asarray(nvfp4.fake_quantize(x, global_amax=0.0))).all()
