"""Linen adapter: nn.Dense(dot_general_cls=quant_dot_general_cls(recipe)).

Oracles: plain `nn.Dense` (observe-only output, bitwise) and a float64 numpy fake-quant on `en_dtypes.hifloat8`.
"""
from __future__ import annotations

import chex
import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlowfp import qlinen as jlinen
from jaxlowfp import qat
from oracles import hif8_fake_quant_f64


class MLP(nn.Module):
    recipe: qat.Recipe

    @nn.compact
    def __call__(self, x):
        cls = jlinen.quant_dot_general_cls(self.recipe)
        h = nn.relu(nn.Dense(64, dot_general_cls=cls, name="up")(x))
        return nn.Dense(16, dot_general_cls=cls, name="down")(h)


class PlainMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, name="down")(nn.relu(nn.Dense(64, name="up")(x)))


X = jax.random.normal(jax.random.key(1), (4, 32)) * 2.0


@pytest.fixture(scope="module")
def init():
    model = MLP(recipe=qat.hif8_w8a8())
    return model, model.init(jax.random.key(0), X)


def test_init_creates_the_collections_and_the_same_params_as_plain_dense(init):
    model, variables = init
    assert set(variables) >= {"params", jlinen.AMAX_COLLECTION, jlinen.PHASE_COLLECTION}
    plain = PlainMLP().init(jax.random.key(0), X)
    chex.assert_trees_all_equal(variables["params"]["up"]["kernel"], plain["params"]["up"]["kernel"])
    chex.assert_trees_all_equal_shapes(variables["params"], plain["params"])
    state = variables[jlinen.AMAX_COLLECTION]["up"]["QuantDotGeneral_0"]["recipe_state"]
    assert isinstance(state, qat.RecipeState)
    chex.assert_trees_all_equal(state, qat.hif8_w8a8().init())  # init's dummy input recorded nothing
    assert not bool(variables[jlinen.PHASE_COLLECTION]["up"]["QuantDotGeneral_0"]["observe_only"])


def test_apply_records_histories_and_matches_the_oracle_over_two_delayed_steps(init):
    model, variables = init
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), variables["params"])
    x = np.asarray(X)
    y, upd = model.apply(variables, X, mutable=[jlinen.AMAX_COLLECTION, jlinen.STATS_COLLECTION])
    w_up, w_down = p["up"]["kernel"], p["down"]["kernel"]
    h = np.maximum(hif8_fake_quant_f64(x, np.abs(x).max()) @ hif8_fake_quant_f64(w_up, np.abs(w_up).max())
                   + p["up"]["bias"], 0.0)
    ref = hif8_fake_quant_f64(h, np.abs(h).max()) @ hif8_fake_quant_f64(w_down, np.abs(w_down).max())
    np.testing.assert_allclose(np.asarray(y, np.float64), ref + p["down"]["bias"], rtol=1e-5, atol=1e-5)
    stats = jlinen.collect_stats(upd)
    assert stats["up/QuantDotGeneral_0/activation/amax"] == float(np.abs(x).max())

    # step 2 with the new histories and 2x the input: the "up" activation scale comes from step 1's amax
    variables2 = {**variables, **{jlinen.AMAX_COLLECTION: upd[jlinen.AMAX_COLLECTION]}}
    y2, upd2 = jax.jit(lambda v, x: model.apply(v, x, mutable=[jlinen.AMAX_COLLECTION, jlinen.STATS_COLLECTION]))(
        variables2, 2 * X)
    h2 = np.maximum(hif8_fake_quant_f64(2 * x, np.abs(x).max()) @ hif8_fake_quant_f64(w_up, np.abs(w_up).max())
                    + p["up"]["bias"], 0.0)
    ref2 = hif8_fake_quant_f64(h2, np.abs(h).max()) @ hif8_fake_quant_f64(w_down, np.abs(w_down).max())
    np.testing.assert_allclose(np.asarray(y2, np.float64), ref2 + p["down"]["bias"], rtol=1e-5, atol=1e-5)
    stats2 = jlinen.collect_stats(upd2)
    assert stats2["up/QuantDotGeneral_0/activation/amax_estimate"] == float(np.abs(x).max())
    assert stats2["up/QuantDotGeneral_0/activation/saturated_fraction"] > 0


def test_observe_only_is_bitwise_plain_dense_and_flips_without_retracing(init):
    model, variables = init
    plain = PlainMLP().init(jax.random.key(0), X)
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(variables, x, flag):
        v = jlinen.set_observe_only(variables, flag)
        return model.apply(v, x, mutable=[jlinen.AMAX_COLLECTION])

    y_obs, upd = step(variables, X, jnp.asarray(True))
    y_ref = jax.jit(PlainMLP().apply)(plain, X)
    np.testing.assert_array_equal(np.asarray(y_obs), np.asarray(y_ref))
    changed = any(not np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(variables[jlinen.AMAX_COLLECTION]), jax.tree.leaves(upd[jlinen.AMAX_COLLECTION])))
    assert changed  # the warmup still records the histories
    y_q, _ = step(variables, X, jnp.asarray(False))  # same trace
    assert not np.array_equal(np.asarray(y_q), np.asarray(y_ref))


def test_gradients_flow_and_inference_needs_no_mutable_collection(init):
    model, variables = init

    def loss(params):
        y, _ = model.apply({**variables, "params": params}, X, mutable=[jlinen.AMAX_COLLECTION])
        return jnp.mean(y * y)

    grads = jax.jit(jax.grad(loss))(variables["params"])
    for g in jax.tree.leaves(grads):
        assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).max()) > 0
    y = model.apply(variables, X)  # nothing mutable: histories untouched, no error
    assert y.shape == (4, 16)


def test_bad_arguments_raise_clear_errors(init):
    _, variables = init
    with pytest.raises(TypeError, match="Recipe"):
        jlinen.quant_dot_general_cls("hif8")
    with pytest.raises(TypeError, match="Python bool"):
        jlinen.quant_dot_general_cls(qat.hif8_w8a8(), observe_only=jnp.asarray(True))
    with pytest.raises(TypeError, match="observe_only must be"):
        jlinen.set_observe_only(variables, 1)
    with pytest.raises(ValueError, match="quant_phase"):
        jlinen.set_observe_only({"params": variables["params"]}, True)


def test_stochastic_rounding_recipe_draws_from_the_quant_rng_stream():
    # static_6: the rule does not matter for where the key comes from, and it compiles fastest
    dense = nn.Dense(32, dot_general_cls=jlinen.quant_dot_general_cls(qat.nvfp4_training(rule="static_6")))
    x = jax.random.normal(jax.random.key(2), (16, 32))
    variables = dense.init({"params": jax.random.key(0), jlinen.RNG_STREAM: jax.random.key(1)}, x)

    def loss(params, key):
        y, _ = dense.apply({**variables, "params": params}, x, rngs={jlinen.RNG_STREAM: key},
                           mutable=[jlinen.AMAX_COLLECTION])
        return jnp.sum(y * y)

    grad = jax.jit(jax.grad(loss))
    g1, g2 = grad(variables["params"], jax.random.key(3)), grad(variables["params"], jax.random.key(4))
    assert bool(jnp.all(jnp.isfinite(g1["kernel"])))
    assert not np.array_equal(np.asarray(g1["kernel"]), np.asarray(g2["kernel"]))  # the key reaches the rounding
    with pytest.raises(flax.errors.InvalidRngError, match="quant"):
        dense.apply(variables, x)  # no 'quant' rng: flax names the missing stream


def test_delayed_gradient_scaling_through_linen_collections():
    """fp8_delayed in a two-layer Linen MLP: differentiate w.r.t. the params and the pending slots of the amax
    collection (scaling.pending_amaxes); each layer reports its output-gradient amax (the last layer's is the
    cotangent it was given) and the next apply records it into the layer's gradient history."""
    from jaxlowfp import scaling

    model = MLP(recipe=qat.fp8_delayed(history_len=4))
    variables = model.init(jax.random.key(0), X)
    cot = jax.random.normal(jax.random.key(5), (4, 16)) * 3.0

    @jax.jit
    def step(variables):
        amax = variables[jlinen.AMAX_COLLECTION]

        def loss(params, pend):
            v = {**variables, "params": params, jlinen.AMAX_COLLECTION: scaling.with_pending_amaxes(amax, pend)}
            y, upd = model.apply(v, X, mutable=[jlinen.AMAX_COLLECTION])
            return jnp.sum(y * cot), upd[jlinen.AMAX_COLLECTION]

        (_, new_amax), (grads, reported) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            variables["params"], scaling.pending_amaxes(amax))
        return {**variables, jlinen.AMAX_COLLECTION: scaling.with_pending_amaxes(new_amax, reported)}, grads

    v1, grads = step(variables)
    rs = {k: v1[jlinen.AMAX_COLLECTION][k]["QuantDotGeneral_0"]["recipe_state"] for k in ("up", "down")}
    assert all(float(r.grad_pending.seen) == 1.0 for r in rs.values())
    assert float(rs["down"].grad_pending.amax) == float(jnp.max(jnp.abs(cot)))
    assert float(rs["up"].grad_pending.amax) > 0 and all(int(r.grad.count) == 0 for r in rs.values())
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    v2, _ = step(v1)
    down = v2[jlinen.AMAX_COLLECTION]["down"]["QuantDotGeneral_0"]["recipe_state"]
    assert int(down.grad.count) == 1 and float(down.grad.history[0]) == float(jnp.max(jnp.abs(cot)))
