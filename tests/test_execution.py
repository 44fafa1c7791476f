"""What runs is what is reported (issue 32): layers quantized on paper whose op never runs are named, and quantized
scores do not depend on the batch they are computed in."""
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn
import qwix
from flax import nnx

import jaxlowfp
from jaxlowfp import execution, ptq, qat, qlinen, qnnx, qwix_provider
from jaxlowfp.evaluation import Request, _bucket, score_requests
from jaxlowfp.models.llama import PRESETS, Llama


class DirectRead(nnx.Module):
    """canvit-nnx's pattern: the attention projection's kernel is read directly, the layer is never called."""

    def __init__(self, rngs):
        self.qkv = nnx.Linear(32, 96, rngs=rngs)
        self.mlp = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, x):
        qkv = x @ self.qkv.kernel[...]
        return self.mlp(x) + qkv[..., :32]


def _x():
    return jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 32)), jnp.float32)


def test_qat_layer_read_directly_is_named():
    model = DirectRead(nnx.Rngs(0))
    report = qnnx.quantize_model(model, [qnnx.Rule(path=".*", recipe=qat.hif8_w8a8())])
    assert {p for p, _ in report.quantized} == {"qkv", "mlp"}  # configured: both
    assert set(report.not_executed()) == {"qkv", "mlp"} and "not executed yet" in str(report)
    with pytest.warns(RuntimeWarning, match="no quantized op of the model has executed yet"):
        report.check_executed()
    nnx.jit(lambda m, x: m(x))(model, _x())
    assert report.executed() == ("mlp",) and report.not_executed() == ("qkv",)
    assert re.search(r"qkv +quantized +hif8_w8a8 \(NOT executed", str(report))
    with pytest.warns(RuntimeWarning, match=r"\(qkv\): the model ran.*kernel is read directly"):
        assert report.check_executed() == ("qkv",)
    with pytest.raises(RuntimeError, match="qkv"):
        report.check_executed(strict=True)
    with pytest.raises(RuntimeError, match=r"qkv \(hif8_w8a8\)"):  # the model-level view says the same
        execution.check_executed(model, strict=True)


def test_ptq_layer_read_directly_is_named():
    model = DirectRead(nnx.Rngs(0))
    res = ptq.quantize_model(model, [ptq.Rule(path=".*", scheme=ptq.scheme("nvfp4-mse"))], activation_scale="token")
    model(_x())  # eager: the ops trace (run) here too
    assert res.report.not_executed() == ("qkv",)
    with pytest.raises(RuntimeError,
                       match=r"qkv \(PTQ nvfp4-mse: weights quantized, activation quantization never ran"):
        execution.check_executed(model, strict=True)


class LinenDirectRead(nn.Module):
    """The same pattern in Flax Linen: `qkv` is called while initializing (so its params exist) and read directly
    by `apply`."""

    dot_general_cls: object = None

    def setup(self):
        self.qkv = nn.Dense(96, dot_general_cls=self.dot_general_cls)
        self.mlp = nn.Dense(32, dot_general_cls=self.dot_general_cls)

    def __call__(self, x):
        if self.is_initializing():
            self.qkv(x)
        qkv = x @ self.qkv.variables["params"]["kernel"]
        return self.mlp(x) + qkv[..., :32]


@pytest.mark.parametrize("via", ["qlinen", "qwix_provider"])
def test_linen_layer_read_directly_is_named(via):
    if via == "qlinen":
        model = LinenDirectRead(dot_general_cls=qlinen.quant_dot_general_cls(qat.hif8_w8a8()))
    else:
        provider = qwix_provider.RecipeProvider(
            [qwix_provider.RecipeRule(module_path="qkv|mlp", recipe=qat.hif8_w8a8())])
        model = qwix.quantize_model(LinenDirectRead(), provider)
    variables = jax.jit(model.init)(jax.random.key(0), _x())  # one program (eagerly: 140-180 one-op compiles)
    ops = execution.quantized_ops(variables)
    names = {op.path.split("/")[0] for op in ops}
    assert names == {"qkv", "mlp"} and not any(op.executed for op in ops)  # init does not count
    with pytest.warns(RuntimeWarning, match="no quantized op of the model has executed yet"):
        execution.check_executed(variables, warn_once=False)
    _, upd = jax.jit(lambda v, x: model.apply(v, x, mutable=[qlinen.AMAX_COLLECTION]))(variables, _x())
    variables = {**variables, **upd}  # the records are state of the ops' collection: merged back like the histories
    with pytest.warns(RuntimeWarning, match=r"qkv.*the model ran.*kernel is read directly"):
        missing = execution.check_executed(variables, warn_once=False)
    assert [m.split("/")[0] for m in missing] == ["qkv"]
    with pytest.raises(RuntimeError, match="qkv"):
        execution.check_executed(variables, strict=True)


def test_training_step_warns_at_trace_time():
    from jaxlowfp import training
    import optax

    model = DirectRead(nnx.Rngs(0))
    qnnx.quantize_model(model, [qnnx.Rule(path=".*", recipe=qat.hif8_w8a8())])
    graphdef, state = training.init(model, optax.sgd(1e-3))
    step = training.make_step(graphdef, optax.sgd(1e-3), lambda m, b: (jnp.mean(m(b) ** 2), {}))
    with pytest.warns(RuntimeWarning, match="qkv"):
        step(state, _x())


# --- batch independence -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def requests():
    rng = np.random.default_rng(1)
    # two length buckets (`_bucket`: 16 and 64), each one compiled program per batch shape: three requests share the
    # batch's [8, 64] program when alone, two run a shorter one
    return [Request(tuple(int(t) for t in rng.integers(0, 256, n)), n_pred=n - 1) for n in (9, 14, 58, 61, 64)]


def _quantized(how):
    """The tiny Llama, its attention and MLP projections quantized to NVFP4 4/6: PTQ (RTN) with the activation
    scale `how` ("token", "static", "tensor") or the lm-eval backend's fake quantization ("qat-token")."""
    model = Llama(PRESETS["tiny"], rngs=nnx.Rngs(0))
    if how == "qat-token":
        from jaxlowfp import harness

        harness.fake_quantize_model(model, "nvfp4", layers="all", act_scale="token")
        return model
    calib = np.random.default_rng(2).integers(0, 256, (4, 32))
    rules = [ptq.Rule(path=r"blocks/\d+/(attn|mlp)/\w+_proj", scheme=ptq.scheme("nvfp4-mse"))]
    res = ptq.quantize_model(model, rules, calibration=calib if how == "static" else None, activation_scale=how)
    assert res.activation_scale == how
    return model


def _alone_and_batched(model, requests, alone_batch=8):
    alone = np.array([score_requests(model, [r], batch_size=alone_batch)[0][0] for r in requests])
    return alone, score_requests(model, requests, batch_size=8)[0]


@pytest.mark.parametrize("how", ["token", "static", "qat-token"])
def test_scores_do_not_depend_on_the_batch(requests, how):
    """Each request scored alone (its batch of 8 filled with zero rows) and with the others in one padded batch of
    8: the activations get their amax per token or from calibration, so no other row and no padding reaches a
    request's scales. A request padded to the batch's length alone runs the same [8, 64] program: bit for bit the
    same log-likelihood; the shorter ones alone are padded less (`jaxlowfp.evaluation._bucket`), another program:
    equal to float32 rounding of the reductions (the control below moves by more than 1e-3)."""
    alone, batched = _alone_and_batched(_quantized(how), requests)
    longest = _bucket(max(len(r.tokens) for r in requests) - 1)
    same = [i for i, r in enumerate(requests) if _bucket(len(r.tokens) - 1) == longest]
    assert same
    np.testing.assert_array_equal(batched[same], alone[same])
    np.testing.assert_allclose(batched, alone, rtol=2e-6, atol=2e-5)


def test_scores_alone_in_a_batch_of_one(requests):
    """batch_size=1 is another XLA program ([1, 64]): equal to float32 rounding of the reductions."""
    model = _quantized("token")
    alone, batched = _alone_and_batched(model, requests, alone_batch=1)
    np.testing.assert_allclose(batched, alone, rtol=2e-6, atol=2e-5)


def test_per_tensor_scores_do_depend_on_the_batch(requests):
    """The control: with the batch's amax ("tensor", the paper's PTQ setting) the same comparison moves by much
    more than float32 rounding, so the test above can fail."""
    alone, batched = _alone_and_batched(_quantized("tensor"), requests)
    assert np.max(np.abs(batched - alone)) > 1e-3


def test_per_token_quantizer_equals_each_row_alone():
    """The per-token quantizer on a [rows, K] batch equals quantizing every row by itself, bit for bit, under jit
    (the same elementwise program per row; max reductions are exact)."""
    x = jnp.asarray(np.random.default_rng(3).standard_normal((6, 64)) * np.geomspace(1e-3, 1e3, 6)[:, None],
                    jnp.float32)
    for fmt in ("nvfp4-mse", "hif8"):
        spec = ptq.activation_spec(jaxlowfp.Format.parse(fmt), "token")
        f = jax.jit(lambda v: qat.fake_quant(v, spec.init(), spec)[0])
        whole = np.asarray(f(x))
        rows = np.concatenate([np.asarray(f(x[i:i + 1])) for i in range(x.shape[0])])
        np.testing.assert_array_equal(whole.view(np.uint32), rows.view(np.uint32))
        per_tensor = ptq.activation_spec(jaxlowfp.Format.parse(fmt), "tensor")
        assert not np.array_equal(whole, np.asarray(jax.jit(lambda v: qat.fake_quant(  # one program, not op by op
            v, per_tensor.init(), per_tensor)[0])(x)))


def test_static_scale_is_the_calibrated_amax():
    """activation_scale='static': the layer's input is quantized with the calibration amax (nvfp4.fake_quantize with
    that global amax, the quantizer the export's input_global_scale stands for), whatever the batch holds."""
    model = _quantized("static")
    hook = model.blocks[1].mlp.down_proj.dot_general
    assert hook.activation_scale == "static" and hook.amax > 0
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 192)), jnp.float32)
    from jaxlowfp import nvfp4

    want = (nvfp4.fake_quantize(x, rule="mse", global_amax=jnp.float32(hook.amax))
            @ model.blocks[1].mlp.down_proj.kernel[...])
    got = hook(x, model.blocks[1].mlp.down_proj.kernel[...], (((1,), (0,)), ((), ())))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bad_activation_scale():
    model = Llama(PRESETS["tiny"], rngs=nnx.Rngs(0))
    rules = [ptq.Rule(path=r"blocks/1/mlp/up_proj", scheme=ptq.scheme("nvfp4-mse"))]
    with pytest.raises(ValueError, match="activation_scale='static' takes each layer's calibrated input amax"):
        ptq.quantize_model(model, rules, activation_scale="static")
    with pytest.raises(ValueError, match="activation_scale='batch' is not supported; allowed: 'auto', 'tensor'"):
        ptq.quantize_model(model, rules, activation_scale="batch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ptq.quantize_model(model, rules).activation_scale == "token"  # auto without calibration
