"""QAT's forward product on the GEMM backends (``Recipe(gemm=...)``, `jaxlowfp.qat.gemm`) against the fake-quant
product (``gemm="dequant"``), on CPU where jax emulates ``jax.nn.scaled_matmul`` and the float8 dot.

Why a tolerance: both compute ``sum_k x̂_k ŵ_k`` for the same quantized values, but the backends factor the per-tensor
(and NVFP4's global) scales out of the sum and accumulate in another order, so the two differ by float32 rounding,
bounded by ``2 (K + 4) eps sum_k |x̂_k| |ŵ_k|`` with ``|x̂| <= 2 |x|`` (round to nearest on these grids at most doubles
a value: 0.25 -> 0.5 in E2M1 units). Where every product and partial sum is exact (operands already on the grid, unit
scales) the results are bitwise equal. Gradients are the fake-quant path's own backward (`qat.gemm`'s VJP is that
product's), compared to float32 rounding because they come from two XLA programs.
"""
from __future__ import annotations

import dataclasses
import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlowfp import backends, execution, ops, qat, qnnx
from jaxlowfp.scaling import CurrentScaling, DelayedScaling

EPS = float(np.finfo(np.float32).eps)


def _nvfp4_delayed() -> qat.Recipe:
    spec = qat.QuantSpec(format="nvfp4", rule="mse", block_shape=(1, 16),
                         scaling=DelayedScaling(history_len=4, target_max=6.0))
    return qat.Recipe(weight=dataclasses.replace(spec, block_shape=(16, 16)), activation=spec, name="nvfp4_delayed")


def _mx(fmt: str) -> qat.Recipe:
    return qat.Recipe(weight=qat.QuantSpec(format=fmt), activation=qat.QuantSpec(format=fmt), name=fmt)


def _fp8_per_token() -> qat.Recipe:
    w = qat.QuantSpec(format="e4m3", clip="format", scaling=CurrentScaling(target_max=448.0))
    a = qat.QuantSpec(format="e4m3", clip="format", scaling=CurrentScaling(target_max=448.0, granularity="token"))
    return qat.Recipe(weight=w, activation=a, name="fp8_per_token")


def _nvfp4_per_token() -> qat.Recipe:
    w = qat.QuantSpec(format="nvfp4", rule="mse", block_shape=(16, 16))
    a = qat.QuantSpec(format="nvfp4", rule="mse", block_shape=(1, 16), scaling=CurrentScaling(target_max=6.0,
                                                                                               granularity="token"))
    return qat.Recipe(weight=w, activation=a, name="nvfp4_per_token")


CASES = {
    "fp8_delayed": (qat.fp8_delayed(history_len=4), "fp8"),
    "nvfp4_per_token": (_nvfp4_per_token(), "scaled_matmul"),
    "fp8_per_token": (_fp8_per_token(), "fp8"),  # each row's scale on the output (harness act_scale="token")
    "fp8_delayed_flax": (qat.fp8_delayed(history_len=4, convention="flax"), "fp8"),
    "nvfp4_w4a4_mse": (qat.nvfp4_w4a4("mse"), "scaled_matmul"),
    "nvfp4_16x16_delayed": (_nvfp4_delayed(), "scaled_matmul"),
    "nvfp4_training": (qat.nvfp4_training("mse"), "scaled_matmul"),  # quantized backward: the custom VJP's forward
    "mxfp8": (_mx("mxfp8"), "scaled_matmul"),
    "mxfp4": (_mx("mxfp4"), "scaled_matmul"),
}


_STEPS: dict = {}


def _step(recipe: qat.Recipe, x, w, g, state, observe=False):
    """One forward and backward of ``qat.linear`` under ``jax.jit``: jitted once per recipe (and static observe flag,
    or traced one), so the steps that differ only in values (the second step, the other warmup flag) reuse the
    compiled program instead of tracing and compiling it again."""
    traced = isinstance(observe, jax.Array)
    key = (recipe, "traced" if traced else bool(observe))
    if key not in _STEPS:
        def loss(x, w, state, g, obs):
            y, st, _ = qat.linear(x, w, recipe=recipe, state=state, key=jax.random.key(3),
                                  observe_only=obs if traced else bool(observe))
            return jnp.sum(y.astype(jnp.float32) * g), (y, st)

        _STEPS[key] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, (y, st)), grads = _STEPS[key](x, w, state, g, observe if traced else None)
    return y, st, grads


def _operands(seed=0, dtype=jnp.float32):
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (2, 16, 64), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (64, 48), jnp.float32) * 0.2).astype(dtype)
    return x, w, jax.random.normal(kg, (2, 16, 48), jnp.float32)


def _close(a, b, *, rel=1e-6):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=0, atol=rel * max(float(np.max(np.abs(b))), 1e-30))


@pytest.mark.parametrize("name", list(CASES))
def test_backend_forward_equals_fake_quant_and_gradients_are_its_own(name):
    base, gemm = CASES[name]
    real = dataclasses.replace(base, gemm=gemm)
    assert qat.gemm.plan(real).backend == gemm
    x, w, g = _operands()
    state = base.init()
    for step in range(2):  # the second step quantizes with the delayed histories the first recorded
        y0, st0, (dx0, dw0) = _step(base, x, w, g, state)
        y1, st1, (dx1, dw1) = _step(real, x, w, g, state)
        bound = 2 * (64 + 4) * EPS * 4 * (jnp.abs(x) @ jnp.abs(w))
        assert np.all(np.abs(np.asarray(y1) - np.asarray(y0)) <= np.asarray(bound)), name
        assert float(jnp.max(jnp.abs(y1 - y0))) < 0.05 * float(jnp.max(jnp.abs(y0)))  # and not trivially
        _close(dx1, dx0)
        _close(dw1, dw0)
        for a, b in zip(jax.tree.leaves(st0), jax.tree.leaves(st1)):  # amaxes: maxima, integer-exact
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        state = st0
        x = x * 1.5


def test_fp8_bitwise_where_the_arithmetic_is_exact():
    # E4M3 integers with amax 448: scale 448 / 448 = 1, x̂ = x, every product and partial sum an exact integer
    rng = np.random.default_rng(0)
    grid = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16], np.float32)
    x = rng.choice(grid, (8, 32)) * rng.choice([-1, 1], (8, 32))
    w = rng.choice(grid, (32, 24)) * rng.choice([-1, 1], (32, 24))
    x[0, 0] = w[0, 0] = 448.0
    recipe = qat.Recipe(weight=qat.QuantSpec(format="e4m3", clip="format", scaling=CurrentScaling(
        target_max=448.0)), activation=qat.QuantSpec(format="e4m3", clip="format",
                                                    scaling=CurrentScaling(target_max=448.0)))
    f = jax.jit(lambda r, x, w: qat.linear(x, w, recipe=r, state=r.init())[0], static_argnums=0)
    y0 = f(recipe, x, w)
    y1 = f(dataclasses.replace(recipe, gemm="fp8"), x, w)
    np.testing.assert_array_equal(np.asarray(y1), x.astype(np.float64) @ w.astype(np.float64))
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))


def test_bfloat16_operands_and_traced_warmup():
    base = qat.fp8_delayed(history_len=4)
    real = dataclasses.replace(base, gemm="fp8")
    x, w, g = _operands(1, jnp.bfloat16)
    for observe in (jnp.array(True), jnp.array(False)):
        y0, _, (dx0, dw0) = _step(base, x, w, g, base.init(), observe)
        y1, _, (dx1, dw1) = _step(real, x, w, g, base.init(), observe)
        assert y1.dtype == y0.dtype == jnp.bfloat16
        _close(y1, y0, rel=2 ** -7)  # one bfloat16 rounding of the output
        _close(dx1, dx0, rel=2 ** -7)
        _close(dw1, dw0, rel=2 ** -7)
    hp = jax.jit(lambda x, w: jnp.dot(x, w))(x, w)  # the warmup's forward is the high-precision product
    y, _, _ = _step(real, x, w, g, base.init(), jnp.array(True))
    _close(y, hp, rel=2 ** -7)


def test_layers_report_the_backend_that_ran():
    recipe = dataclasses.replace(qat.fp8_delayed(history_len=4), gemm="fp8")
    layer = qnnx.QuantLinear(64, 32, recipe=recipe, rngs=nnx.Rngs(0), path="mlp/up")
    ops_before = execution.quantized_ops(layer)
    assert [o.backend for o in ops_before] == [None]
    layer(jnp.ones((4, 64)))
    (op,) = execution.quantized_ops(layer)
    assert op.executed and op.backend == "fp8"
    dense = qnnx.QuantLinear(64, 32, recipe=qat.hif8_w8a8(), rngs=nnx.Rngs(0))
    dense(jnp.ones((4, 64)))
    assert execution.quantized_ops(dense)[0].backend == "dequant"


def test_auto_takes_dequant_on_cpu_and_logs_it(caplog, monkeypatch):
    recipe = dataclasses.replace(qat.nvfp4_w4a4("mse"), gemm="auto")
    monkeypatch.setattr(backends, "_LOGGED", set())  # logged once per process: another test may have been first
    with caplog.at_level(logging.INFO, logger="jaxlowfp.backends"):
        assert qat.gemm.plan(recipe).backend == "dequant"
    assert any("gemm='dequant'" in r.getMessage() for r in caplog.records)
    hif8 = dataclasses.replace(qat.hif8_w8a8(), gemm="auto")
    assert qat.gemm.plan(hif8).backend == "dequant"


def _gpu(kind, cc):
    return types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=cc)


def test_bad_requests_are_refused_by_name():
    with pytest.raises(ValueError, match="gemm"):
        qat.Recipe(weight=qat.QuantSpec(format="e4m3"), gemm="cublas")
    with pytest.raises(ValueError, match=r"gemm='fp8'.*hif8.*no GEMM|hif8"):
        qat.gemm.plan(dataclasses.replace(qat.hif8_w8a8(), gemm="fp8"), where="blocks/1/mlp/up")
    with pytest.raises(ValueError, match="scaled_matmul"):
        qat.gemm.plan(dataclasses.replace(qat.fp8_delayed(), gemm="scaled_matmul"))
    sr = qat.QuantSpec(format="nvfp4", rule="mse", block_shape=(1, 16), rounding="stochastic")
    with pytest.raises(ValueError, match="rounding='stochastic'"):
        qat.gemm.plan(qat.Recipe(weight=sr, activation=sr, gemm="scaled_matmul"))
    tok = qat.QuantSpec(format="e4m3", clip="format", scaling=CurrentScaling(target_max=448.0,
                                                                                   granularity="token"))
    with pytest.raises(ValueError, match="per-token"):  # a per-channel weight
        qat.gemm.plan(qat.Recipe(weight=tok, activation=qat.QuantSpec(format="e4m3"), gemm="fp8"))
    nv_tok = qat.QuantSpec(format="nvfp4", rule="mse", block_shape=(1, 16), scaling=CurrentScaling(
        target_max=6.0, granularity="token"))
    assert qat.gemm.plan(qat.Recipe(weight=qat.QuantSpec(format="nvfp4", rule="mse", block_shape=(1, 16)),
                                    activation=nv_tok, gemm="scaled_matmul")).backend == "scaled_matmul"
    with pytest.raises(ValueError, match="high precision"):
        qat.gemm.plan(qat.Recipe(weight=qat.QuantSpec(format="e4m3"), gemm="fp8"))
    fp8 = dataclasses.replace(qat.fp8_delayed(), gemm="fp8")
    with pytest.raises(backends.BackendUnavailableError, match=r"8\.9.*A100|A100.*8\.9"):
        qat.gemm.plan(fp8, device=_gpu("NVIDIA A100", "8.0"))
    assert qat.gemm.plan(fp8, device=_gpu("NVIDIA H100 80GB HBM3", "9.0")).native
    nv = dataclasses.replace(qat.nvfp4_w4a4(), gemm="scaled_matmul")
    with pytest.raises(backends.BackendUnavailableError, match=r"10\.0.*H100"):
        qat.gemm.plan(nv, device=_gpu("NVIDIA H100 80GB HBM3", "9.0"))
    auto = dataclasses.replace(qat.fp8_delayed(), gemm="auto")
    assert qat.gemm.plan(auto, device=_gpu("NVIDIA H100 80GB HBM3", "9.0")).backend == "fp8"
    assert qat.gemm.plan(auto, device=_gpu("NVIDIA A100", "8.0")).backend == "dequant"
    moe = dataclasses.replace(qat.hif8_w8a8(), gemm="fp8")
    with pytest.raises(ValueError, match="hif8"):
        ops.ragged_dot(jnp.ones((4, 16)), jnp.ones((2, 16, 8)), jnp.array([2, 2]), recipe=moe)
    nv = dataclasses.replace(qat.nvfp4_w4a4(), gemm="scaled_matmul")
    with pytest.raises(ValueError, match="no block-scaled form"):
        ops.ragged_dot(jnp.ones((4, 16)), jnp.ones((2, 16, 8)), jnp.array([2, 2]), recipe=nv)
    b200 = _gpu("NVIDIA B200", "10.0")
    assert qat.gemm.grouped_plan(dataclasses.replace(qat.nvfp4_w4a4(), gemm="auto"), device=b200).backend == "dequant"
    assert qat.gemm.grouped_plan(dataclasses.replace(qat.fp8_delayed(), gemm="auto"), device=b200).backend == "fp8"


def test_the_harness_quantize_runs_its_products_on_the_asked_gemm():
    """lm-eval's ``quantize=fp8,gemm=fp8`` (`jaxlowfp.harness.fake_quantize_model`): per-token FP8 activations (the
    evaluation default) on the fp8 backend, recorded per op; the log-probs are the dequant ones to float32 rounding
    of each product (one block: no activation code can move between the two); an impossible gemm is refused before
    any layer changes."""
    from jaxlowfp import harness
    from jaxlowfp.models.llama import Llama, preset

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
    lp = {}
    for gemm in ("dequant", "fp8"):
        model = Llama(preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
        harness.fake_quantize_model(model, "fp8", layers="all", gemm=gemm)
        # nnx.jit: the ops' execution records are state, written back with the model's (jax.jit would drop them)
        lp[gemm] = np.asarray(nnx.jit(lambda m, t: jax.nn.log_softmax(m(t), -1))(model, tokens))
        assert {o.backend for o in execution.quantized_ops(model)} == {gemm}
    np.testing.assert_allclose(lp["fp8"], lp["dequant"], rtol=0, atol=1e-5)
    model = Llama(preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="hif8"):
        harness.fake_quantize_model(model, "hif8", layers="all", gemm="fp8")
    assert not execution.quantized_ops(model)


@pytest.mark.parametrize("expert_scales", ["per_expert", "shared"])
def test_experts_grouped_gemm_on_fp8_codes(expert_scales):
    """`ops.ragged_dot` (the experts' grouped GEMM) with ``gemm="fp8"``: E4M3 codes of each routed row (its own
    expert's scale) and of each expert's weight on ``lax.ragged_dot``, the scales on the output rows; equal to the
    dequant product within float32 rounding of the sum, gradients the fake-quant VJP's (compared to rounding: two
    programs), padding rows past sum(group_sizes) zero."""
    w = qat.QuantSpec(format="e4m3", clip="format", scaling=CurrentScaling(target_max=448.0))
    base = qat.Recipe(weight=w, activation=w, name="fp8_experts")
    real = dataclasses.replace(base, gemm="fp8")
    kx, kw, kg = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(kx, (24, 32), jnp.float32)
    ws = jax.random.normal(kw, (4, 32, 16), jnp.float32) * 0.2
    gs = jnp.array([5, 0, 9, 6], jnp.int32)  # 20 rows routed, 4 of padding; expert 1 gets none
    g = jax.random.normal(kg, (24, 16), jnp.float32)

    def run(recipe):
        def loss(x, ws):
            y, _, _ = ops.ragged_dot(x, ws, gs, recipe=recipe, expert_scales=expert_scales)
            return jnp.sum(y * g), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, ws)

    (_, y0), (dx0, dw0) = run(base)
    (_, y1), (dx1, dw1) = run(real)
    ref = jax.lax.ragged_dot(jnp.abs(x), jnp.abs(ws), gs)
    assert np.all(np.abs(np.asarray(y1 - y0)) <= np.asarray(2 * (32 + 4) * EPS * 4 * ref))
    assert float(jnp.max(jnp.abs(y1[20:]))) == 0.0
    _close(dx1, dx0)
    _close(dw1, dw0)
