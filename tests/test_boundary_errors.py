"""Errors at the boundary (issue 27 item 4): each names the layer, the recipe and the fix, raised while tracing,
before anything runs; and what used to be dropped or refused obscurely (aux metrics, a bare scalar loss) works."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxlowfp import qat, qnnx, training


class Net(nnx.Module):
    def __init__(self, rngs):
        self.up_proj = nnx.Linear(16, 32, rngs=rngs)

    def __call__(self, x):
        return self.up_proj(x)


def _quantized(recipe, **kw):
    model = Net(nnx.Rngs(0))
    qnnx.quantize_model(model, [qnnx.Rule(path="up_proj", recipe=recipe)], **kw)
    return model


def test_nvfp4_training_on_too_few_tokens_is_refused_when_the_gradient_is_traced():
    model = _quantized(qat.nvfp4_training(rule="static_6"), rngs=nnx.Rngs(1))
    y = model(jnp.ones((4, 16)))  # the forward pass alone takes any number of tokens (evaluation, generation)
    assert y.shape == (4, 32)
    tx = optax.sgd(0.01)
    graphdef, state = training.init(model, tx)
    step = training.make_step(graphdef, tx, lambda m, x: jnp.sum(m(x)))
    with pytest.raises(ValueError) as e:
        jax.eval_shape(step, state, jnp.ones((4, 16)))  # abstract: fails while tracing, nothing ran
    msg = str(e.value)
    assert "up_proj" in msg and "nvfp4_training_static_6" in msg  # the layer and the recipe
    assert "multiple of 16" in msg and "got 4" in msg and "Pad or pack" in msg and "nvfp4_w4a4" in msg  # the fix
    assert "hadamard16" not in msg
    _, m = jax.jit(step)(state, jnp.ones((2, 8, 16)))  # 16 tokens over two axes: fine
    assert bool(m["finite"])


def test_linear_refuses_a_1d_weight_and_mismatched_features():
    r = qat.hif8_w8a8()
    with pytest.raises(ValueError, match=r"my_layer: the weight w must be 2-D .*got shape \(16,\).*Reshape"):
        qat.linear(jnp.ones((4, 16)), jnp.ones((16,)), recipe=r, state=r.init(), where="my_layer")
    with pytest.raises(ValueError, match=r"qat.linear: x .* must agree on in_features; got x \(4, 8\) and w "):
        qat.linear(jnp.ones((4, 8)), jnp.ones((16, 3)), recipe=r, state=r.init())


@pytest.mark.parametrize("recipe", [qat.hif8_w8a8(), qat.nvfp4_w4a4(rule="static_6")], ids=lambda r: r.name)
def test_forward_mode_names_the_layer_and_the_way_out(recipe):
    graphdef, state = nnx.split(_quantized(recipe))
    x = jnp.ones((16, 16))

    def apply(x):
        return nnx.merge(graphdef, state, copy=True)(x)

    with pytest.raises(TypeError) as e:
        jax.jvp(apply, (x,), (x,))
    msg = str(e.value)
    assert "up_proj" in msg and recipe.name in msg and "straight-through" in msg
    assert "jax.grad" in msg and "observe_only=True" in msg


def test_observe_only_is_plain_jax_and_supports_forward_mode():
    r = qat.nvfp4_training(rule="static_6")
    w = jax.random.normal(jax.random.key(0), (16, 32))
    x = jax.random.normal(jax.random.key(1), (16, 16))
    t = jax.random.normal(jax.random.key(2), (16, 16))
    f = lambda x: qat.linear(x, w, recipe=r, state=r.init(), observe_only=True, key=jax.random.key(3))[0]  # noqa
    y, dy = jax.jvp(f, (x,), (t,))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x @ w))  # the same program as the plain matmul
    np.testing.assert_array_equal(np.asarray(dy), np.asarray(t @ w))
    spec = qat.QuantSpec(format="hif8")
    y, dy = jax.jvp(lambda x: qat.fake_quant(x, spec.init(), spec, observe_only=True)[0], (x,), (t,))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(dy), np.asarray(t))
    with pytest.raises(TypeError, match=r"qat.fake_quant: QuantSpec\(format='hif8'\) .*jax.vjp"):
        jax.jvp(lambda x: qat.fake_quant(x, spec.init(), spec)[0], (x,), (t,))


def _loss_aux(m, batch):
    err = m(batch)[:, :16] - batch
    return jnp.mean(err ** 2), {"mae": jnp.mean(jnp.abs(err)), "n_rows": jnp.asarray(batch.shape[0], jnp.int32)}


@pytest.mark.parametrize("microbatches", [1, 2])
def test_make_step_returns_the_aux_metrics(microbatches):
    tx = optax.sgd(0.01)
    graphdef, state = training.init(_quantized(qat.hif8_w8a8()), tx)
    step = jax.jit(training.make_step(graphdef, tx, _loss_aux, microbatches=microbatches))
    batch = jax.random.normal(jax.random.key(0), (8, 16))
    _, m = step(state, batch)
    assert int(m["n_rows"]) == 8  # integer leaves sum over microbatches
    # the mean absolute error of the model the step started from, computed here without the step
    maes = [float(_loss_aux(nnx.merge(graphdef, state.params, state.qstate, state.rest, copy=True), b)[1]["mae"])
            for b in np.split(np.asarray(batch), microbatches)]  # each microbatch from the step's starting state
    np.testing.assert_allclose(float(m["mae"]), np.mean(maes), rtol=1e-6)  # floats: mean over microbatches


def test_make_step_accepts_a_bare_scalar_loss_and_refuses_others_clearly():
    tx = optax.sgd(0.01)
    graphdef, state = training.init(_quantized(qat.hif8_w8a8()), tx)
    batch = jnp.ones((4, 16))
    scalar = lambda m, b: jnp.mean(m(b) ** 2)  # noqa: E731
    _, m = training.make_step(graphdef, tx, scalar)(state, batch)
    assert set(m) == {"loss", "observe_only", "skipped", "finite", "max_saturated_fraction",
                      "mean_saturated_fraction", "nonfinite_quantized"}
    pair = lambda m, b: (jnp.mean(m(b) ** 2), {})  # noqa: E731
    _, m2 = training.make_step(graphdef, tx, pair)(state, batch)
    assert float(m2["loss"]) == float(m["loss"])
    with pytest.raises(TypeError, match=r"must return a scalar loss .*got a loss of shape \(4, 32\).*jnp.mean"):
        training.make_step(graphdef, tx, lambda m, b: m(b))(state, batch)
    with pytest.raises(ValueError, match=r"aux names \['loss'\] clash"):
        training.make_step(graphdef, tx, lambda m, b: (jnp.mean(m(b)), {"loss": 1.0}))(state, batch)
    _, m3 = training.make_step(graphdef, tx, lambda m, b: (jnp.mean(m(b)), jnp.float32(2.0)))(state, batch)
    assert float(m3["aux"]) == 2.0  # a non-dict aux comes back whole
