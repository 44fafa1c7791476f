"""`impl=` wiring: the jaxlowfp entry points run the Pallas kernels (interpret mode on CPU) bit-identically, and
refuse clearly where a kernel cannot run; saturation counting at the estimate."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlowfp import dispatch, nvfp4, qat, scaling


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv(dispatch.INTERPRET_ENV, "1")


def _x(shape=(24, 64), seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 3
    x[0, :3] = [0.0, 1e-9, -40.0]
    return jnp.asarray(x)


def _delayed_spec(impl, ste="identity"):
    return qat.QuantSpec(format="hif8", scaling=scaling.DelayedScaling(algorithm="max_window", target_max=15.0),
                         impl=impl, ste=ste)


def test_fake_quant_pallas_equals_xla(interpret):
    """The masked STE only: its mask is the one gradient that the kernel path computes on its own (the identity
    STE passes the cotangent through on either path)."""
    x = _x()
    outs = {}
    for impl in ("xla", "pallas"):
        spec = _delayed_spec(impl, "masked")
        state = spec.scaling.update(spec.init(), jnp.float32(20.0))  # estimate 20: some elements clip
        y, new_state, stats = qat.fake_quant(x, state, spec)
        g = jax.grad(lambda v: jnp.sum(qat.fake_quant(v, state, spec)[0] * v))(x)
        empty = jax.jit(lambda v: qat.fake_quant(v, spec.init(), spec))(x)  # empty history: current-amax fallback
        outs[impl] = (y, stats, g, new_state, empty)
    (y0, s0, g0, n0, e0), (y1, s1, g1, n1, e1) = outs["xla"], outs["pallas"]
    np.testing.assert_array_equal(np.asarray(y0).view(np.uint32), np.asarray(y1).view(np.uint32))
    np.testing.assert_array_equal(np.asarray(g0), np.asarray(g1))
    for a, b in zip(s0, s1):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves((n0, e0)), jax.tree.leaves((n1, e1))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert round(float(s0.saturated_fraction) * x.size) == np.sum(np.abs(np.asarray(x)) > 20.0) == 1


def test_nvfp4_pallas_equals_xla(interpret):
    """The wiring: a non-default rule reaches the kernel. Each rule's kernel against the twin and an independent
    oracle: tests/test_pallas_nvfp4.py."""
    rule = "static_6"
    x = _x((32, 64), 1)
    a = nvfp4.quantize(x, rule=rule, impl="xla")
    b = nvfp4.quantize(x, rule=rule, impl="pallas")
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
    np.testing.assert_array_equal(np.asarray(a.scales).view(np.uint8), np.asarray(b.scales).view(np.uint8))
    y0 = nvfp4.fake_quantize(x, rule=rule, impl="xla")
    y1 = nvfp4.fake_quantize(x, rule=rule, impl="pallas")
    np.testing.assert_array_equal(np.asarray(y0), np.asarray(y1))


def test_pallas_without_a_gpu_or_interpret_mode_raises(monkeypatch):
    monkeypatch.delenv(dispatch.INTERPRET_ENV, raising=False)
    with pytest.raises(dispatch.PallasUnavailableError, match="nvfp4"):
        nvfp4.quantize(_x(), rule="static_6", impl="pallas")
    spec = _delayed_spec("pallas")
    with pytest.raises(dispatch.PallasUnavailableError, match="hif8"):
        qat.fake_quant(_x(), spec.init(), spec)


def test_auto_is_xla_on_cpu_and_bad_impls_raise():
    assert dispatch.resolve_impl("auto", kernel="nvfp4.quantize") == "xla"
    with pytest.raises(ValueError, match="impl='cuda'"):
        nvfp4.quantize(_x(), impl="cuda")
    with pytest.raises(ValueError, match="kernels for format 'hif8'"):
        qat.QuantSpec(format="e4m3", impl="pallas")
    with pytest.raises(ValueError, match="no stochastic rounding"):
        nvfp4.quantize(_x(), rule="mse", rounding="stochastic", key=jax.random.key(0), impl="pallas")


def test_element_equal_to_the_estimate_is_not_saturated():
    # Current scaling: the estimate is the tensor's own amax, so nothing is clipped, whatever the float32 rounding
    # of amax * (1 / (amax / 15)) (it lands one ulp above 15 for many amax values).
    rng = np.random.default_rng(3)
    spec = qat.QuantSpec(format="hif8", ste="masked")
    fq = jax.jit(lambda v: qat.fake_quant(v, spec.init(), spec)[2].saturated_fraction)  # one compile for all 50
    grad = jax.jit(jax.grad(lambda v: jnp.sum(qat.fake_quant(v, spec.init(), spec)[0])))
    for _ in range(50):
        x = jnp.asarray(rng.standard_normal(64).astype(np.float32) * rng.uniform(0.1, 100))
        assert float(fq(x)) == 0.0
        assert (np.asarray(grad(x)) == 1).all()


def test_nan_in_a_tensor_gives_nan_amax():
    # XLA:CPU's max reduction can drop a NaN; the quantizers must still report it.
    x = np.random.default_rng(4).standard_normal(4096).astype(np.float32)
    x[-1] = np.nan
    spec = _delayed_spec("xla")
    _, state, stats = jax.jit(lambda v: qat.fake_quant(v, spec.init(), spec))(jnp.asarray(x))
    assert np.isnan(float(stats.amax)) and int(stats.nonfinite_count) == 1 and int(state.nonfinite) == 1
    assert np.isnan(np.asarray(nvfp4.quantize(jnp.asarray(x.reshape(64, 64)), rule="static_6").global_scale))
