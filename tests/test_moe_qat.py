"""QAT of mixture-of-experts models (issue 29 item 2): the expert weights of a tiny Qwen3-MoE and a tiny Mixtral
written by transformers quantized through `jaxlowfp.qnnx` rules and through the Qwix provider (interception of
`jax.lax.ragged_dot`), their grouped GEMMs run as `jaxlowfp.ops.ragged_dot`, a short training run with HiF8 and
NVFP4 4/6. Mixtral's experts have 24 inputs to down_proj (not whole 16-value NVFP4 blocks): NVFP4 quantizes its
gate / up weights only."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlowfp
from jaxlowfp import execution, qat, qnnx, training
from jaxlowfp.models import load
from jaxlowfp.models.llama import loss_fn

FIX = Path(__file__).parent / "fixtures" / "moe"
EXPERTS = r"blocks/\d+/mlp/experts/(gate|up|down)_proj"
# one jitted forward for the file: models of the same structure (the float Qwen3-MoE of two parametrizations) reuse
# its compiled program instead of compiling an identical one again
_FWD = jax.jit(lambda m, x: m(x))


@pytest.mark.parametrize("family,recipe,path", [
    ("qwen3_moe", qat.hif8_w8a8(history_len=8), EXPERTS), ("qwen3_moe", qat.nvfp4_w4a4("mse"), EXPERTS),
    ("mixtral", qat.nvfp4_w4a4("mse"), r"blocks/\d+/mlp/experts/(gate|up)_proj")],
    ids=lambda v: getattr(v, "name", v if isinstance(v, str) and "/" not in v else ""))
def test_short_qat_run_on_a_tiny_moe(family, recipe, path):
    model, _ = load(FIX / family)
    ref = np.asarray(_FWD(model, jnp.arange(12, dtype=jnp.int32)[None] % 100))
    report = qnnx.quantize_model(model, [qnnx.Rule(path=path, recipe=recipe)])
    n_sparse = sum(1 for p, _ in report.quantized)
    assert n_sparse >= 3 and all(p.rsplit("/", 1)[1] in ("gate_proj", "up_proj", "down_proj")
                                 for p, _ in report.quantized)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 100, (4, 17)), jnp.int32)
    tx = optax.adam(1e-4)
    graphdef, state = training.init(model, tx)
    step = jax.jit(training.make_step(graphdef, tx, loss_fn, microbatches=2))
    losses = []
    for _ in range(3):
        state, metrics = step(state, tokens)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses))
    nnx.update(model, state.params, state.qstate, state.rest)  # the trained state, execution records included
    assert report.not_executed() == ()  # every expert weight's quantized grouped GEMM ran
    trained = nnx.merge(graphdef, state.params, state.qstate, state.rest)
    ops = [op for _, op in qnnx.iter_quant_ops(trained) if isinstance(op, qnnx.QuantRaggedOp)]
    assert len(ops) == n_sparse
    for op in ops:  # per-expert histories: every expert's weight recorded 3 steps; routed experts their tokens
        st = op.amax.get_value()
        assert np.all(np.asarray(st.weight.count) == 3) and np.all(np.asarray(st.activation.count) <= 3)
        assert np.all(np.isfinite(np.asarray(st.activation.history)))
    # the quantized forward stays close to the float one (the same model, quantization noise only)
    got = np.asarray(_FWD(nnx.merge(graphdef, state.params, state.qstate, state.rest),
                          jnp.arange(12, dtype=jnp.int32)[None] % 100))
    assert np.isfinite(got).all() and np.abs(got - ref).max() < 5.0


def test_dense_reference_refuses_quantized_experts():
    from jaxlowfp.models import with_experts_impl

    model, _ = load(FIX / "qwen3_moe")
    qnnx.quantize_model(model, [qnnx.Rule(path=EXPERTS, recipe=qat.hif8_w8a8())])
    with pytest.raises(ValueError, match="dense per-expert reference computes no quantized product"):
        with_experts_impl(model, "dense")(jnp.zeros((1, 4), jnp.int32))


@pytest.mark.parametrize("family,recipe", [("qwen3_moe", qat.nvfp4_w4a4("mse")),
                                           ("mixtral", qat.hif8_w8a8(history_len=8))],
                         ids=["qwen3_moe-nvfp4", "mixtral-hif8"])
def test_qwix_provider_trains_a_tiny_moe(family, recipe):
    """`qwix.quantize_model` with a `jaxlowfp.qwix_provider` rule on the experts modules: each block's three
    `jax.lax.ragged_dot` calls are intercepted (a `QuantRaggedOp` child each, per-expert state), the quantized
    forward equals the `qnnx` rules' quantization of the same weights (the same op layer reached by another module
    structure: within float32 rounding), and a training step updates every expert's history."""
    import qwix

    from jaxlowfp import qwix_provider

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 100, (4, 17)), jnp.int32)
    model, _ = load(FIX / family)
    provider = qwix_provider.RecipeProvider([qwix_provider.RecipeRule(
        module_path=r"blocks/\d+/mlp/experts", op_names=("ragged_dot",), recipe=recipe)])
    qm = qwix.quantize_model(model, provider, tokens[:, :-1])
    assert provider.executed() == tuple((f"blocks/{b}/mlp/experts", f"ragged_dot{i}", recipe.name)
                                        for b in range(2) for i in range(3))
    by_rules, _ = load(FIX / family)
    qnnx.quantize_model(by_rules, [qnnx.Rule(path=EXPERTS, recipe=recipe)])
    if isinstance(recipe.activation.scaling, jaxlowfp.DelayedScaling):  # qwix's example call recorded one amax
        nnx.jit(lambda m, x: m(x))(by_rules, tokens[:, :-1])  # the same one-entry history here
    np.testing.assert_allclose(np.asarray(_FWD(qm, tokens)), np.asarray(_FWD(by_rules, tokens)), atol=1e-4, rtol=0)
    tx = optax.adam(1e-4)
    graphdef, state = training.init(qm, tx)
    step = jax.jit(training.make_step(graphdef, tx, loss_fn))
    state, metrics = step(state, tokens)
    assert np.isfinite(float(metrics["loss"]))
    trained = nnx.merge(graphdef, state.params, state.qstate, state.rest)
    ops = [op for _, op in qnnx.iter_quant_ops(trained) if isinstance(op, qnnx.QuantRaggedOp)]
    assert len(ops) == 6
    for op in ops:  # the interception's example call, then the training step
        assert np.all(np.asarray(op.amax.get_value().weight.count) == 2)
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
        jax.tree.leaves(nnx.state(qm, nnx.Param)), jax.tree.leaves(state.params)))  # the step trained the model


def test_experts_train_on_the_fp8_grouped_gemm():
    """FP8 QAT of the tiny Qwen3-MoE's experts with ``Recipe(gemm="fp8")``: the experts' grouped GEMM runs on the
    E4M3 codes (`ops.ragged_dot` -> `lax.ragged_dot` on float8; cuBLASLt FP8 GEMMs on a Hopper, deviceless) and the
    training is the dequant run's: the losses of two steps agree to float32 rounding (measured: equal)."""
    spec = qat.QuantSpec(format="e4m3", clip="format", scaling=qat.fp8_delayed(history_len=8).weight.scaling)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 100, (4, 17)), jnp.int32)
    losses = {}
    for gemm in ("dequant", "fp8"):
        model, _ = load(FIX / "qwen3_moe")
        qnnx.quantize_model(model, [qnnx.Rule(path=EXPERTS, recipe=qat.Recipe(weight=spec, activation=spec,
                                                                             gemm=gemm))])
        tx = optax.adam(1e-4)
        graphdef, state = training.init(model, tx)
        step = jax.jit(training.make_step(graphdef, tx, loss_fn))
        losses[gemm] = []
        for _ in range(2):
            state, metrics = step(state, tokens)
            losses[gemm].append(float(metrics["loss"]))
        trained = nnx.merge(graphdef, state.params, state.qstate, state.rest)
        assert {op.backend for op in execution.quantized_ops(trained)} == {gemm}
    np.testing.assert_allclose(losses["fp8"], losses["dequant"], rtol=1e-6)
