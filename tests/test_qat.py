"""jaxlowfp.qat: fake-quant against independent casts (en_dtypes, ml_dtypes), STE gradients, telemetry, recipes,
quantized matmuls (forward, backward, gradient quantization, NVFP4 re-quantization), warmup."""
import dataclasses

import chex
import en_dtypes
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax import lax

import jaxlowfp
from jaxlowfp import nvfp4, qat, scaling
from jaxlowfp.qat import QuantSpec, Recipe
from jaxlowfp.scaling import CurrentScaling, DelayedScaling

CAST = {"hif8": en_dtypes.hifloat8, "e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
FMT_MAX = {"hif8": 32768.0, "e4m3": 448.0, "e5m2": 57344.0}
NP_DTYPE = {jnp.float32: np.float32, jnp.bfloat16: ml_dtypes.bfloat16, jnp.float16: np.float16}
LINEAR = (((1,), (0,)), ((), ()))


def ref_scaled_round(x, scale, clip, fmt):
    """Independent numpy float32 reference of the fixed form, rounding by the oracle casts."""
    x = np.asarray(x)
    scale = np.float32(scale)
    xs = x.astype(np.float32) * (np.float32(1.0) / scale)
    q = np.clip(xs, -clip, clip).astype(CAST[fmt]).astype(np.float32)
    with np.errstate(over="ignore"):  # float16 overflows to Inf, as the code under test does
        y = (q * scale).astype(x.dtype)
    return y, int(np.sum(np.abs(xs) > clip))


def bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def heavy_tailed(seed, shape, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, shape).astype(np.float32) * 3.0
    return jnp.asarray(x).astype(dtype)


def ref_quantize_current(x, spec):
    """Per-tensor current-scaling quantization of a numpy array, written from the spec."""
    amax = np.float32(np.max(np.abs(np.asarray(x, np.float32))))
    scale = amax / np.float32(spec.scaling.target_max) if amax > 0 else np.float32(1)
    return ref_scaled_round(x, scale, spec.clip_bound, spec.format)[0]


# ---------------------------------------------------------------------------------------------------------------
# scaled_round and fake_quant values


@pytest.mark.parametrize("fmt", ["hif8", "e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_scaled_round_matches_oracle_casts_under_jit(fmt, dtype):
    x = heavy_tailed(0, (2048,), dtype)
    specials = jnp.array([0.0, -0.0, 1e-7, -3e-6, 60.0, -1000.0, np.nan, np.inf, -np.inf], dtype)
    x = jnp.concatenate([x, specials])
    for est, clip in ((17.3, 15.0), (50.0, FMT_MAX[fmt]), (0.37, 15.0)):
        scale = np.float32(est) / np.float32(15.0)
        y, n_sat = jax.jit(qat.scaled_round, static_argnums=(2, 3))(x, jnp.float32(scale), clip, fmt)
        y_ref, n_ref = ref_scaled_round(x, scale, clip, fmt)
        assert y.dtype == x.dtype
        np.testing.assert_array_equal(bits(y), bits(y_ref))
        assert int(n_sat) == n_ref
        y_eager, _ = qat.scaled_round(x, jnp.float32(scale), clip, fmt)
        np.testing.assert_array_equal(bits(y_eager), bits(y_ref))


def test_fake_quant_uses_delayed_estimate_and_records_after_use():
    spec = QuantSpec(format="hif8", scaling=DelayedScaling(algorithm="max_window", history_len=4, target_max=15.0))
    st = spec.init()
    x0 = heavy_tailed(1, (512,))
    y0, st, s0 = jax.jit(qat.fake_quant, static_argnums=2)(x0, st, spec)
    amax0 = np.float32(np.max(np.abs(np.asarray(x0))))
    assert float(s0.amax) == float(s0.amax_estimate) == amax0  # first step: falls back to its own amax
    x1 = x0 * 3.0
    y1, st, s1 = jax.jit(qat.fake_quant, static_argnums=2)(x1, st, spec)
    scale = amax0 / np.float32(15.0)  # the scale comes from step 0, not from x1
    assert float(s1.scale) == scale and float(s1.amax_estimate) == amax0
    y_ref, n_sat = ref_scaled_round(x1, scale, 15.0, "hif8")
    np.testing.assert_array_equal(bits(y1), bits(y_ref))
    assert float(s1.saturated_fraction) == np.float32(n_sat) / np.float32(512) and n_sat > 0
    assert int(st.count) == 2 and float(st.history[1]) == float(3.0 * amax0)


def test_saturated_and_underflow_fractions_equal_hand_count():
    # est 30 -> scale 30 / 15 = 2 exactly. |x| / 2 > 15 for 31, -40, 1e3 and +Inf (NaN is not counted): 4 of 12.
    # Nonzero values that round to 0: 1e-7 / 2 = 5e-8 < 2^-23 (HiF8's smallest nonzero result is 2^-22): 2 of 12.
    x = jnp.array([31.0, -40.0, 1e3, np.inf, np.nan, 30.0, -30.0, 0.0, 1e-7, -1e-7, 1.0, 2.5], jnp.float32)
    spec = QuantSpec(format="hif8", scaling=DelayedScaling(target_max=15.0))
    st = spec.scaling.update(spec.init(), jnp.float32(30.0))
    fq = jax.jit(qat.fake_quant, static_argnums=2)
    y, st2, stats = fq(x, st, spec)
    assert float(stats.scale) == 2.0
    assert float(stats.saturated_fraction) == np.float32(4) / np.float32(12)
    assert float(stats.underflow_fraction) == np.float32(2) / np.float32(12)
    assert int(stats.nonfinite_count) == 2
    assert np.isnan(float(stats.amax))
    np.testing.assert_array_equal(np.asarray(y)[[0, 1, 2, 5, 6]], [30.0, -30.0, 30.0, 30.0, -30.0])
    assert np.isposinf(np.asarray(y)[3]) and np.isnan(np.asarray(y)[4])  # non-finite elements pass through
    # The NaN amax is counted, not recorded.
    assert int(st2.nonfinite) == 1 and int(st2.count) == 1
    # clip="format": clipped at 32768 instead, so only +Inf saturates.
    fspec = dataclasses.replace(spec, clip="format")
    _, _, fstats = fq(x, st, fspec)
    assert float(fstats.saturated_fraction) == np.float32(1) / np.float32(12)


def test_gradient_is_identity_or_clip_mask():
    x = jnp.array([-40.0, -15.5, -2.0, 0.0, 3.0, 14.0, 16.0, 100.0], jnp.float32)
    st = DelayedScaling(target_max=15.0).update(DelayedScaling(target_max=15.0).init(), jnp.float32(15.0))
    ident = QuantSpec(format="hif8", scaling=DelayedScaling(target_max=15.0))
    masked = dataclasses.replace(ident, ste="masked")
    ct = jnp.arange(1.0, 9.0, dtype=jnp.float32)

    def grad(spec, obs=False):
        return jax.grad(lambda v: jnp.sum(qat.fake_quant(v, st, spec, observe_only=obs)[0] * ct))(x)

    np.testing.assert_array_equal(np.asarray(grad(ident)), np.asarray(ct))
    np.testing.assert_array_equal(np.asarray(jax.jit(grad, static_argnums=0)(masked)), [0, 0, 3, 4, 5, 6, 0, 0])
    # While observing, nothing is clipped, so the masked STE passes everything.
    np.testing.assert_array_equal(np.asarray(grad(masked, True)), np.asarray(ct))
    np.testing.assert_array_equal(np.asarray(grad(masked, jnp.bool_(True))), np.asarray(ct))
    np.testing.assert_array_equal(np.asarray(grad(masked, jnp.bool_(False))), [0, 0, 3, 4, 5, 6, 0, 0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_observe_only_is_bitwise_identity_and_still_updates(dtype):
    x = heavy_tailed(2, (300,), dtype)
    raw = np.asarray(x).copy()
    raw[[3, 7]] = np.array([np.nan, -np.nan], NP_DTYPE[dtype])
    x = jnp.asarray(raw)
    spec = qat.hif8_w8a8().activation
    st = spec.init()
    f = jax.jit(qat.fake_quant, static_argnums=2)
    for obs in (True, jnp.bool_(True)):
        y, st2, stats = (qat.fake_quant(x, st, spec, observe_only=True) if obs is True
                         else f(x, st, spec, observe_only=obs))
        np.testing.assert_array_equal(bits(y), bits(x))
        assert int(st2.nonfinite) == 1  # the NaN amax was seen (and not recorded)
        assert int(stats.nonfinite_count) == 2
    y, _, _ = f(x * 0 + 1, st, spec, observe_only=jnp.bool_(False))
    assert y.dtype == dtype


def test_bad_fake_quant_inputs_raise():
    spec = QuantSpec()
    st = spec.init()
    with pytest.raises(TypeError, match="float64"):
        qat.fake_quant(np.ones(3), st, spec)
    with pytest.raises(TypeError, match="observe_only"):
        qat.fake_quant(jnp.ones(3), st, spec, observe_only=jnp.int32(1))
    with pytest.raises(TypeError, match="QuantSpec"):
        qat.fake_quant(jnp.ones(3), st, qat.hif8_w8a8())
    with pytest.raises(ValueError, match="empty"):
        qat.fake_quant(jnp.ones((0,)), st, spec)
    with pytest.raises(ValueError, match="history_len"):
        qat.fake_quant(jnp.ones(3), DelayedScaling(target_max=15.0).init(), spec)
    with pytest.raises(ValueError, match="clip"):
        qat.scaled_round(jnp.ones(3), jnp.float32(1.0), 500.0, "e4m3")
    with pytest.raises(TypeError, match="scale"):
        qat.scaled_round(jnp.ones(3), jnp.ones(2), 15.0, "hif8")


# ---------------------------------------------------------------------------------------------------------------
# jit, vmap, scan, retracing


def test_vmap_over_tensors_and_no_retrace():
    spec = qat.hif8_w8a8(history_len=8).activation
    xs = heavy_tailed(3, (3, 64))
    states = jax.vmap(lambda _: spec.init())(jnp.arange(3))
    ys, new, stats = jax.jit(jax.vmap(lambda x, s: qat.fake_quant(x, s, spec)))(xs, states)
    one = jax.jit(lambda x: qat.fake_quant(x, spec.init(), spec))
    for i in range(3):
        y_i, s_i, _ = one(xs[i])
        np.testing.assert_array_equal(np.asarray(ys[i]), np.asarray(y_i))
        chex.assert_trees_all_equal(jax.tree.map(lambda a: a[i], new), s_i)

    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(x, st, obs):
        return qat.fake_quant(x, st, spec, observe_only=obs)

    st = spec.init()
    for t in range(4):
        _, st, _ = step(xs[0] * (t + 1.0), st, jnp.asarray(t < 2))
    assert int(st.count) == 4


def test_scan_over_microbatches_with_merge():
    """Each microbatch quantizes with the step's state; merged, the history equals one step over the batch.

    The amax history and counters are maxima and integers: bitwise. The EMA leaf is float arithmetic (a * ema +
    (1 - a) * amax) in two different XLA programs (a scan over vmapped microbatches, and single steps), whose
    multiply-adds the compiler may contract differently (it did at LLVM -O0: 1 ulp): within float32 rounding."""
    spec = qat.hif8_w8a8(history_len=4).activation
    micro = heavy_tailed(4, (5, 3, 32))  # 5 steps x 3 microbatches

    def step(st, xs):
        _, states, stats = jax.vmap(lambda x: qat.fake_quant(x, st, spec))(xs)
        return scaling.merge(states), stats.saturated_fraction

    merged, _ = jax.jit(lambda s, m: lax.scan(step, s, m))(spec.init(), micro)
    big, one = spec.init(), jax.jit(qat.fake_quant, static_argnums=2)
    for t in range(5):
        _, big, _ = one(micro[t].reshape(-1), big, spec)
    chex.assert_trees_all_equal(merged._replace(ema=big.ema), big)
    np.testing.assert_allclose(np.asarray(merged.ema), np.asarray(big.ema), rtol=2e-7)


def test_most_recent_saturates_where_max_window_does_not():
    """The Max-Window paper's mechanism on synthetic data: the amax grows irregularly during an observe-only
    warmup, then moves up and down below that peak. most_recent clips on every rise; max_window (64) never does."""
    rng = np.random.default_rng(7)
    warm, steps = 40, 100
    grow = 1.0 + np.cumsum(rng.uniform(0.0, 0.25, warm))  # irregular growth, ~1 -> ~6
    later = grow.max() * rng.uniform(0.55, 0.97, steps - warm)  # non-monotonic, below the peak
    amax = np.concatenate([grow, later]).astype(np.float32)
    z = rng.standard_normal((steps, 1024)).astype(np.float32)
    x = jnp.asarray(z / np.abs(z).max(axis=1, keepdims=True) * amax[:, None])
    warmup = qat.Warmup(steps=warm)

    def run(algorithm):
        spec = qat.hif8_w8a8(algorithm=algorithm).activation

        def body(st, inp):
            t, xt = inp
            _, st, stats = qat.fake_quant(xt, st, spec, observe_only=warmup.observe_only(t))
            return st, stats.saturated_fraction

        _, sat = jax.jit(lambda x: lax.scan(body, spec.init(), (jnp.arange(steps), x)))(x)
        return np.asarray(sat)[warm:]

    sat_recent, sat_window = run("most_recent"), run("max_window")
    rises = np.sum(later[1:] > later[:-1])
    assert np.count_nonzero(sat_recent) >= rises > 10  # every rise clips (and steps right after the warmup)
    assert sat_recent.max() > 0.001
    assert np.all(sat_window == 0.0)


# ---------------------------------------------------------------------------------------------------------------
# Configuration


def test_presets():
    r = qat.hif8_w8a8()
    assert r.grad is None and r.weight == r.activation and r.name == "hif8_w8a8"
    s = r.activation
    assert (s.format, s.clip, s.ste, s.target_max, s.clip_bound) == ("hif8", "target", "identity", 15.0, 15.0)
    assert s.scaling == DelayedScaling(algorithm="max_window", history_len=64, target_max=15.0, margin=0.0)
    t = qat.nvfp4_training()
    assert t.weight.block_shape == (16, 16) and t.activation.block_shape == (1, 16)
    assert t.grad.rounding == "stochastic" and t.grad.hadamard and t.grad.rule == "mse"
    assert qat.nvfp4_w4a4(rule="static_6").weight.rule == "static_6"
    assert hash(qat.hif8_w8a8()) == hash(r)  # static, so jit caches on it
    st = r.init()
    assert isinstance(st, qat.RecipeState) and st.weight.history.shape == (64,)


E4 = dict(format="e4m3")
CUR = CurrentScaling(target_max=15.0)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: QuantSpec(format="fp16"), ValueError, "format"),  # "fp8" is a jaxlowfp.Format name (E4M3) now
        (lambda: QuantSpec(clip="none"), ValueError, "clip"),
        (lambda: QuantSpec(ste="tanh"), ValueError, "ste"),
        (lambda: QuantSpec(target_max=40000.0), ValueError, "target_max"),
        (lambda: QuantSpec(**E4, scaling=DelayedScaling(target_max=500.0)), ValueError, "exceeds"),
        (lambda: QuantSpec(**E4, target_max=0.0), ValueError, "target_max"),
        (lambda: QuantSpec(scaling="delayed"), TypeError, "scaling"),
        (lambda: QuantSpec(rule="mse"), ValueError, "nvfp4"),
        (lambda: QuantSpec(block_shape=(1, 16)), ValueError, "nvfp4"),
        (lambda: QuantSpec(rounding="stochastic"), ValueError, "stochastic"),
        (lambda: QuantSpec(format="nvfp4", rule="best"), ValueError, "rule"),
        (lambda: QuantSpec(format="nvfp4", block_shape=(32, 1)), ValueError, "block_shape"),
        (lambda: QuantSpec(format="nvfp4", scaling=DelayedScaling(target_max=448.0)), ValueError, "6.0"),
        (lambda: QuantSpec(hadamard=1), TypeError, "hadamard"),
        (lambda: QuantSpec(15.0), TypeError, "positional"),
        (lambda: Recipe(), ValueError, "high precision"),
        (lambda: Recipe(grad=QuantSpec(format="nvfp4", scaling=DelayedScaling(target_max=6.0))), ValueError,
         "CurrentScaling"),
        (lambda: Recipe(grad=QuantSpec(scaling=DelayedScaling(target_max=15.0), hadamard=True)), ValueError,
         "Hadamard"),
        (lambda: QuantSpec(scaling=DelayedScaling(target_max=15.0, convention="te"), impl="pallas"), ValueError,
         "convention"),
        (lambda: qat.fp8_delayed(convention="jax"), ValueError, "convention"),
        (lambda: Recipe(weight=QuantSpec(hadamard=True)), ValueError, "hadamard"),
        (lambda: Recipe(weight="hif8"), TypeError, "QuantSpec"),
        (lambda: qat.hif8_w8a8(algorithm="median"), ValueError, "algorithm"),
        (lambda: qat.hif8_w8a8(history_len=0), ValueError, "history_len"),
        (lambda: qat.hif8_w8a8(target_max=1e6), ValueError, "exceeds"),
        (lambda: qat.nvfp4_training(rule="l3"), ValueError, "rule"),
        (lambda: qat.Warmup(steps=-1), ValueError, "steps"),
        (lambda: qat.Warmup(steps=2.5), TypeError, "steps"),
    ],
)
def test_bad_configuration_raises_at_construction(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


# ---------------------------------------------------------------------------------------------------------------
# Quantized matmul


def _operands(seed=5, n=32, k=48, m=16):
    x = heavy_tailed(seed, (n, k))
    w = heavy_tailed(seed + 1, (k, m)) * 0.1
    return x, w


def test_linear_forward_and_straight_through_backward():
    r = qat.hif8_w8a8(history_len=4)
    x, w = _operands()
    st = r.init()
    # Step 0 records amaxes; step 1 quantizes with them (delayed).
    lin = jax.jit(lambda a, b, s: qat.linear(a, b, recipe=r, state=s))
    _, st, _ = lin(x, w, st)
    x1, w1 = x * 1.5, w * 0.5
    out, st2, stats = lin(x1, w1, st)
    sx = np.float32(np.abs(np.asarray(x)).max()) / np.float32(15)
    sw = np.float32(np.abs(np.asarray(w)).max()) / np.float32(15)
    xq, _ = ref_scaled_round(x1, sx, 15.0, "hif8")
    wq, _ = ref_scaled_round(w1, sw, 15.0, "hif8")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(lax.dot_general(xq, wq, LINEAR)))
    assert float(stats.activation.scale) == sx and float(stats.weight.scale) == sw
    assert float(stats.activation.saturated_fraction) > 0 and float(stats.weight.saturated_fraction) == 0
    assert int(st2.activation.count) == 2 and int(st2.weight.count) == 2
    # STE: the gradient is that of a plain matmul of the quantized operands.
    g = heavy_tailed(9, out.shape)
    dx, dw = jax.jit(jax.grad(lambda a, b: jnp.sum(qat.linear(a, b, recipe=r, state=st)[0] * g),
                              argnums=(0, 1)))(x1, w1)
    _, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, LINEAR), jnp.asarray(xq), jnp.asarray(wq))
    rx, rw = vjp(g)
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(rx))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(rw))
    # Masked STE zeroes the rows of dx where x was clipped.
    masked = dataclasses.replace(r, activation=dataclasses.replace(r.activation, ste="masked"))
    dxm = jax.jit(jax.grad(lambda a: jnp.sum(qat.linear(a, w1, recipe=masked, state=st)[0] * g)))(x1)
    clipped = np.abs(np.asarray(x1, np.float32) * (np.float32(1) / sx)) > 15
    np.testing.assert_array_equal(np.asarray(dxm), np.where(clipped, 0, np.asarray(rx)))


def test_dot_general_with_batch_dims_per_tensor():
    r = qat.hif8_w8a8()
    a = heavy_tailed(11, (2, 8, 24))
    b = heavy_tailed(12, (2, 24, 4))
    dn = (((2,), (1,)), ((0,), (0,)))
    out, _, _ = jax.jit(lambda u, v: jaxlowfp.dot_general(u, v, dn, recipe=r, state=r.init(),
                                                      preferred_element_type=jnp.float32))(a, b)
    sa = np.float32(np.abs(np.asarray(a)).max()) / np.float32(15)
    sb = np.float32(np.abs(np.asarray(b)).max()) / np.float32(15)
    ref = lax.dot_general(ref_scaled_round(a, sa, 15.0, "hif8")[0], ref_scaled_round(b, sb, 15.0, "hif8")[0], dn)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    with pytest.raises(NotImplementedError, match="linear layout"):
        rn = qat.nvfp4_w4a4()
        jaxlowfp.dot_general(a, b, dn, recipe=rn, state=rn.init())


GRAD_HIF8 = QuantSpec(format="hif8", scaling=CurrentScaling(target_max=224.0))


def test_gradient_quantization_per_tensor():
    """dgrad = Q_g(g) . Q_w(w)^T and wgrad = Q_a(x)^T . Q_g(g), with Q_g current-scaled (HiF8, 224)."""
    base = qat.hif8_w8a8()
    r = dataclasses.replace(base, grad=GRAD_HIF8)
    x, w = _operands()
    g = heavy_tailed(13, (x.shape[0], w.shape[1]))
    dx, dw = jax.jit(jax.grad(lambda a, b: jnp.sum(qat.linear(a, b, recipe=r, state=r.init())[0] * g),
                              argnums=(0, 1)))(x, w)
    xq, wq = ref_quantize_current(x, base.activation), ref_quantize_current(w, base.weight)
    gq = ref_quantize_current(g, GRAD_HIF8)
    _, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, LINEAR), jnp.asarray(xq), jnp.asarray(wq))
    rx, rw = vjp(jnp.asarray(gq))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(rx))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(rw))


def test_observe_only_matmul_is_the_plain_one_forward_and_backward():
    r = dataclasses.replace(qat.hif8_w8a8(), grad=GRAD_HIF8)
    x = heavy_tailed(14, (4, 8, 48))
    _, w = _operands()
    dn = (((2,), (0,)), ((), ()))

    def loss(f, a, b):
        return jnp.sum(f(a, b) ** 2)

    plain = jax.jit(jax.value_and_grad(lambda a, b: loss(lambda u, v: lax.dot_general(u, v, dn), a, b), (0, 1)))
    quant = jax.jit(jax.value_and_grad(
        lambda a, b, obs: loss(lambda u, v: qat.linear(u, v, recipe=r, state=r.init(), observe_only=obs)[0], a, b),
        (0, 1)))
    chex.assert_trees_all_equal(quant(x, w, jnp.bool_(True)), plain(x, w))
    v_q, _ = quant(x, w, jnp.bool_(False))
    assert float(v_q) != float(plain(x, w)[0])


def test_hadamard_on_wgrad_operands():
    """grad.hadamard: wgrad = Q_a(H x)^T . Q_g(H g) along the token axis (H orthogonal, so it cancels in exact
    arithmetic); the re-quantized activation uses current scaling after the transform."""
    base = qat.hif8_w8a8()
    gspec = dataclasses.replace(GRAD_HIF8, hadamard=True)
    r = dataclasses.replace(base, grad=gspec)
    x, w = _operands()
    g = heavy_tailed(15, (x.shape[0], w.shape[1]))
    dx, dw = jax.jit(jax.grad(lambda a, b: jnp.sum(qat.linear(a, b, recipe=r, state=r.init())[0] * g),
                              argnums=(0, 1)))(x, w)
    hx, hg = nvfp4.hadamard16(x, axis=0), nvfp4.hadamard16(g, axis=0)
    _, vjp = jax.vjp(lambda b: lax.dot_general(jnp.asarray(ref_quantize_current(hx, base.activation)), b, LINEAR),
                     w)
    (rw,) = vjp(jnp.asarray(ref_quantize_current(hg, GRAD_HIF8)))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(rw))
    # dgrad is untouched by the transform.
    wq = ref_quantize_current(w, base.weight)
    _, vjp = jax.vjp(lambda a: lax.dot_general(a, jnp.asarray(wq), LINEAR), x)
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(vjp(jnp.asarray(ref_quantize_current(g, GRAD_HIF8)))[0]))
    # And the transform itself cancels: with nothing quantized but the (huge-range) gradient, dw ~ x^T g.
    exact = np.asarray(x).T @ np.asarray(g)
    assert np.max(np.abs(np.asarray(dw) - exact)) / np.max(np.abs(exact)) < 0.1


def test_nvfp4_backward_requantizes_along_the_contraction_axis():
    """NVFP4 W4A4 with NVFP4 gradients (round to nearest, no Hadamard): every backward operand is quantized from
    high precision with its 16-blocks along the axis its GEMM contracts (jaxlowfp.nvfp4 is the reference)."""
    base = qat.nvfp4_w4a4(rule="static_6")  # the rule does not matter here; static_6 compiles fastest
    r = dataclasses.replace(base, grad=QuantSpec(format="nvfp4", rule="static_6"))
    x, w = _operands()
    g = heavy_tailed(16, (x.shape[0], w.shape[1]))

    @jax.jit
    def ours(a, b):
        f = lambda u, v: jnp.sum(qat.linear(u, v, recipe=r, state=r.init())[0] * g)  # noqa: E731
        return qat.linear(a, b, recipe=r, state=r.init())[0], jax.grad(f, argnums=(0, 1))(a, b)

    @jax.jit
    def reference(x, w, g):
        fq = lambda t: nvfp4.fake_quantize(t, rule="static_6", block_shape=(1, 16))  # noqa: E731 (blocks: last axis)
        mm = lambda a, b: jnp.matmul(a, b, precision=lax.Precision.HIGHEST)  # noqa: E731
        return (mm(fq(x), fq(w.T).T), mm(fq(g), fq(w).T), mm(fq(x.T), fq(g.T).T),
                mm(fq(x).T, fq(g.T).T))  # the last: wgrad reusing the forward's K-blocked x (wrong)

    out, (dx, dw) = ours(x, w)
    r_out, r_dx, r_dw, wrong = reference(x, w, g)
    for a, b in ((out, r_out), (dx, r_dx), (dw, r_dw)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(dw), np.asarray(wrong), rtol=1e-5)


def test_nvfp4_fake_quant_with_delayed_global_amax():
    """Delayed scaling supplies NVFP4's global amax; values above it saturate and are counted."""
    spec = QuantSpec(format="nvfp4", rule="static_6", scaling=DelayedScaling(target_max=6.0))
    x0, x1 = heavy_tailed(17, (4, 32)), heavy_tailed(18, (4, 32)) * 2.0
    step = jax.jit(qat.fake_quant, static_argnums=2)
    _, st, _ = step(x0, spec.init(), spec)
    y, _, stats = step(x1, st, spec)
    est = np.float32(np.abs(np.asarray(x0)).max())
    np.testing.assert_array_equal(
        np.asarray(y), np.asarray(jax.jit(lambda t: nvfp4.fake_quantize(t, rule="static_6", global_amax=est))(x1)))
    assert float(stats.amax_estimate) == est
    n_above = int(np.sum(np.abs(np.asarray(x1)) > est))
    assert n_above > 0 and float(stats.saturated_fraction) == np.float32(n_above) / np.float32(x1.size)


def test_nvfp4_training_needs_a_key_and_is_reproducible():
    r = qat.nvfp4_training(rule="static_6")
    x, w = _operands()

    def grads(key):
        return jax.grad(lambda a, b: jnp.sum(qat.linear(a, b, recipe=r, state=r.init(), key=key)[0] ** 2),
                        argnums=(0, 1))(x, w)

    with pytest.raises(ValueError, match="key"):
        grads(None)
    grads = jax.jit(grads)
    g1, g2, g3 = grads(jax.random.key(0)), grads(jax.random.key(0)), grads(jax.random.key(1))
    chex.assert_trees_all_equal(g1, g2)
    assert not np.array_equal(np.asarray(g1[1]), np.asarray(g3[1]))
    exact = jax.grad(lambda a, b: jnp.sum((a @ b) ** 2), argnums=(0, 1))(x, w)
    for a, b in zip(g1, exact):  # 4-bit gradients: a loose sanity bound on the relative error
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 0.35


# ---------------------------------------------------------------------------------------------------------------
# Backward residuals, delayed gradient scaling, state schema

GRAD_RECIPES = {
    "hif8_grad": dataclasses.replace(qat.hif8_w8a8(), grad=GRAD_HIF8),
    "masked_grad": dataclasses.replace(qat.hif8_w8a8(), grad=GRAD_HIF8, activation=dataclasses.replace(
        qat.hif8_w8a8().activation, ste="masked")),
    "nvfp4_training": qat.nvfp4_training(rule="static_6"),
    "fp8_delayed": qat.fp8_delayed(history_len=4),
}


@pytest.mark.parametrize("name", list(GRAD_RECIPES))
def test_backward_keeps_only_the_high_precision_operands(name):
    """The quantized matmul's backward recomputes Q(x) and Q(w) (and the masked-STE masks) from x and w with the
    forward's estimates and keys, so its residuals are x and w themselves plus scalars: half the memory of
    keeping the quantized copies too (4 operand-sized arrays before). The gradients stay bit for bit those of
    the tests above (and of the code before the change)."""
    r = GRAD_RECIPES[name]
    x, w = _operands()
    _, vjp = jax.vjp(jax.jit(lambda a, b: qat.linear(a, b, recipe=r, state=r.init(), key=jax.random.key(0))[0]),
                     x, w)
    arrays = [leaf for leaf in jax.tree.leaves(vjp) if getattr(leaf, "ndim", 0) >= 1]
    history = [(r.grad.scaling.history_len,)] if r.delayed_grad else []  # the gradient's amax history
    assert sorted(a.shape for a in arrays) == sorted([x.shape, w.shape, *history])
    assert sum(a.nbytes for a in arrays) == x.nbytes + w.nbytes + 4 * sum(h[0] for h in history)


def _fp8_grad_step(r):
    @jax.jit
    def step(x, w, st, g):
        def f(a, b, pend):
            out, new, _ = qat.linear(a, b, recipe=r, state=st._replace(grad_pending=pend))
            return out, new

        _, vjp, new = jax.vjp(f, x, w, st.grad_pending, has_aux=True)
        dx, dw, reported = vjp(g)
        return dx, dw, new._replace(grad_pending=reported)

    return step


def test_delayed_gradient_scaling_uses_earlier_gradient_amaxes():
    """fp8_delayed (default convention): the output gradient is quantized to E5M2 with the max of the amaxes of
    the earlier steps' gradients (the current one while there are none: step 0); each backward pass reports its
    gradient's amax, recorded at the next call. Reference: numpy + ml_dtypes casts."""
    r = qat.fp8_delayed(history_len=3)
    step = _fp8_grad_step(r)
    x, w = _operands()
    st = r.init()
    fq = jax.jit(qat.fake_quant, static_argnums=2)
    amaxes = []
    for t, mult in enumerate([1.0, 100.0, 0.01, 1.0, 1.0, 3.0]):
        g = heavy_tailed(40 + t, (x.shape[0], w.shape[1])) * mult
        xq, _, _ = fq(x, st.activation, r.activation)
        wq, _, _ = fq(w, st.weight, r.weight)
        dx, dw, new = step(x, w, st, g)
        a_g = np.float32(np.max(np.abs(np.asarray(g))))
        est = max(amaxes[-3:]) if amaxes else a_g
        gq = ref_scaled_round(g, est / np.float32(57344.0), 57344.0, "e5m2")[0]
        _, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, LINEAR), xq, wq)
        rx, rw = vjp(jnp.asarray(gq))
        np.testing.assert_array_equal(np.asarray(dx), np.asarray(rx), err_msg=f"step {t}")
        np.testing.assert_array_equal(np.asarray(dw), np.asarray(rw), err_msg=f"step {t}")
        assert float(new.grad_pending.seen) == 1.0 and float(new.grad_pending.amax) == a_g
        assert int(new.grad.count) == t  # this step's amax is still pending
        amaxes.append(a_g)
        st = new
    flushed = scaling.record_pending(r.grad.scaling, st.grad, st.grad_pending)
    assert int(flushed.count) == 6 and sorted(np.asarray(flushed.history).tolist()) == sorted(amaxes[-3:])


def test_a_layer_called_twice_with_its_state_threaded_reports_the_larger_amax():
    r = qat.fp8_delayed(history_len=4)
    x, w = _operands()
    g1, g2 = heavy_tailed(50, (32, 16)), heavy_tailed(51, (32, 16)) * 7.0
    st = r.init()

    def loss(pend):
        s = st._replace(grad_pending=pend)
        y1, s, _ = qat.linear(x, w, recipe=r, state=s)
        y2, s, _ = qat.linear(x * 2.0, w, recipe=r, state=s)
        return jnp.sum(y1 * g1) + jnp.sum(y2 * g2), s

    reported, after = jax.jit(jax.grad(loss, has_aux=True))(st.grad_pending)
    assert float(reported.seen) == 1.0
    assert float(reported.amax) == max(float(jnp.max(jnp.abs(g1))), float(jnp.max(jnp.abs(g2))))
    assert float(after.grad_pending.seen) == 0.0  # the forward left nothing pending: the gradient carries it
    with pytest.raises(ValueError, match="no gradient history"):
        qat.linear(x, w, recipe=r, state=qat.RecipeState(weight=st.weight, activation=st.activation))


def test_recipe_state_without_gradient_fields_has_the_old_key_paths_and_old_checkpoints_load(tmp_path):
    """A RecipeState of a recipe without delayed gradient scaling flattens to exactly the key paths of the
    two-field RecipeState of earlier versions, so their orbax checkpoints restore into it; a state with the
    gradient fields round-trips too. (AmaxHistory is unchanged: scaling.SCHEMA_VERSION stays 1.)"""
    import collections

    import orbax.checkpoint as ocp

    OldRecipeState = collections.namedtuple("RecipeState", ["weight", "activation"])  # what earlier versions saved
    r = qat.hif8_w8a8(history_len=4)
    _, st, _ = jax.jit(lambda a, b, s: qat.linear(a, b, recipe=r, state=s))(*_operands(), r.init())
    old = OldRecipeState(st.weight, st.activation)
    paths = lambda t: [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(t)[0]]  # noqa
    assert paths(st) == paths(old)
    delayed = qat.fp8_delayed(history_len=4).init()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "old", {"layer": old})
        ckpt.save(tmp_path / "new", {"layer": delayed})
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "old", {"layer": jax.tree.map(ocp.utils.to_shape_dtype_struct, st)})
        restored_new = ckpt.restore(tmp_path / "new",
                                    {"layer": jax.tree.map(ocp.utils.to_shape_dtype_struct, delayed)})
    assert isinstance(restored["layer"], qat.RecipeState) and restored["layer"].grad is None
    chex.assert_trees_all_equal(restored["layer"], st)
    assert isinstance(restored_new["layer"].grad_pending, scaling.PendingAmax)
    chex.assert_trees_all_equal(restored_new["layer"], delayed)
    scaling.check_version(restored)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_train_step_records_the_output_gradient_amax(microbatches):
    """jaxlowfp.training.make_step differentiates w.r.t. the pending slots too: after a step, the pending amax of
    a one-layer model is max|dL/dy| (over microbatches), dL/dy computed independently from the model's output."""
    from flax import nnx

    from jaxlowfp import qnnx
    from jaxlowfp import training

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.up_proj = nnx.Linear(16, 8, rngs=rngs)

        def __call__(self, x):
            return self.up_proj(x)

    model = Net(nnx.Rngs(0))
    qnnx.quantize_model(model, [qnnx.Rule(path="up_proj", recipe=qat.fp8_delayed(history_len=4))])
    loss_fn = lambda m, b: (jnp.mean((m(b["x"]) - b["t"]) ** 2), {})  # noqa: E731
    graphdef, state = training.init(model, optax.sgd(0.1))
    step = jax.jit(training.make_step(graphdef, optax.sgd(0.1), loss_fn, microbatches=microbatches))
    want = []
    # the model's output, under jit (eager, every quantizer op would dispatch and compile on its own)
    forward = jax.jit(lambda p, q, r, x: nnx.merge(graphdef, p, q, r, copy=True)(x))
    for t in range(2):
        batch = {"x": heavy_tailed(60 + t, (8, 16)), "t": heavy_tailed(70 + t, (8, 8))}
        n = 8 // microbatches  # each microbatch runs from the state the step began with
        y = [forward(state.params, state.qstate, state.rest, batch["x"][i:i + n]) for i in range(0, 8, n)]
        dl_dy = [jax.grad(lambda v, t=batch["t"][i * n:(i + 1) * n]: jnp.mean((v - t) ** 2))(v)
                 for i, v in enumerate(y)]
        want.append(max(float(jnp.max(jnp.abs(d))) for d in dl_dy))
        state, m = step(state, batch)
        assert bool(m["finite"])
        rs = state.qstate["up_proj"]["amax"].get_value()
        assert float(rs.grad_pending.seen) == 1.0
        np.testing.assert_allclose(float(rs.grad_pending.amax), want[-1], rtol=1e-6)
    assert int(rs.grad.count) == 1
    np.testing.assert_allclose(float(rs.grad.history[0]), want[0], rtol=1e-6)


def test_microbatches_give_the_parameters_and_amax_histories_of_one_big_batch():
    """k microbatches and one batch k times larger (jaxlowfp.training.make_step): the same parameters and amax
    histories, to float32 rounding. Step 1 is the observe-only warmup, so every later step quantizes with the same
    delayed estimate in both runs. The first step's recorded amaxes are the max over the microbatches, each run alone
    from the same state (not their sum, as Flax's fp8 ops did, nor the last one, as Levanter kept). SGD: Adam divides
    every coordinate by its own gradient's magnitude, so rounding-level gradients would get sign-like updates.

    Not bitwise: the microbatch step is another XLA program (a scan of k gradient computations on 2-row slices,
    their mean) than the big batch's (8-row matmuls), so the activations, gradient sums and hence the updates and
    the later amaxes round differently (relative differences of a few float32 ulps, ~1e-7; a wrong merge or a
    wrong mean is off by a factor). Exact where the very same float32 values meet a max: step 1's record of
    up_proj, fed by the batch itself through the initial weight."""
    from flax import nnx

    from jaxlowfp import qnnx, training

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.up_proj = nnx.Linear(16, 32, rngs=rngs)
            self.down_proj = nnx.Linear(32, 16, rngs=rngs)

        def __call__(self, x):
            return self.down_proj(jnp.tanh(self.up_proj(x)))

    def loss_fn(m, b):
        return jnp.mean((m(b["x"]) - b["t"]) ** 2), {}

    model = Net(nnx.Rngs(0))
    qnnx.quantize_model(model, [qnnx.Rule(path=".*_proj", recipe=qat.hif8_w8a8())])
    k, b = 4, 2
    rng = np.random.default_rng(8)
    batches = []
    for _ in range(4):
        x = rng.standard_normal((k * b, 16)).astype(np.float32)
        x[b:2 * b] *= 3.0  # the second microbatch holds the largest amax: neither the last one nor the sum
        batches.append({"x": jnp.asarray(x), "t": jnp.asarray(rng.standard_normal((k * b, 16)), jnp.float32)})
    tx, warmup = optax.sgd(0.1), qat.Warmup(steps=1)
    graphdef, init = training.init(model, tx)
    amax = lambda st, layer: st.qstate[layer]["amax"].get_value()  # noqa: E731 (its RecipeState)
    runs = {}
    for micro in (1, k):
        step = jax.jit(training.make_step(graphdef, tx, loss_fn, warmup=warmup, microbatches=micro))
        state, states = init, []
        for batch in batches:
            state, m = step(state, batch)
            assert bool(m["finite"])
            states.append(state)
        runs[micro] = states
    big, small = runs[1], runs[k]
    for a, c in zip(jax.tree.leaves(big[-1].params), jax.tree.leaves(small[-1].params)):
        np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-6, atol=1e-6)
    for t, (s_big, s_small) in enumerate(zip(big, small)):
        for layer in ("up_proj", "down_proj"):
            for part in ("weight", "activation"):
                a, c = getattr(amax(s_big, layer), part), getattr(amax(s_small, layer), part)
                np.testing.assert_allclose(np.asarray(c.history), np.asarray(a.history), rtol=1e-6)
                assert int(c.count) == int(a.count) == t + 1 and np.asarray(a.history).shape[0] > 1
    first = amax(small[0], "up_proj")
    np.testing.assert_array_equal(np.asarray(first.activation.history), np.asarray(amax(big[0], "up_proj")
                                                                                  .activation.history))
    np.testing.assert_array_equal(np.asarray(first.weight.history), np.asarray(amax(big[0], "up_proj").weight.history))

    one = jax.jit(training.make_step(graphdef, tx, loss_fn, warmup=warmup))
    x0 = batches[0]
    alone = [one(init, jax.tree.map(lambda v, i=i: v[i * b:(i + 1) * b], x0))[0] for i in range(k)]
    for layer in ("up_proj", "down_proj"):
        merged = float(amax(small[0], layer).activation.history[0])
        each = np.array([float(amax(s, layer).activation.history[0]) for s in alone])  # each microbatch's amax
        if layer == "up_proj":  # the batch itself: the same values
            assert merged == each.max() == float(np.abs(np.asarray(x0["x"])).max())
        else:  # computed by another program (a 2-row step of its own): float32 rounding
            np.testing.assert_allclose(merged, each.max(), rtol=1e-6)
        assert each.argmax() != k - 1 and merged < each.sum() / 1.5


# ---------------------------------------------------------------------------------------------------------------
# Warmup


def test_warmup_flags_and_lr_schedule():
    w = qat.Warmup(steps=3)
    assert [bool(w.observe_only(t)) for t in range(5)] == [True, True, True, False, False]
    assert [bool(w.quantize(t)) for t in range(5)] == [False, False, False, True, True]
    assert jax.jit(w.observe_only)(jnp.int32(2)).dtype == jnp.bool_
    sched = w.lr_schedule(1e-4, optax.linear_schedule(1e-5, 0.0, 10))
    np.testing.assert_allclose([float(sched(t)) for t in (0, 2, 3, 8, 13)], [1e-4, 1e-4, 1e-5, 5e-6, 0.0], rtol=1e-6)
    assert not bool(qat.Warmup(steps=0).observe_only(0))
    with pytest.raises(TypeError, match="schedules"):
        w.lr_schedule("fast", 1e-5)


def test_straight_through_estimator_is_a_custom_vjp():
    """The gradient is the cotangent (identity) or the cotangent masked where x was clipped (masked STE), for HiF8
    and NVFP4; forward mode raises (JAX's custom_vjp error, restated with the op and the way out: the mission's
    estimator is reverse mode only)."""
    x = jnp.asarray([0.5, -3.0, 7.0, 40.0], jnp.float32)
    t = jnp.asarray([1.0, 2.0, 3.0, 4.0], jnp.float32)
    xs, ts = jnp.tile(x, 4), jnp.tile(t, 4)
    for spec in (QuantSpec(format="hif8", scaling=DelayedScaling(target_max=15.0), ste="masked"),
                 QuantSpec(format="hif8", scaling=DelayedScaling(target_max=15.0)),
                 QuantSpec(format="nvfp4", rule="mse", block_shape=(1, 16))):
        state = spec.scaling.update(spec.init(), jnp.float32(8.0))  # estimate 8: 40 is clipped (hif8)
        grad = jax.grad(lambda v, spec=spec, state=state: jnp.sum(qat.fake_quant(v, state, spec)[0] * ts))(xs)
        clipped = np.tile([False, False, False, True], 4) if spec.ste == "masked" else np.zeros(16, bool)
        np.testing.assert_array_equal(np.asarray(grad), np.where(clipped, 0.0, np.asarray(ts)))  # exact: a select
        with pytest.raises(TypeError, match=r"qat.fake_quant: .*straight-through gradient \(a jax.custom_vjp\)"):
            jax.jvp(lambda v, spec=spec, state=state: qat.fake_quant(v, state, spec)[0], (xs,), (ts,))


def test_stochastic_unbiased_rounding_in_a_recipe_needs_a_key_and_nvfp4():
    spec = QuantSpec(format="nvfp4", rule="mae", rounding="stochastic_unbiased")
    with pytest.raises(ValueError, match="stochastic_unbiased.*PRNG key"):
        qat.fake_quant(jnp.ones((2, 16)), spec.init(), spec)
    y, _, _ = qat.fake_quant(jnp.ones((2, 16)), spec.init(), spec, key=jax.random.key(0))
    assert y.shape == (2, 16)
    with pytest.raises(ValueError, match=r"stochastic_unbiased' is implemented for format=.*'nvfp4'.* only"):
        QuantSpec(format="hif8", rounding="stochastic_unbiased")
