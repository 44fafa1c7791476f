"""Foreign train loops and third-party model code.

- The ``_overwrite_with_gradient`` convention (jaxlowfp.owg): Flax's own TrainState applies the carried state,
  and a gradient-accumulation step written like MaxText's (maxtext 0.2.5, ``maxtext/utils/gradient_accumulation.py``:
  scan over microbatches, ``tree_map(x + y)``, then ``tree_map(arr / total_weights)``) gives the state one large
  batch would once ``owg.accumulate`` / ``owg.finalize`` replace those two tree maps (and a corrupt one without).
- Model code we did not write, quantized by interception: ``mamba2-jax`` (the NNX Mamba2 of the Bonsai model zoo,
  jax-ml/bonsai, packaged on PyPI) with HiF8 W8A8 and NVFP4 4/6, trained with delayed max-window scaling and
  checked against the same model quantized by module replacement (QuantLinear); ``nano-moe-jax`` (a Linen MoE
  language model) trained through the MaxText-style accumulation with its state carried as gradients.
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import mamba2_jax
import nano_moe
import numpy as np
import optax
import pytest
import qwix
from flax import nnx
from flax.linen import fp8_ops
from flax.training import train_state

from jaxlowfp import owg, qat, qlinen, qnnx, training
from jaxlowfp.qwix_provider import RecipeProvider, RecipeRule

HIF8 = qat.hif8_w8a8(history_len=8)
NVFP4 = qat.nvfp4_w4a4("mse")


def test_collection_is_flax_fp8_convention():
    assert owg.COLLECTION == fp8_ops.OVERWRITE_WITH_GRADIENT


@functools.partial(jax.jit, static_argnums=(0, 3), static_argnames=("accumulate", "finalize"))
def maxtext_ga_grads(apply_loss, variables, batch, k, *, accumulate=None, finalize=None):
    """The Linen path of MaxText's gradient_accumulation_loss_and_grad, reduced to what touches the gradients:
    differentiate every variable (params and _overwrite_with_gradient), add the microbatch gradients, divide by
    the total weight. `accumulate` / `finalize` replace its two tree maps when given (the patch we document)."""
    add = accumulate or (lambda acc, g: jax.tree.map(lambda x, y: x + y, g, acc))
    div = finalize or (lambda acc, w: jax.tree.map(lambda arr: (arr / w).astype(arr.dtype), acc))
    micro = jax.tree.map(lambda a: jnp.swapaxes(a.reshape(a.shape[0] // k, k, *a.shape[1:]), 0, 1), batch)
    grad_func = jax.value_and_grad(apply_loss, has_aux=True)

    def body(acc, mb):
        (_, aux), g = grad_func(variables, mb)
        return {"grad": add(acc["grad"], g), "loss": acc["loss"] + aux["xent_sum"],
                "total_weights": acc["total_weights"] + aux["total_weights"]}, None

    init = {"grad": jax.tree.map(jnp.zeros_like, variables), "loss": jnp.zeros((), jnp.float32),
            "total_weights": jnp.zeros((), jnp.float32)}
    acc, _ = jax.lax.scan(body, init, micro)
    return acc["loss"] / acc["total_weights"], div(acc["grad"], acc["total_weights"])


class Dense2(nn.Module):
    @nn.compact
    def __call__(self, x):
        cls = qlinen.quant_dot_general_cls(HIF8, carry="gradient")
        h = nn.Dense(64, dot_general_cls=cls, name="up")(x)
        return nn.Dense(32, dot_general_cls=cls, name="down")(jax.nn.gelu(h))


def _mse(variables, batch):
    x, y = batch
    err = jnp.sum((Dense2().apply(variables, x) - y) ** 2)
    return err, {"xent_sum": err, "total_weights": jnp.asarray(x.shape[0], jnp.float32)}


_MSE = _mse  # one function object: the jitted accumulation compiles once per configuration


@functools.cache
def _init_dense2(seed):
    """Dense2's variables, initialised under jit (eager init dispatches every quantizer op on its own: slow)."""
    return jax.jit(Dense2().init)(jax.random.key(seed), jnp.ones((1, 32), jnp.float32))


def test_max_merge_over_four_microbatches_equals_one_large_batch():
    model = Dense2()
    x = jax.random.normal(jax.random.key(0), (16, 32), jnp.float32)
    x = x * jnp.arange(1, 17, dtype=jnp.float32)[:, None]  # each microbatch has its own amax
    batch = (x, jnp.tanh(x))
    v = _init_dense2(1)
    v = {"params": v["params"], owg.COLLECTION: v[owg.COLLECTION]}
    loss = _MSE
    tx = optax.sgd(1e-3)
    state = train_state.TrainState.create(apply_fn=model.apply, params=v, tx=tx)
    # warm the histories with one step of a single batch (Flax's TrainState applies the carried state)
    patched = dict(accumulate=owg.accumulate, finalize=owg.finalize)
    _, g0 = maxtext_ga_grads(loss, state.params, batch, 1, **patched)
    state = state.apply_gradients(grads=g0)
    for a, b in zip(jax.tree.leaves(state.params[owg.COLLECTION]), jax.tree.leaves(g0[owg.COLLECTION])):
        np.testing.assert_array_equal(a, b)  # replaced exactly, not updated by the optimizer
    warm = state.params

    _, g1 = maxtext_ga_grads(loss, warm, batch, 1, **patched)  # one large batch
    _, g4 = maxtext_ga_grads(loss, warm, batch, 4, **patched)
    _, bad = maxtext_ga_grads(loss, warm, batch, 4)  # MaxText's own accumulation: sums, then divides
    s1, s4, sbad = (owg.from_carried(g[owg.COLLECTION]["up"]["QuantDotGeneral_0"]["recipe_state"])[0]
                    for g in (g1, g4, bad))
    assert int(s1.activation.count) == 2
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s4)):  # the layer fed by the batch itself: exact
        np.testing.assert_array_equal(a, b)
    d1, d4 = (owg.from_carried(g[owg.COLLECTION]["down"]["QuantDotGeneral_0"]["recipe_state"])[0] for g in (g1, g4))
    # the second layer's input is computed per microbatch: equal up to float32 rounding of the first GEMM
    np.testing.assert_allclose(d1.activation.history, d4.activation.history, rtol=1e-6)
    assert int(d4.activation.count) == 2
    for a, b in zip(jax.tree.leaves(g1["params"]), jax.tree.leaves(g4["params"])):
        # a sum over 16 rows in another order: float32 rounding relative to the gradient's scale
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6 * float(np.max(np.abs(b))))
    # without the patch the history is the token-weighted mean of the microbatch states: clipped silently
    assert float(sbad.activation.history[1]) < 0.5 * float(s1.activation.history[1])


def test_set_observe_only_switches_the_carried_flag():
    v = _init_dense2(1)
    on = qlinen.set_observe_only(v, True)
    flags = [c.observe_only for c in jax.tree.leaves(on[owg.COLLECTION], is_leaf=owg.is_carried)]
    assert [float(f) for f in flags] == [1.0, 1.0]
    x = jax.random.normal(jax.random.key(1), (4, 32))
    ref = nn.Dense(64).apply({"params": on["params"]["up"]}, x)
    h = nn.Dense(64, dot_general_cls=qlinen.quant_dot_general_cls(HIF8, carry="gradient")).apply(
        {"params": on["params"]["up"], owg.COLLECTION: on[owg.COLLECTION]["up"]}, x)
    np.testing.assert_array_equal(h, ref)  # observe-only: the high-precision layer, bit for bit


@pytest.fixture
def third_party_promotion():
    """The third-party models rely on JAX's default promotion (conftest makes it strict for our own code)."""
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        yield


# ---- mamba2-jax: an NNX model zoo's model, quantized by interception and by module replacement -------------

def _mamba(seed=0):
    cfg = mamba2_jax.Mamba2Config(vocab_size=64, hidden_size=32, state_size=16, head_dim=16, chunk_size=8,
                                  num_hidden_layers=1)
    return mamba2_jax.Mamba2ForCausalLM(cfg, rngs=nnx.Rngs(seed))


def _lm_loss(m, ids):
    return m(ids, labels=ids)["loss"], {}


def test_mamba2_by_interception_equals_module_replacement(third_party_promotion):
    """in_proj with HiF8 W8A8 (delayed, max over the window), out_proj with NVFP4 4/6 (MSE rule)."""
    ids = jax.random.randint(jax.random.key(0), (4, 16), 0, 64)
    mixer = r"backbone/layers/\d+/mixer/"
    provider = RecipeProvider([RecipeRule(module_path=mixer + "in_proj", recipe=HIF8),
                               RecipeRule(module_path=mixer + "out_proj", recipe=NVFP4)])
    # quantize_model's own first call runs eagerly (op by op: slow); skip it and make that call under jit
    theirs = qwix.quantize_model(_mamba(), provider, ids[:2], skip_nnx_init=True)
    ours = _mamba()
    report = qnnx.quantize_model(ours, [qnnx.Rule(path=mixer + "in_proj", recipe=HIF8),
                                  qnnx.Rule(path=mixer + "out_proj", recipe=NVFP4)])
    assert dict(report.quantized) == {"backbone/layers/0/mixer/in_proj": "hif8_w8a8",
                                      "backbone/layers/0/mixer/out_proj": "nvfp4_w4a4_mse"}
    assert list(qnnx.iter_quant_ops(theirs)) == []  # the provider creates its ops on the first call
    for model in (theirs, ours):  # the call quantize_model would make: both histories hold that record
        nnx.jit(lambda m, x: m(x))(model, ids[:2])
    assert provider.get_unused_rules() == [] and len(list(qnnx.iter_quant_ops(theirs))) == 2
    tx = optax.adam(3e-3)
    results = []
    for model in (theirs, ours):
        graphdef, state = training.init(model, tx)
        step = jax.jit(training.make_step(graphdef, tx, _lm_loss, warmup=qat.Warmup(steps=1)))
        losses = []
        for _ in range(2):
            state, metrics = step(state, ids)
            losses.append(float(metrics["loss"]))
        results.append((state, losses))
    (s_t, l_t), (s_o, l_o) = results
    assert all(np.isfinite(l_t)) and l_t[-1] < l_t[0]
    np.testing.assert_allclose(l_t, l_o, rtol=1e-6)  # in practice bit for bit; a tolerance for other CPUs' GEMMs
    for a, b in zip(jax.tree.leaves(s_t.params), jax.tree.leaves(s_o.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    hist_t = {p[:-2]: v.get_value() for p, v in nnx.to_flat_state(s_t.qstate)}
    hist_o = {p[:-1]: v.get_value() for p, v in nnx.to_flat_state(s_o.qstate)}
    assert sorted(hist_t) == sorted(hist_o)
    for k in hist_t:
        assert int(hist_t[k].activation.count) == 3  # quantize_model's call + 2 steps
        np.testing.assert_allclose(hist_t[k].activation.history, hist_o[k].activation.history, rtol=1e-6)


# ---- nano-moe-jax: a Linen MoE LM trained through the MaxText-style accumulation ---------------------------

def test_nano_moe_trains_with_carried_state_and_maxtext_accumulation(third_party_promotion):
    cfg = nano_moe.NanoMoEConfig(vocab_size=64, n_layers=1, n_heads=2, d_model=32, d_ff=64, n_experts=2, top_k=1,
                                 block_size=16, dropout_rate=0.0)
    rules = [RecipeRule(module_path=r"block_0/MoELayer_0/expert_\d+/Dense_\d+", op_names=("dot_general",),
                        recipe=HIF8)]
    provider = RecipeProvider(rules, carry="gradient")
    model = qwix.quantize_model(nano_moe.NanoMoE(cfg), provider)
    ids = jax.random.randint(jax.random.key(0), (8, 16), 0, 64)
    v = jax.jit(model.init)(jax.random.key(1), ids[:1])  # eager init would dispatch op by op: slow
    assert sorted(v[owg.COLLECTION]["block_0"]["MoELayer_0"]) == ["expert_0", "expert_1"]
    v = {"params": v["params"], owg.COLLECTION: v[owg.COLLECTION]}

    def loss(variables, tokens):
        logits, aux = model.apply(variables, tokens[:, :-1])
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        total = jnp.asarray(xent.size, jnp.float32)
        return jnp.sum(xent) + 0.01 * aux * total, {"xent_sum": jnp.sum(xent), "total_weights": total}

    state = train_state.TrainState.create(apply_fn=model.apply, params=v, tx=optax.adam(1e-2))

    @jax.jit
    def step(state, ids):
        l, g = maxtext_ga_grads(loss, state.params, ids, 4, accumulate=owg.accumulate, finalize=owg.finalize)
        return state.apply_gradients(grads=g), l

    losses = []
    for _ in range(2):
        state, l = step(state, ids)
        losses.append(float(l))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    carried = state.params[owg.COLLECTION]["block_0"]["MoELayer_0"]["expert_0"]["Dense_0"]["dot_general0"]
    st, observe = owg.from_carried(carried)
    assert int(st.activation.count) == 2 and not bool(observe)  # one record per step, not per microbatch
