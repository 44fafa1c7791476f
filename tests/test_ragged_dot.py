"""The quantized grouped GEMM of mixtures of experts (`jaxlowfp.ops.ragged_dot`, issue 29 item 2): each expert is
the quantized GEMM of its own rows, with its own scales, and an expert no token reaches keeps its history."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlowfp import nvfp4, ops, qat
from jaxlowfp.qat import QuantSpec, Recipe
from jaxlowfp.scaling import CurrentScaling

G, K, N = 4, 32, 48
SIZES = np.array([5, 0, 9, 3])  # expert 1 gets no token; 17 rows, the last 3 of 20 are padding
M = 20
DN = (((1,), (0,)), ((), ()))


def _operands(seed=0):
    rng = np.random.default_rng(seed)
    scale = np.geomspace(0.01, 100.0, M)[:, None]  # very different row magnitudes: scales must stay per expert
    x = jnp.asarray(rng.standard_normal((M, K)) * scale, jnp.float32)
    w = jnp.asarray(rng.standard_normal((G, K, N)) * np.array([1, 3, 0.1, 10])[:, None, None], jnp.float32)
    return x, w


RECIPES = {
    "hif8": qat.hif8_w8a8(),
    "nvfp4": qat.nvfp4_w4a4("mse"),
    "nvfp4_16x16": Recipe(weight=QuantSpec(format="nvfp4", rule="mae", block_shape=(16, 16)),
                          activation=QuantSpec(format="nvfp4", rule="mae"), name="nvfp4_16x16"),
    "mxfp8": Recipe(weight=QuantSpec(format="mxfp8"), activation=QuantSpec(format="mxfp8"), name="mxfp8"),
}


@pytest.fixture(scope="module")
def ragged():
    return jax.jit(lambda x, w, s, r: ops.ragged_dot(x, w, s, recipe=r, state=None), static_argnums=3)


@pytest.mark.parametrize("name", list(RECIPES))
def test_each_expert_is_its_own_quantized_gemm(ragged, name):
    """The oracle: expert g's rows times W_g through the op layer's GEMM (`ops.dot_general`, its own scales), one
    call per expert; the grouped GEMM must give the same rows (bitwise: the same quantized values, and each row's
    product is the same K-sum)."""
    recipe = RECIPES[name]
    x, w = _operands()
    got, state, stats = ragged(x, w, jnp.asarray(SIZES, jnp.int32), recipe)
    start = 0
    for g, size in enumerate(SIZES):
        if size:
            want = ops.dot_general(x[start:start + size], w[g], DN, recipe=recipe)[0]
            np.testing.assert_allclose(np.asarray(got[start:start + size]), np.asarray(want), rtol=1e-6, atol=1e-6)
        start += size
    np.testing.assert_array_equal(np.asarray(got[start:]), 0.0)  # padding rows: no expert
    assert bool(jnp.isfinite(stats.activation.amax)) and bool(jnp.isfinite(stats.weight.scale))


def test_nvfp4_expert_weights_against_the_quantizer():
    """Independent of the op layer: expert g's weight is `nvfp4.fake_quantize` of W_g^T (blocks along K) with its
    own global amax, and its rows are quantized with the global amax of that expert's rows only."""
    x, w = _operands(1)
    recipe = RECIPES["nvfp4"]
    got = ops.ragged_dot(x, w, jnp.asarray(SIZES, jnp.int32), recipe=recipe)[0]
    start = 0
    for g, size in enumerate(SIZES):
        if size:
            xg = nvfp4.fake_quantize(x[start:start + size], rule="mse")
            wg = nvfp4.fake_quantize(w[g].T, rule="mse").T
            np.testing.assert_allclose(np.asarray(got[start:start + size]), np.asarray(xg @ wg), rtol=1e-5,
                                       atol=1e-5)
        start += size


def test_an_expert_without_tokens_keeps_its_history():
    x, w = _operands(2)
    recipe = qat.hif8_w8a8(history_len=4)
    state = ops.ragged_state(recipe, G)
    sizes = jnp.asarray(SIZES, jnp.int32)
    step = jax.jit(lambda s, x: ops.ragged_dot(x, w, sizes, recipe=recipe, state=s)[1])
    s1 = step(state, x)
    s2 = step(s1, 2 * x)
    act = s2.activation
    np.testing.assert_array_equal(np.asarray(act.count), [2, 0, 2, 2])  # expert 1 never recorded anything
    np.testing.assert_array_equal(np.asarray(act.history[1]), np.asarray(state.activation.history[1]))
    assert np.all(np.isfinite(np.asarray(act.history))) and not np.any(np.asarray(act.history[[0, 2, 3], :2]) == 0)
    row_amax = np.max(np.abs(np.asarray(x)), axis=1)
    np.testing.assert_allclose(np.asarray(act.history[0, :2]), [row_amax[:5].max(), 2 * row_amax[:5].max()])
    np.testing.assert_array_equal(np.asarray(s2.weight.count), [2, 2, 2, 2])  # weights exist without tokens


def test_shared_scales_take_one_amax_and_padding_enters_none():
    x, w = _operands(3)
    x = x.at[-1].set(1e6)  # a padding row (past sum(group_sizes)): must not enter any amax
    recipe = Recipe(activation=QuantSpec(format="hif8", scaling=CurrentScaling(target_max=15.0)), name="a-only")
    got, state, stats = ops.ragged_dot(x, w, jnp.asarray(SIZES, jnp.int32), recipe=recipe, expert_scales="shared")
    valid = int(SIZES.sum())
    assert float(stats.activation.amax) == float(jnp.max(jnp.abs(x[:valid])))
    want = qat.fake_quant(x[:valid], recipe.activation.init(), recipe.activation)[0]
    start = 0
    for g, size in enumerate(SIZES):
        if size:
            np.testing.assert_allclose(np.asarray(got[start:start + size]),
                                       np.asarray(want[start:start + size] @ w[g]), rtol=1e-6, atol=1e-5)
        start += size


def test_gradients_are_straight_through():
    x, w = _operands(4)
    sizes = jnp.asarray(SIZES, jnp.int32)
    recipe = RECIPES["nvfp4"]

    def loss(x, w):
        return jnp.sum(ops.ragged_dot(x, w, sizes, recipe=recipe)[0] ** 2)

    gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
    # STE: the gradient of the plain ragged_dot at the quantized operands
    y = ops.ragged_dot(x, w, sizes, recipe=recipe)[0]
    xq = jnp.concatenate([nvfp4.fake_quantize(x[a:b], rule="mse") if b > a else x[a:b]
                          for a, b in zip(np.r_[0, np.cumsum(SIZES)[:-1]], np.cumsum(SIZES))] + [x[SIZES.sum():]])
    wq = jnp.stack([nvfp4.fake_quantize(w[g].T, rule="mse").T for g in range(G)])
    _, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), xq, wq)
    ex, ew = vjp(2 * y)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(ex), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(ew), rtol=1e-5, atol=1e-4)


def test_bad_input_is_clear():
    x, w = _operands()
    sizes = jnp.asarray(SIZES, jnp.int32)
    with pytest.raises(ValueError, match=r"lhs \[M, K\], rhs \[G, K, N\]"):
        ops.ragged_dot(x[:, :16], w, sizes, recipe=RECIPES["hif8"])
    with pytest.raises(NotImplementedError, match="straight-through backward only"):
        ops.ragged_dot(x, w, sizes, recipe=qat.nvfp4_training())
    with pytest.raises(ValueError, match="expert_scales='all'"):
        ops.ragged_dot(x, w, sizes, recipe=RECIPES["hif8"], expert_scales="all")
    with pytest.raises(ValueError, match="block size 16"):
        ops.ragged_dot(x[:, :24], w[:, :24], sizes, recipe=RECIPES["nvfp4"])


# --- QAT of a mixture-of-experts layer through qnnx -----------------------------------------------------------

from flax import nnx  # noqa: E402


class TinyExperts(nnx.Module):
    """The grouped-GEMM protocol of `jaxlowfp.qnnx.quantize`: ``grouped_weights`` names the [E, K, N] params, and
    every product goes through ``quant_<name>`` when quantize attached one (as `jaxlowfp.models.moe.Experts`)."""

    grouped_weights = ("up", "down")

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.up = nnx.Param(init(rngs.params(), (G, K, N)))
        self.down = nnx.Param(init(rngs.params(), (G, N, K)))

    def grouped_matmul(self, x, name, sizes):
        op = getattr(self, "quant_" + name, None)
        w = getattr(self, name)[...]
        return jax.lax.ragged_dot(x, w, sizes) if op is None else op.ragged_dot(x, w, sizes)

    def __call__(self, x, sizes):
        return self.grouped_matmul(nnx.relu(self.grouped_matmul(x, "up", sizes)), "down", sizes)


class TinyMoE(nnx.Module):
    def __init__(self, rngs):
        self.experts = TinyExperts(rngs)

    def __call__(self, batch):
        return self.experts(batch["x"], batch["sizes"].reshape(-1))  # a microbatch holds sizes [1, G]


def test_qnnx_quantizes_expert_weights_and_training_keeps_empty_experts():
    import optax

    from jaxlowfp import qnnx, training

    model = TinyMoE(nnx.Rngs(0))
    x, _ = _operands(5)
    want = ops.ragged_dot(x, model.experts.up[...], jnp.asarray(SIZES, jnp.int32), recipe=qat.hif8_w8a8())[0]
    report = qnnx.quantize_model(model, [qnnx.Rule(path="experts/up", recipe=qat.hif8_w8a8()),
                                   qnnx.Rule(path="experts/gate", recipe=qat.hif8_w8a8())])
    assert report.quantized == (("experts/up", "hif8_w8a8"),) and report.unmatched == ("experts/down",)
    assert report.unused_rules == ("experts/gate",)
    assert isinstance(model.experts.quant_up, qnnx.QuantRaggedOp)
    assert model.experts.quant_up.amax.get_value().activation.history.shape == (G, 64)  # one history per expert
    got = model.experts.grouped_matmul(x, "up", jnp.asarray(SIZES, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert report.executed() == ("experts/up",)

    sizes = jnp.asarray(np.stack([SIZES, SIZES]), jnp.int32)  # two microbatches, expert 1 empty in both
    batch = {"x": jnp.concatenate([x, 0.5 * x]), "sizes": sizes.reshape(-1)}
    graphdef, state = training.init(model, optax.sgd(1e-3))
    step = training.make_step(graphdef, optax.sgd(1e-3), lambda m, b: (jnp.mean(m(b) ** 2), {}), microbatches=2)
    batch = {"x": batch["x"], "sizes": sizes}
    state, metrics = jax.jit(step)(state, batch)
    hist = nnx.merge(graphdef, state.params, state.qstate, state.rest).experts.quant_up.amax.get_value().activation
    # the direct call above recorded step 1; the train step's two microbatches merge (by max) into step 2; expert 1,
    # which no token reached, recorded nothing
    np.testing.assert_array_equal(np.asarray(hist.count), [2, 0, 2, 2])
    row_amax = np.max(np.abs(np.asarray(x)), axis=1)
    np.testing.assert_allclose(float(hist.history[0, 1]), row_amax[:5].max(), rtol=1e-6)  # the larger microbatch
    np.testing.assert_array_equal(np.asarray(hist.history[1]), 0.0)
    assert np.isfinite(float(metrics["loss"]))


def test_qwix_provider_intercepts_ragged_dot():
    """A module that calls jax.lax.ragged_dot itself (as MaxText's MoE layers do), quantized by interception: the
    same output as the op layer's ragged_dot on the same operands, per-expert state in a QuantRaggedOp child."""
    import qwix

    from jaxlowfp import qnnx, qwix_provider

    class Grouped(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))(
                rngs.params(), (G, K, N)))

        def __call__(self, x, sizes):
            return jax.lax.ragged_dot(x, self.w[...], sizes)

    x, _ = _operands(6)
    sizes = jnp.asarray(SIZES, jnp.int32)
    recipe = RECIPES["nvfp4"]
    provider = qwix_provider.RecipeProvider([qwix_provider.RecipeRule(module_path=".*", recipe=recipe)])
    model = qwix.quantize_model(Grouped(nnx.Rngs(0)), provider, x, sizes)
    op = model.jaxlowfp_ragged_dot0
    assert isinstance(op, qnnx.QuantRaggedOp) and provider.executed() == (("", "ragged_dot0", recipe.name),)
    want = ops.ragged_dot(x, model.w[...], sizes, recipe=recipe)[0]
    np.testing.assert_array_equal(np.asarray(model(x, sizes)), np.asarray(want))
