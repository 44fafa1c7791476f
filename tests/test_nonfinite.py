"""One non-finite policy for every format and path: NaN/+-Inf elements of a quantized tensor come out unchanged (as
high precision would carry them), are counted (QuantStats.nonfinite_count, the train metric nonfinite_quantized),
and a step that saw one is skipped, so nothing non-finite reaches the state or a checkpoint. Counters refuse
tensors they cannot count (>= 2**31 elements)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxlowfp import qnnx
from jaxlowfp import qat, training
from jaxlowfp.dispatch import INTERPRET_ENV
from jaxlowfp.qat import QuantSpec
from jaxlowfp.scaling import CurrentScaling, DelayedScaling
from train.checkpoint import Checkpointer, nonfinite_leaves

SPECIALS = {3: np.inf, 10: np.nan, 17: -np.inf}  # positions in a 48-element tensor (NVFP4 blocks 0 and 1)


def poisoned(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(x with NaN/+-Inf at SPECIALS, the same x with 0 there)."""
    x = (np.random.default_rng(seed).standard_normal(48) * 3).astype(np.float32)
    clean = x.copy()
    for i, v in SPECIALS.items():
        x[i], clean[i] = v, 0.0
    return x, clean


def delayed(fmt: str, target: float, **kw) -> QuantSpec:
    return QuantSpec(format=fmt, scaling=DelayedScaling(target_max=target, **kw))


SPECS = {
    "hif8_delayed": delayed("hif8", 15.0),
    "hif8_current": QuantSpec(format="hif8"),
    "e4m3_delayed": delayed("e4m3", 448.0),
    "e5m2_current": QuantSpec(format="e5m2"),
    "e4m3_te": QuantSpec(format="e4m3", clip="format", scaling=DelayedScaling(target_max=448.0, convention="te")),
    "e5m2_flax": QuantSpec(format="e5m2", clip="format",
                           scaling=DelayedScaling(target_max=57344.0, convention="flax")),
    "nvfp4_current": QuantSpec(format="nvfp4", rule="static_6"),
    "nvfp4_delayed": QuantSpec(format="nvfp4", rule="mse", scaling=DelayedScaling(target_max=6.0)),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_nonfinite_elements_pass_through_unchanged_and_are_counted(name):
    spec = SPECS[name]
    x, clean = poisoned()
    state = spec.scaling.update(spec.init(), jnp.float32(np.max(np.abs(clean))))  # a finite history
    fq = jax.jit(lambda a, s: qat.fake_quant(a, s, spec))
    y, new_state, stats = fq(x, state)
    y = np.asarray(y)
    idx = list(SPECIALS)
    np.testing.assert_array_equal(y[idx].view(np.uint32), x[idx].view(np.uint32))  # the very bits, NaN included
    assert int(stats.nonfinite_count) == 3
    assert int(new_state.nonfinite) == 1  # the non-finite amax is counted in the state as well
    if isinstance(spec.scaling, DelayedScaling):  # the scale came from the history: the rest is unaffected
        y_clean, _, _ = fq(clean, state)
        # ... except, for NVFP4, the other elements of a 16-block holding a NaN/Inf (its block scale is NaN)
        finite = np.isfinite(x) if not spec.is_nvfp4 else np.arange(48) >= 32
        np.testing.assert_array_equal(y[finite], np.asarray(y_clean)[finite])


def test_hif8_example_from_the_issue():
    """``[1, inf, -2]`` used to come out as ``[1, 4, -2]`` (the Inf clipped at scale 0.27): now the Inf stays."""
    spec = delayed("hif8", 15.0)
    state = spec.scaling.update(spec.init(), jnp.float32(4.0))  # scale 4 / 15 = 0.27
    y, _, stats = jax.jit(qat.fake_quant, static_argnums=2)(jnp.asarray([1.0, np.inf, -2.0]), state, spec)
    assert np.isposinf(np.asarray(y)[1]) and int(stats.nonfinite_count) == 1
    assert np.isfinite(np.asarray(y)[[0, 2]]).all()


def test_pallas_kernel_path_applies_the_policy_after_the_kernel(monkeypatch):
    """impl="pallas" (interpret mode on CPU): the kernel is unchanged; the pass-through happens after it, so the
    result, stats and state equal the jnp path bit for bit."""
    monkeypatch.setenv(INTERPRET_ENV, "1")
    x, clean = poisoned(1)
    base = delayed("hif8", 15.0)
    state = base.scaling.update(base.init(), jnp.float32(np.max(np.abs(clean))))
    fq = jax.jit(qat.fake_quant, static_argnums=2)  # one compilation each, not one per eager op
    got = fq(x, state, dataclasses.replace(base, impl="pallas"))
    want = fq(x, state, dataclasses.replace(base, impl="xla"))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert np.isposinf(np.asarray(got[0])[3]) and np.isnan(np.asarray(got[0])[10])


def test_matmul_propagates_nonfinite_operands_and_gradients():
    """An Inf in the activation reaches its output row; an Inf in the output gradient reaches its dgrad row
    through the gradient quantizer (which used to clip it)."""
    r = dataclasses.replace(qat.hif8_w8a8(), grad=QuantSpec(format="hif8", scaling=CurrentScaling(target_max=224.0)))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    w = (rng.standard_normal((16, 4)) * 0.1).astype(np.float32)
    g = rng.standard_normal((8, 4)).astype(np.float32)
    x[2, 5], g[6, 1] = np.inf, np.inf
    state = r.init()

    def f(a, b):
        out, _, stats = qat.linear(a, b, recipe=r, state=state)
        return out, stats

    @jax.jit
    def run(a, b, cot):
        out, vjp, stats = jax.vjp(f, a, b, has_aux=True)
        return out, vjp(cot)[0], stats

    out, dx, stats = run(x, w, g)
    out, dx = np.asarray(out), np.asarray(dx)
    assert not np.isfinite(out[2]).any() and np.isfinite(np.delete(out, 2, 0)).all()
    assert not np.isfinite(dx[6]).any() and np.isfinite(np.delete(dx, 6, 0)).all()
    assert int(stats.activation.nonfinite_count) == 1 and int(stats.weight.nonfinite_count) == 0


class Net(nnx.Module):
    def __init__(self, rngs):
        self.up_proj = nnx.Linear(16, 32, rngs=rngs)
        self.down_proj = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jnp.tanh(self.up_proj(x)))


def _loss(m, batch):
    # tanh saturates: an Inf reaching down_proj's input would leave the loss finite, so only the count can tell
    return jnp.mean(jnp.tanh(m(batch["x"])) * batch["t"]), {}


@pytest.mark.parametrize("microbatches", [1, 2])
def test_hif8_qat_step_with_an_inf_activation_is_skipped_and_counted(tmp_path, microbatches):
    model = Net(nnx.Rngs(0))
    qnnx.quantize_model(model, [qnnx.Rule(path="up_proj|down_proj", recipe=qat.hif8_w8a8())])
    tx = optax.adam(1e-2)
    graphdef, state = training.init(model, tx)
    step = jax.jit(training.make_step(graphdef, tx, _loss, microbatches=microbatches))
    rng = np.random.default_rng(3)
    batch = lambda: {"x": rng.standard_normal((4, 16)).astype(np.float32),  # noqa: E731
                     "t": rng.standard_normal((4, 16)).astype(np.float32)}
    state, m = step(state, batch())
    assert bool(m["finite"]) and int(m["nonfinite_quantized"]) == 0
    bad = batch()
    bad["x"][1, 7] = np.inf
    before = state
    state, m = step(state, bad)
    assert not bool(m["finite"]) and int(m["skipped"]) == 1
    assert int(m["nonfinite_quantized"]) >= 1  # the Inf input of up_proj (and what it made of down_proj's input)
    for new, old in zip(jax.tree.leaves((state.params, state.qstate, state.opt_state)),
                        jax.tree.leaves((before.params, before.qstate, before.opt_state))):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))  # nothing of the step was kept
    assert nonfinite_leaves(state) == []
    state, m = step(state, batch())  # training goes on
    assert bool(m["finite"]) and int(state.step) == 3 and int(state.skipped) == 1
    if microbatches == 1:  # the state after a skip is the state before it, whatever the microbatches (above)
        return
    with Checkpointer(tmp_path / "ckpt") as ckpt:  # refuses non-finite params; there are none
        ckpt.save(3, state)
        restored, _ = ckpt.restore(state)
    assert nonfinite_leaves(restored) == []


@pytest.mark.parametrize("what", ["fake_quant", "scaled_round", "dot_general", "nvfp4"])
def test_counters_refuse_tensors_of_2_31_elements(what):
    """int32 counters (sums over the tensor) would wrap at 2**31 elements: refused at trace time, nothing
    allocated (abstract shapes)."""
    big = jax.ShapeDtypeStruct((2**16, 2**15), jnp.float32)
    spec = delayed("hif8", 15.0)
    if what == "fake_quant":
        fn, args = (lambda x: qat.fake_quant(x, spec.init(), spec)), (big,)
    elif what == "scaled_round":
        fn, args = (lambda x: qat.scaled_round(x, jnp.float32(1.0), 15.0, "hif8")), (big,)
    elif what == "nvfp4":
        nv = QuantSpec(format="nvfp4", rule="static_6")
        fn, args = (lambda x: qat.fake_quant(x, nv.init(), nv)), (big,)
    else:  # operands far below the limit, but the output gradient the backward quantizes is at it
        r = dataclasses.replace(qat.hif8_w8a8(), grad=QuantSpec(format="hif8", scaling=CurrentScaling(
            target_max=224.0)))
        a, b = jax.ShapeDtypeStruct((2**16, 8), jnp.float32), jax.ShapeDtypeStruct((8, 2**15), jnp.float32)
        fn, args = (lambda x, w: qat.linear(x, w, recipe=r, state=r.init())[0]), (a, b)
        jax.eval_shape(lambda x, w: qat.linear(x, w, recipe=qat.hif8_w8a8(), state=qat.hif8_w8a8().init())[0],
                       a, b)  # without gradient quantization the output is never counted: fine
    with pytest.raises(ValueError, match=r"2147483648 elements.*2\*\*31 - 1"):
        jax.eval_shape(fn, *args)
    if what == "fake_quant":
        jax.eval_shape(fn, jax.ShapeDtypeStruct((2**31 - 1,), jnp.float32))  # the largest countable tensor
