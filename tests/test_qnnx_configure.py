"""Configuring QAT is pure (issue 42): `jaxlowfp.qnnx.quantize_model` and the quantized layers read the recipe and
the shapes, trace nothing and ask JAX for no device; the GEMM's device is chosen at the first call.

Oracles: jax's own trace events (``/jax/core/compile/jaxpr_trace_duration``, recorded whenever a function is traced
to a jaxpr), a patched `jax.devices`, and the stats pytree the ops themselves return (`jax.eval_shape` of
`qat.linear` and `ops.ragged_dot`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlowfp import backends, execution, ops, qat, qnnx
from jaxlowfp.scaling import CurrentScaling, StaticScaling

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_traces: list[str] = []
_counting = [False]


def _on_event(name: str, *_: object, **__: object) -> None:
    if _counting[0] and name == TRACE_EVENT:
        _traces.append(name)


jax.monitoring.register_event_duration_secs_listener(_on_event)

# layer sizes no other test uses: a cache keyed by shape (as the abstract evaluation of the matmul was) is cold
K, M, E = 80, 112, 3
FP8 = dataclasses.replace(qat.fp8_delayed(history_len=8), gemm="fp8")
RECIPES = [qat.hif8_w8a8(history_len=8), qat.nvfp4_w4a4(), FP8, dataclasses.replace(qat.nvfp4_w4a4(), gemm="auto")]


class Experts(nnx.Module):
    grouped_weights = ("up",)  # the grouped-GEMM protocol of jaxlowfp.rules.grouped_weights

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Param(jax.random.normal(rngs.params(), (E, K, M)))


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(K, M, rngs=rngs)
        self.down = nnx.Linear(M, K, rngs=rngs)
        self.mix = nnx.Einsum("btk,km->btm", (K, M), rngs=rngs)
        self.general = nnx.LinearGeneral((K,), (M,), rngs=rngs)
        self.experts = Experts(rngs)


def _no_devices(*args: object, **kwargs: object) -> None:
    raise AssertionError("configuring QAT asked JAX for its devices")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.name}-{r.gemm}")
def test_configuring_qat_traces_nothing_and_asks_for_no_device(recipe, monkeypatch):
    models = [Model(nnx.Rngs(0)), Model(nnx.Rngs(0))]
    forward_only = dataclasses.replace(recipe, grad=None)  # the experts' grouped GEMM: straight-through backward
    recipe.init(), ops.ragged_state(forward_only, E, "per_expert")  # the zero histories' eager ops: traced once
    monkeypatch.setattr(jax, "devices", _no_devices)
    _traces.clear()
    _counting[0] = True
    try:
        report = qnnx.quantize_model(models[0], [qnnx.Rule(path="experts/up", recipe=forward_only),
                                                  qnnx.Rule(path=".*", recipe=recipe)])
        op = qnnx.QuantOp(recipe, k=K, m=M, path="bare")
    finally:
        _counting[0] = False
    assert _traces == [], f"configuring QAT traced {len(_traces)} function(s)"
    assert len(report.quantized) == 5 and isinstance(models[0].experts.quant_up, qnnx.QuantRaggedOp)
    assert op.stats.get_value().weight.amax.shape == ()
    monkeypatch.undo()
    # the first call decides the GEMM on the device (CPU: fp8 is emulated there), and computes what a layer
    # quantized by hand computes
    x = jax.random.normal(jax.random.key(1), (2, 16, K))
    ref = qnnx.QuantLinear.from_linear(models[1].up, recipe)
    np.testing.assert_array_equal(np.asarray(models[0].up(x)), np.asarray(ref(x)))
    assert [o.backend for o in execution.quantized_ops(models[0].up)] == [
        "fp8" if recipe.gemm == "fp8" else "dequant"]


def test_an_impossible_gemm_is_still_refused_when_configuring_before_any_change(monkeypatch):
    """The formats are checked against ``recipe.gemm`` at configuration, without a device (a hif8 recipe on the fp8
    GEMM, NVFP4 experts on scaled_matmul, which has no grouped form); the device's own check comes at the first
    call (an A100 refuses the fp8 GEMM there)."""
    monkeypatch.setattr(jax, "devices", _no_devices)
    model = Model(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"up: .*gemm='fp8'.*hif8|up: .*hif8.*gemm='fp8'"):
        qnnx.quantize_model(model, [qnnx.Rule(path=".*", recipe=dataclasses.replace(qat.hif8_w8a8(), gemm="fp8"))])
    assert isinstance(model.up, nnx.Linear) and not hasattr(model.experts, "quant_up")  # nothing changed
    nv = dataclasses.replace(qat.nvfp4_w4a4(), gemm="scaled_matmul")
    with pytest.raises(ValueError, match="no block-scaled form"):
        qnnx.QuantRaggedOp(nv, n_experts=E, k=K, m=M, path="experts/up")
    layer = qnnx.QuantLinear(K, M, recipe=FP8, rngs=nnx.Rngs(0), path="up")  # configures: no device asked
    a100 = type("Device", (), {"platform": "gpu", "device_kind": "NVIDIA A100", "compute_capability": "8.0"})()
    monkeypatch.setattr(jax, "devices", lambda *a, **k: [a100])
    with pytest.raises(backends.BackendUnavailableError, match=r"up: gemm='fp8'.*8\.9"):
        layer(jnp.ones((2, K)))


SPECS = [
    qat.hif8_w8a8(), qat.nvfp4_w4a4(), qat.nvfp4_training(), qat.if4_training(), qat.fp8_delayed(convention="flax"),
    qat.Recipe(weight=qat.QuantSpec(format="mxfp4"), activation=qat.QuantSpec(format="mxfp8")),
    qat.Recipe(weight=qat.QuantSpec(format="e4m3")),
    qat.Recipe(activation=qat.QuantSpec(format="e4m3", scaling=CurrentScaling(target_max=448.0, granularity="token"))),
    qat.Recipe(weight=qat.QuantSpec(format="hif8", scaling=StaticScaling(amax=3.0, target_max=15.0)),
               activation=qat.QuantSpec(format="nvfp4", rounding="stochastic")),
    qat.Recipe(grad=qat.QuantSpec(format="e5m2")),
]


def _structure(tree):
    return jax.tree.map(lambda a: (tuple(a.shape), jnp.dtype(a.dtype)), tree)


@pytest.mark.parametrize("recipe", SPECS, ids=lambda r: r.name)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_configured_stats_are_those_the_op_returns(recipe, dtype):
    """The zero stats a layer starts with have the structure, shapes and dtypes of the stats its op returns (so a
    jitted step keeps the state's types), read from the recipe alone."""
    layer = qnnx.QuantLinear(32, 48, recipe=recipe, dtype=dtype, rngs=nnx.Rngs(0))
    x, w = jax.ShapeDtypeStruct((4, 32), dtype), jax.ShapeDtypeStruct((32, 48), dtype)
    want = jax.eval_shape(lambda x, w, k: qat.linear(x, w, recipe=recipe, state=recipe.init(), key=k)[2], x, w,
                          jax.random.key(0))
    assert _structure(layer.stats.get_value()) == _structure(want)
    if recipe.grad is None and not recipe.needs_key:
        op = qnnx.QuantRaggedOp(recipe, n_experts=E, k=32, m=48, dtype=dtype)
        sizes = jax.ShapeDtypeStruct((E,), jnp.int32)
        want = jax.eval_shape(lambda x, w, g: ops.ragged_dot(x, w, g, recipe=recipe)[2], x,
                              jax.ShapeDtypeStruct((E, 32, 48), dtype), sizes)
        assert _structure(op.stats.get_value()) == _structure(want)
