"""QAT of mixture-of-experts models (issue 29 item 2): the expert weights of a tiny Qwen3-MoE written by transformers
quantized through `jaxlowfp.qnnx` rules, their grouped GEMMs run as `jaxlowfp.ops.ragged_dot`, a short training run
with HiF8 and NVFP4 4/6."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxlowfp import qat, qnnx, training
from jaxlowfp.models import load
from jaxlowfp.models.llama import loss_fn

FIX = Path(__file__).parent / "fixtures" / "moe"
EXPERTS = r"blocks/\d+/mlp/experts/(gate|up|down)_proj"


@pytest.mark.parametrize("recipe", [qat.hif8_w8a8(history_len=8), qat.nvfp4_w4a4("mse")], ids=lambda r: r.name)
def test_short_qat_run_on_a_tiny_qwen3_moe(recipe):
    model, _ = load(FIX / "qwen3_moe")
    ref = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.arange(12, dtype=jnp.int32)[None] % 100))
    report = qnnx.quantize_model(model, [qnnx.Rule(path=EXPERTS, recipe=recipe)])
    n_sparse = sum(1 for p, _ in report.quantized)
    assert n_sparse >= 3 and all(p.rsplit("/", 1)[1] in ("gate_proj", "up_proj", "down_proj") for p, _ in report.quantized)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 100, (4, 17)), jnp.int32)
    tx = optax.adam(1e-4)
    graphdef, state = training.init(model, tx)
    step = jax.jit(training.make_step(graphdef, tx, loss_fn, microbatches=2))
    losses = []
    for _ in range(3):
        state, metrics = step(state, tokens)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses))
    assert report.not_executed() == ()  # every expert weight's quantized grouped GEMM ran
    trained = nnx.merge(graphdef, state.params, state.qstate, state.rest)
    ops = [op for _, op in qnnx.iter_quant_ops(trained) if isinstance(op, qnnx.QuantRaggedOp)]
    assert len(ops) == n_sparse
    for op in ops:  # per-expert histories: every expert's weight recorded 3 steps; routed experts their tokens
        st = op.amax.get_value()
        assert np.all(np.asarray(st.weight.count) == 3) and np.all(np.asarray(st.activation.count) <= 3)
        assert np.all(np.isfinite(np.asarray(st.activation.history)))
    # the quantized forward stays close to the float one (the same model, quantization noise only)
    got = np.asarray(jax.jit(lambda m, x: m(x))(nnx.merge(graphdef, state.params, state.qstate, state.rest),
                                               jnp.arange(12, dtype=jnp.int32)[None] % 100))
    assert np.isfinite(got).all() and np.abs(got - ref).max() < 5.0


def test_dense_reference_refuses_quantized_experts():
    from jaxlowfp.models import with_experts_impl

    model, _ = load(FIX / "qwen3_moe")
    qnnx.quantize_model(model, [qnnx.Rule(path=EXPERTS, recipe=qat.hif8_w8a8())])
    with pytest.raises(ValueError, match="dense per-expert reference computes no quantized product"):
        with_experts_impl(model, "dense")(jnp.zeros((1, 4), jnp.int32))
