"""Einsum and general dense layers: nnx.Einsum / nnx.LinearGeneral (QuantEinsum, QuantLinearGeneral via
qnnx.quantize_model), Linen DenseGeneral (dot_general_cls) and Einsum (qlinen.QuantEinsum), quantized and trained.

Judges: jnp.einsum and lax.dot_general for the contraction layouts, Flax's own nnx.Einsum / nnx.LinearGeneral /
nn.Einsum / nn.DenseGeneral for the high-precision (observe-only) forward and the parameter layout, the en_dtypes
HiF8 codec (tests/oracles.py) for the quantized values."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxlowfp import nvfp4, qat, qlinen, qnnx, training
from jaxlowfp.ops import contract, parse_einsum
from tests.oracles import hif8_fake_quant_f64

HIF8 = qat.hif8_w8a8()
NVFP4 = qat.nvfp4_w4a4("mse")


def _rand(key, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


@pytest.mark.parametrize("spec,ls,rs", [
    ("bd,df->bf", (4, 32), (32, 16)),
    ("btd,dnh->btnh", (2, 3, 32), (32, 2, 8)),
    ("btnh,nhd->btd", (2, 3, 2, 16), (2, 16, 8)),
    ("df,btd->bft", (32, 8), (2, 3, 32)),  # weight first, output axes permuted
    ("ebd,edf->ebf", (2, 4, 16), (2, 16, 8)),  # a batch axis (experts)
    ("...d,df->...f", (2, 3, 32), (32, 16)),
])
def test_parse_einsum_matches_jnp_einsum(spec, ls, rs):
    a, b = _rand(0, ls), _rand(1, rs)
    e = parse_einsum(spec, a, b)
    y = jnp.transpose(jax.lax.dot_general(a, b, e.dimension_numbers), e.out_perm)
    np.testing.assert_allclose(y, jnp.einsum(spec, a, b), rtol=1e-6, atol=1e-6)  # same sums, maybe another order


@pytest.mark.parametrize("spec", ["bd,bd->b", "bdd,df->bf", "bd,df->f", "bd,df,fg->bg"])
def test_parse_einsum_refuses_what_is_not_a_gemm(spec):
    ops = [jnp.ones((4, 16)), jnp.ones((16, 8))] if spec.count(",") == 1 else [jnp.ones((4, 16))] * 2
    if spec.startswith("bdd"):
        ops[0] = jnp.ones((4, 16, 16))
    if spec == "bd,bd->b":  # a contraction of two same-shaped operands is fine; a summed free axis is not
        parse_einsum(spec, *ops[:1] * 2)
        return
    with pytest.raises(ValueError, match="einsum"):
        parse_einsum(spec, *ops)


@pytest.mark.parametrize("weight", [0, 1])
def test_contract_hif8_equals_the_oracle_on_the_weight_and_activation(weight):
    """Multi-axis contraction, weight on either side: values are per-tensor HiF8 (en_dtypes) of both operands."""
    x, w = _rand(2, (3, 2, 16)), _rand(3, (2, 16, 8), 0.1)   # 'btnh... -> contract (n, h)'
    dn = (((1, 2), (0, 1)), ((), ()))
    lhs, rhs = (x, w) if weight == 1 else (w, x)
    dnw = dn if weight == 1 else (((0, 1), (1, 2)), ((), ()))
    y, _, stats = contract(lhs, rhs, dnw, recipe=HIF8, state=HIF8.init(), weight=weight)
    xq = hif8_fake_quant_f64(np.asarray(x), float(jnp.max(jnp.abs(x))))
    wq = hif8_fake_quant_f64(np.asarray(w), float(jnp.max(jnp.abs(w))))
    want = np.einsum("anh,nhd->ad", xq, wq) if weight == 1 else np.einsum("nhd,anh->da", wq, xq)
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=1e-6)  # float32 GEMM vs float64 einsum of exact values
    assert float(stats.activation.amax) == float(jnp.max(jnp.abs(x)))


def test_nvfp4_blocks_run_along_the_flattened_contraction():
    x, w = _rand(4, (5, 2, 16)), _rand(5, (2, 16, 8))
    y, _, _ = contract(x, w, (((1, 2), (0, 1)), ((), ())), recipe=NVFP4, state=NVFP4.init())
    xq = nvfp4.fake_quantize(x.reshape(5, 32), rule="mse")
    wq = nvfp4.fake_quantize(w.reshape(32, 8).T, rule="mse").T  # weight blocks along K (its first axis)
    np.testing.assert_allclose(y, xq @ wq, rtol=1e-6, atol=1e-6)


def test_block_and_batch_errors_are_clear():
    with pytest.raises(ValueError, match=r"contraction size K .* is not a multiple of the block size 16"):
        qnnx.QuantEinsum("bd,df->bf", (24, 16), recipe=NVFP4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"batch axes"):
        qnnx.QuantEinsum("ebd,edf->ebf", (2, 16, 16), recipe=NVFP4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"prod\(in_features=\(3, 8\)\)=24 is not a multiple"):
        qnnx.QuantLinearGeneral((3, 8), 16, axis=(-2, -1), recipe=NVFP4, rngs=nnx.Rngs(0))
    with pytest.raises(NotImplementedError, match="batch axis 0"):
        contract(jnp.ones((2, 4, 16)), jnp.ones((2, 16, 16)), (((2,), (1,)), ((0,), (0,))), recipe=NVFP4,
                 state=NVFP4.init())
    qe = qnnx.QuantEinsum("ebd,edf->ebf", (2, 16, 8), recipe=HIF8, rngs=nnx.Rngs(0))  # per-tensor: fine
    assert qe(jnp.ones((2, 4, 16))).shape == (2, 4, 8)


class Net(nnx.Module):
    """Third-party-style layers: nnx.Einsum (with bias), nnx.LinearGeneral over two axes, nnx.Linear."""

    def __init__(self, rngs):
        self.qkv = nnx.Einsum("btd,dnh->btnh", (32, 2, 16), (2, 16), rngs=rngs)
        self.out = nnx.LinearGeneral((2, 16), 32, axis=(-2, -1), rngs=rngs)
        self.head = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.gelu(self.out(jax.nn.gelu(self.qkv(x)))))


@pytest.mark.parametrize("recipe", [HIF8, NVFP4], ids=["hif8", "nvfp4_4over6"])
def test_quantize_replaces_einsum_and_linear_general_and_observe_only_is_flax(recipe):
    x = _rand(6, (2, 4, 32))
    model = Net(nnx.Rngs(0))
    want = model(x)
    report = qnnx.quantize_model(model, [qnnx.Rule(path=".*", recipe=recipe)])
    assert dict(report.quantized) == {"qkv": recipe.name, "out": recipe.name, "head": recipe.name}
    assert (type(model.qkv), type(model.out)) == (qnnx.QuantEinsum, qnnx.QuantLinearGeneral)
    assert report.quantized_fraction == 1.0
    assert qnnx.set_observe_only(model, True) == 3
    np.testing.assert_allclose(model(x), want, rtol=1e-6, atol=1e-6)  # flattened GEMM vs Flax's layouts
    qnnx.set_observe_only(model, False)
    y = model(x)
    assert not np.allclose(y, want, rtol=1e-3) and np.allclose(y, want, rtol=0.5, atol=0.5)
    stats = qnnx.collect_stats(model)
    assert stats["qkv/activation/amax"] == pytest.approx(float(jnp.max(jnp.abs(x))))


def test_einsum_and_linear_general_train_with_make_step():
    model = Net(nnx.Rngs(1))
    qnnx.quantize_model(model, [qnnx.Rule(path="qkv|out", recipe=HIF8)])
    x = _rand(7, (8, 4, 32))
    tgt = jnp.tanh(x)

    def loss_fn(m, batch):
        return jnp.mean((m(batch[0]) - batch[1]) ** 2), {}

    tx = optax.adam(3e-3)
    graphdef, state = training.init(model, tx)
    step = jax.jit(training.make_step(graphdef, tx, loss_fn, warmup=qat.Warmup(steps=1), microbatches=2,
                                      telemetry_layer="qkv"))
    losses = []
    for _ in range(4):
        state, metrics = step(state, (x, tgt))
        losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert int(state.qstate["qkv"]["amax"].get_value().activation.count) == 4
    assert float(metrics["amax_estimate"]) > 0


def test_multi_head_attention_linear_generals():
    """Flax's own nnx.MultiHeadAttention projects with nnx.LinearGeneral (query/key/value/out)."""
    mha = nnx.MultiHeadAttention(num_heads=2, in_features=32, qkv_features=32, decode=False, rngs=nnx.Rngs(0))
    x = _rand(8, (2, 5, 32))
    want = mha(x)
    report = qnnx.quantize_model(nnx.Dict(attn=mha), [qnnx.Rule(path="attn/(query|key|value|out)", recipe=NVFP4)])
    assert sorted(p for p, _ in report.quantized) == ["attn/key", "attn/out", "attn/query", "attn/value"]
    qnnx.set_observe_only(mha, True)
    np.testing.assert_allclose(mha(x), want, rtol=1e-5, atol=1e-6)
    qnnx.set_observe_only(mha, False)
    assert np.all(np.isfinite(mha(x)))


class LinenNet(nn.Module):
    recipe: qat.Recipe

    @nn.compact
    def __call__(self, x):
        h = qlinen.QuantEinsum((32, 2, 16), "btd,dnh->btnh", recipe=self.recipe, name="qkv")(x)
        return nn.DenseGeneral(32, axis=(-2, -1), name="out",
                               dot_general_cls=qlinen.quant_dot_general_cls(self.recipe))(jax.nn.gelu(h))


class LinenRef(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Einsum((32, 2, 16), "btd,dnh->btnh", name="qkv")(x)
        return nn.DenseGeneral(32, axis=(-2, -1), name="out")(jax.nn.gelu(h))


def test_linen_einsum_and_dense_general():
    recipe = NVFP4
    x = _rand(9, (2, 4, 32))
    ref = LinenRef().init(jax.random.key(0), x)
    v = LinenNet(recipe).init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, v["params"]) == jax.tree.map(jnp.shape, ref["params"])  # same param layout
    np.testing.assert_array_equal(v["params"]["qkv"]["kernel"], ref["params"]["qkv"]["kernel"])
    v = qlinen.set_observe_only(v, True)
    np.testing.assert_allclose(LinenNet(recipe).apply(v, x), LinenRef().apply(ref, x), rtol=1e-6, atol=1e-6)
    v = qlinen.set_observe_only(v, False)
    tgt = jnp.tanh(x)

    @jax.jit
    def step(v):
        def loss(p):
            y, upd = LinenNet(recipe).apply({**v, "params": p}, x, mutable=[qlinen.AMAX_COLLECTION])
            return jnp.mean((y - tgt) ** 2), upd
        (l, upd), g = jax.value_and_grad(loss, has_aux=True)(v["params"])
        p = jax.tree.map(lambda a, b: a - 0.05 * b, v["params"], g)
        return {**v, "params": p, **upd}, l

    losses = []
    for _ in range(3):
        v, l = step(v)
        losses.append(float(l))
    assert losses[-1] < losses[0]
    assert int(v[qlinen.AMAX_COLLECTION]["out"]["QuantDotGeneral_0"]["recipe_state"].activation.count) == 3
