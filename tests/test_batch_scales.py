"""No quantized score depends on its batch without a word (issue 45, item 5): a model quantized for QAT with the
default ``qat.nvfp4_w4a4()`` recipe (current per-tensor activation scaling) scores the same requests differently
alone and batched; `score_requests` names the ops whose scale spans the batch (a warning by default, an error with
``batch_scales="error"``) and ``batch_scales="token"`` scores them with per-token activation scales."""
import dataclasses
import warnings

import jax
import numpy as np
import pytest
from flax import nnx

from jaxlowfp import evaluation, execution, ptq, qat, qnnx
from jaxlowfp.evaluation import Request, batch_scaled_ops, score_requests
from jaxlowfp.models.llama import PRESETS, Llama

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=2)
MLP = r"blocks/\d+/mlp/\w+_proj"


def _qat_model(recipe=None):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    report = qnnx.quantize_model(model, [qnnx.Rule(path=MLP, recipe=recipe or qat.nvfp4_w4a4())])
    assert len(report.quantized) == 6
    return model


@pytest.fixture(scope="module")
def requests():
    rng = np.random.default_rng(1)
    # two length buckets (`jaxlowfp.evaluation._bucket`: 16 and 64), one compiled program each per batch shape
    return [Request(tuple(int(t) for t in rng.integers(0, 256, n)), n_pred=n - 1) for n in (9, 14, 58, 61)]


def _alone_and_batched(model, requests, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = np.array([score_requests(model, [r], batch_size=4, **kw)[0][0] for r in requests])
        return alone, score_requests(model, requests, batch_size=4, **kw)[0]


def test_batch_scaled_ops_names_the_per_tensor_activations():
    found = batch_scaled_ops(_qat_model())
    assert sorted(p for p, _ in found) == sorted(f"blocks/{i}/mlp/{n}" for i in range(2)
                                                 for n in ("gate_proj", "up_proj", "down_proj"))
    assert all("nvfp4_w4a4_mse" in why and "whole batch" in why for _, why in found)
    from jaxlowfp.harness import eval_recipe

    assert batch_scaled_ops(_qat_model(eval_recipe(qat.nvfp4_w4a4(), "token"))) == []  # per token: nothing
    assert batch_scaled_ops(Llama(CFG, rngs=nnx.Rngs(0))) == []  # high precision: nothing


def test_ptq_tensor_scale_is_named_token_is_not():
    rules = [ptq.Rule(path=MLP, scheme=ptq.scheme("nvfp4-mse"))]
    for how, n in (("tensor", 6), ("token", 0)):
        model = Llama(CFG, rngs=nnx.Rngs(0))
        ptq.quantize_model(model, rules, activation_scale=how)
        assert len(batch_scaled_ops(model)) == n, how


def test_default_warns_naming_the_op(requests):
    model = _qat_model()
    with pytest.warns(UserWarning, match=r"blocks/0/mlp/\w+_proj .*whole batch.*batch_scales='token'"):
        score_requests(model, requests[:1], batch_size=4)  # the [4, 16] programs the tests below run too


def test_error_refuses_before_anything_runs(requests):
    model = _qat_model()
    leaves = lambda: [np.asarray(x) for x in jax.tree_util.tree_leaves(nnx.state(model))]  # noqa: E731
    before = leaves()
    with pytest.raises(ValueError, match=r"6 quantized op\(s\) scale their activations over the whole batch.*"
                                         r"blocks/0/mlp/\w+_proj"):
        score_requests(model, requests, batch_scales="error")
    after = leaves()
    assert len(after) == len(before)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"batch_scales='tensor'; allowed: warn, error, token"):
        score_requests(model, requests, batch_scales="tensor")


def test_token_scores_do_not_depend_on_the_batch(requests):
    """Alone (a batch of 4 with 3 zero rows, padded to the request's own length bucket) and batched together: with
    ``batch_scales="token"`` equal to float32 rounding of the reductions; the model as it is (the control) moves by
    far more, so this test fails on code that scores the per-tensor activations as they are."""
    model = _qat_model()
    alone, batched = _alone_and_batched(model, requests)
    assert np.max(np.abs(batched - alone)) > 1e-2  # the control: the batch reaches each request's scores
    alone, batched = _alone_and_batched(model, requests, batch_scales="token")
    np.testing.assert_allclose(batched, alone, rtol=2e-6, atol=2e-5)
    assert all(op.recipe.activation.scaling.granularity == "tensor"  # the model itself keeps its recipes
               for _, op in nnx.iter_modules(model) if isinstance(getattr(op, "recipe", None), qat.Recipe))
    assert len(batch_scaled_ops(model)) == 6


def test_token_is_the_per_token_recipe(requests):
    """``batch_scales="token"`` scores what a model quantized with the per-token recipe
    (`jaxlowfp.harness.eval_recipe`) scores, and nothing warns."""
    from jaxlowfp.harness import eval_recipe

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = score_requests(_qat_model(), requests, batch_size=4, batch_scales="token")[0]
        want = score_requests(_qat_model(eval_recipe(qat.nvfp4_w4a4(), "token")), requests, batch_size=4)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def test_perplexity_and_choices_pass_it_on():
    import inspect

    for fn in (evaluation.perplexity, evaluation.score_choices):
        assert inspect.signature(fn).parameters["batch_scales"].default == "warn"


def test_qwix_ops_are_named_and_token_refuses_them():
    """The Qwix provider's NNX ops are found too; their recipe comes from the provider's rule at every call, so
    ``batch_scales="token"`` refuses them (naming them) rather than failing inside the provider."""
    import jax.numpy as jnp
    import qwix

    from jaxlowfp import qwix_provider

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(32, 32, rngs=rngs)

        def __call__(self, x):
            return self.up(x)

    provider = qwix_provider.RecipeProvider([qwix_provider.RecipeRule(module_path="up", recipe=qat.nvfp4_w4a4())])
    # Qwix's first call (which creates the provider's ops) under nnx.jit: eagerly it is ~50 one-op compilations
    model = qwix.quantize_model(MLP(nnx.Rngs(0)), provider, jnp.ones((2, 32), jnp.float32), skip_nnx_init=True)
    nnx.jit(lambda m, x: m(x))(model, jnp.ones((2, 32), jnp.float32))
    assert [p for p, _ in batch_scaled_ops(model)] == ["up/jaxlowfp_dot_general0"]
    with pytest.raises(ValueError, match=r"Qwix provider's ops \['up/jaxlowfp_dot_general0'\]"):
        execution.per_request_model(model, "token")


def _same_bucket_requests():
    """Four requests of 18..25 tokens: alone (3 zero rows) and together, one batch of 4 x 24 inputs, one program."""
    rng = np.random.default_rng(2)
    return [Request(tuple(int(t) for t in rng.integers(0, 256, n)), n_pred=n - 1) for n in (18, 20, 23, 25)]


def _trained(recipe, steps=2):
    """A QAT model after `steps` training steps (`jaxlowfp.training.make_step`: the gradients pass the quantized
    matmuls' custom_vjp, straight-through or quantized), as a module."""
    import jax.numpy as jnp
    import optax

    from jaxlowfp import training

    model = Llama(CFG, rngs=nnx.Rngs(0))
    qnnx.quantize_model(model, [qnnx.Rule(path=MLP, recipe=recipe)], rngs=nnx.Rngs(3))
    tx = optax.sgd(1e-2)
    graphdef, state = training.init(model, tx)
    step = jax.jit(training.make_step(graphdef, tx, lambda m, b: optax.softmax_cross_entropy_with_integer_labels(
        m(b[:, :-1]), b[:, 1:]).mean()))
    batch = jnp.asarray(np.random.default_rng(4).integers(0, 256, (2, 17)), jnp.int32)
    for _ in range(steps):
        state, metrics = step(state, batch)
        assert bool(metrics["finite"]) and not bool(metrics["skipped"])
    return nnx.merge(graphdef, state.params, state.qstate, state.rest, copy=True)


def test_token_scores_of_a_trained_qat_model_are_identical_alone_and_batched():
    """A ``qat.nvfp4_w4a4()`` model trained for two steps (its quantizers carry gradients: the STE custom_vjp) and
    scored with ``batch_scales="token"``: the same requests alone and batched give identical log-likelihoods (the
    same program: one padded length, 4 rows); as it is, the batch reaches them (the control)."""
    model = _trained(qat.nvfp4_w4a4())
    reqs = _same_bucket_requests()
    alone, batched = _alone_and_batched(model, reqs)
    assert np.max(np.abs(batched - alone)) > 1e-3  # the control
    alone, batched = _alone_and_batched(model, reqs, batch_scales="token")
    np.testing.assert_array_equal(batched, alone)


def test_token_replaces_an_empty_delayed_history():
    """``qat.fp8_delayed()`` before any step: its empty activation history makes the first estimate the batch's amax
    (`batch_scaled_ops` names it). ``batch_scales="token"`` used to fail ("state.history has shape (1024,), but
    CurrentScaling has history_len=1"): the copy that runs now gets a per-token activation state, the weight's
    history kept, and the model's own state is untouched; scores are identical alone and batched."""
    model = Llama(CFG, rngs=nnx.Rngs(0))
    qnnx.quantize_model(model, [qnnx.Rule(path=MLP, recipe=qat.fp8_delayed())])
    assert len(batch_scaled_ops(model)) == 6
    def leaves():  # parameters and amax histories (the execution records are written by design)
        return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(
            nnx.state(model)) if "record" not in jax.tree_util.keystr(k)}

    before = leaves()
    assert any("amax" in k and v.shape == (1024,) for k, v in before.items())
    alone, batched = _alone_and_batched(model, _same_bucket_requests(), batch_scales="token")
    np.testing.assert_array_equal(batched, alone)
    assert np.isfinite(alone).all()
    after = leaves()
    assert sorted(after) == sorted(before) and all(np.array_equal(after[k], before[k]) for k in before)
    assert len(batch_scaled_ops(model)) == 6  # the model keeps its recipes and its (empty) histories


def test_expert_ops_with_empty_delayed_histories_are_named_and_rescaled():
    """A mixture-of-experts op keeps one delayed history per expert (count [E]): `batch_scaled_ops` missed them
    (``int()`` of an [E] count raised and was taken for "no history"), so a fresh model's scores moved with the
    batch (by 0.4 nats on the Qwen3-MoE fixture) without a word. Now they are named, and ``batch_scales="token"``
    rescales them (the per-token state keeps the expert axis): identical alone and batched."""
    from pathlib import Path

    from jaxlowfp.models import load

    model, _ = load(Path(__file__).parent / "fixtures" / "moe" / "qwen3_moe")
    recipe = dataclasses.replace(qat.fp8_delayed(), grad=None, name="fp8_delayed_ste")  # experts: STE backward only
    qnnx.quantize_model(model, [qnnx.Rule(path=r"blocks/\d+/mlp/experts/(gate|up|down)_proj", recipe=recipe)])
    found = batch_scaled_ops(model)
    assert sorted(p for p, _ in found) == sorted(f"blocks/{i}/mlp/experts/quant_{n}_proj" for i in range(2)
                                                 for n in ("gate", "up", "down"))
    assert all("empty amax history" in why for _, why in found)
    rng = np.random.default_rng(2)
    reqs = [Request(tuple(int(t) for t in rng.integers(0, 280, n)), n_pred=n - 1) for n in (18, 20, 23, 25)]
    alone, batched = _alone_and_batched(model, reqs)
    assert np.max(np.abs(batched - alone)) > 1e-2  # the control
    alone, batched = _alone_and_batched(model, reqs, batch_scales="token")
    np.testing.assert_array_equal(batched, alone)
