"""One layer reproduced by hand, in numpy, from the order of operations written in docs/formats/arithmetic.md.

The element and scale roundings come from outside codecs (ml_dtypes' float8_e4m3fn and float4_e2m1fn casts,
en_dtypes' HiFloat8 cast, both round-to-nearest-even / HiF8's TA), the rest is float32 numpy arithmetic in the order
the page gives. Fake-quantized operands must equal the library bit for bit (every step is one IEEE float32
operation, so they are integer-exact functions of the inputs); the layer outputs, a float32 matmul whose summation
order numpy and XLA choose differently, to 1e-6 relative."""
import en_dtypes
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jaxlowfp
from jaxlowfp import mx, nvfp4, qat, qnnx
from jaxlowfp.ptq import formats as ptq_formats

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max


def _data(seed=0, rows=8, k=64, m=32):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, k)) * np.exp(rng.uniform(-3, 2, (rows, k)))).astype(F32)
    w = (rng.standard_normal((k, m)) * 0.05).astype(F32)
    return x, w


def _cast(v, dtype):
    return np.asarray(v, F32).astype(dtype).astype(F32)


# -- per-tensor scaled (HiF8, E4M3, E5M2) ---------------------------------------------------------------------

def per_tensor(x, est, target, clip, elem):
    """scale = est / target (1 if est is 0, NaN or Inf); y = round(clip(x * (1/scale), +-clip)) * scale."""
    est = F32(est)
    scale = F32(est / F32(target)) if np.isfinite(est) and est > 0 else F32(1)
    inv = F32(F32(1) / scale)
    xs = np.clip(x * inv, -F32(clip), F32(clip)).astype(F32)
    return np.where(np.isfinite(x), (_cast(xs, elem) * scale).astype(F32), x)


def te(x, est, target, clip, elem, divide):
    """TE: sf = target / est, t = x * sf; Flax: t = x / (1 / sf); y = round(clip(t, +-clip)) * (1 / sf)."""
    sf = F32(F32(target) / F32(est)) if est > 0 else F32(1)
    scale = F32(F32(1) / sf)
    t = (x / scale).astype(F32) if divide else (x * sf).astype(F32)
    return (_cast(np.clip(t, -F32(clip), F32(clip)), elem) * scale).astype(F32)


def _quant_linear(recipe, x, w, state=None):
    lin = qnnx.QuantLinear(w.shape[0], w.shape[1], recipe=recipe, use_bias=False, observe_only=False,
                           rngs=nnx.Rngs(0))
    lin.kernel.set_value(jnp.asarray(w))
    if state is not None:
        lin.amax.set_value(state)
    return np.asarray(nnx.jit(lambda m, x: m(x))(lin, jnp.asarray(x)))


def test_hif8_w8a8_layer_by_hand():
    """First step of delayed scaling (empty history: the estimate is the current amax), HiF8 target 15."""
    x, w = _data()
    recipe = qat.hif8_w8a8()
    xq = per_tensor(x, np.abs(x).max(), 15.0, 15.0, en_dtypes.hifloat8)
    wq = per_tensor(w, np.abs(w).max(), 15.0, 15.0, en_dtypes.hifloat8)
    got_x = qat.fake_quant(jnp.asarray(x), recipe.activation.init(), recipe.activation)[0]
    np.testing.assert_array_equal(np.asarray(got_x), xq)
    np.testing.assert_allclose(_quant_linear(recipe, x, w), xq @ wq, rtol=1e-6, atol=1e-6)
    # PTQ's activation quantizer: the same per-tensor formula with the current amax
    np.testing.assert_array_equal(
        np.asarray(ptq_formats.fake_quantize(jnp.asarray(x), jaxlowfp.Format(kind="hif8"))), xq)


@pytest.mark.parametrize("convention", ["te", "flax"])
def test_fp8_delayed_te_and_flax_layer_by_hand(convention):
    """Second step (one amax recorded per tensor, so est = that amax): E4M3 clipped at 448, scale 1 / (448 / est)."""
    x, w = _data(1)
    recipe = qat.fp8_delayed(history_len=4, convention=convention)
    a_prev, w_prev = F32(3.7), F32(0.11)  # the amaxes the previous step recorded
    st = recipe.init()
    st = st._replace(activation=recipe.activation.scaling.update(st.activation, a_prev),
                     weight=recipe.weight.scaling.update(st.weight, w_prev))
    e4m3 = ml_dtypes.float8_e4m3fn
    xq = te(x, a_prev, 448.0, 448.0, e4m3, divide=convention == "flax")
    wq = te(w, w_prev, 448.0, 448.0, e4m3, divide=convention == "flax")
    got_x = qat.fake_quant(jnp.asarray(x), st.activation, recipe.activation)[0]
    np.testing.assert_array_equal(np.asarray(got_x), xq)
    np.testing.assert_allclose(_quant_linear(recipe, x, w, st), xq @ wq, rtol=1e-6, atol=1e-6)


# -- NVFP4 two-level, every 4/6 rule ------------------------------------------------------------------------------

def nvfp4_by_hand(x, rule):
    """Blocks of 16 along the last axis; the steps of docs/formats/arithmetic.md, section NVFP4."""
    M, E = {"static_6": (6.0, 448.0), "static_4": (4.0, 448.0)}.get(rule, (6.0, 256.0))
    enc, blk_div = F32(M * E), F32(M)
    amax = F32(np.abs(x).max())
    s_enc = F32(1) if amax == 0 else F32(min(enc / amax, FLT_MAX))
    s_dec = F32(F32(1) / s_enc)
    xb = x.reshape(*x.shape[:-1], -1, 16)
    blk = np.abs(xb).max(-1)
    base = ((blk / blk_div).astype(F32) * s_enc).astype(F32)

    def e4m3(v):
        return _cast(np.minimum(v, F32(448)), ml_dtypes.float8_e4m3fn)

    def elements(s):
        inv = np.where(s == 0, F32(0), np.minimum(F32(1) / (s * s_dec).astype(F32), FLT_MAX)).astype(F32)
        a = (np.abs(xb) * inv[..., None]).astype(F32)
        q = _cast(np.minimum(a, F32(6)), ml_dtypes.float4_e2m1fn)
        return np.where(s[..., None] == 0, F32(0), np.copysign(q, xb)).astype(F32)

    def error(s):
        q = elements(s)
        xhat = ((((q * s[..., None]).astype(F32)) * amax).astype(F32) / enc).astype(F32)
        d = (xhat - xb).astype(F32)
        if rule == "abs_max":
            return np.abs(d).max(-1)
        t = (d * d).astype(F32) if rule == "mse" else np.abs(d)
        acc = t[..., 0]
        for i in range(1, 16):  # the 16 columns in order
            acc = (acc + t[..., i]).astype(F32)
        return acc

    s = e4m3(base)
    if rule == "static_4":
        pass  # M = 4 already maps the block max to 4
    elif rule != "static_6":
        s4 = e4m3((base * F32(1.5)).astype(F32))
        s = np.where(error(s4) < error(s), s4, s)
    q = elements(s)
    return (((q * s[..., None]).astype(F32)) * s_dec).astype(F32).reshape(x.shape)


@pytest.mark.parametrize("rule", ["static_6", "static_4", "abs_max", "mae", "mse"])
def test_nvfp4_w4a4_layer_by_hand(rule):
    x, w = _data(2)
    xq = nvfp4_by_hand(x, rule)
    wq = nvfp4_by_hand(w.T, rule).T  # the weight [K, M]: blocks along K, its axis 0
    np.testing.assert_array_equal(np.asarray(nvfp4.fake_quantize(jnp.asarray(x), rule=rule)), xq)
    np.testing.assert_array_equal(np.asarray(nvfp4.fake_quantize(jnp.asarray(w.T), rule=rule)).T, wq)
    np.testing.assert_allclose(_quant_linear(qat.nvfp4_w4a4(rule), x, w), xq @ wq, rtol=1e-6, atol=1e-6)
    if rule == "mse":  # PTQ's NVFP4 activation quantizer: the same function of the input [rows, K]
        got = ptq_formats.fake_quantize(jnp.asarray(x), jaxlowfp.Format(kind="nvfp4", rule="mse"))
        np.testing.assert_array_equal(np.asarray(got), xq)


def test_mxfp4_by_hand():
    """OCP MX floor rule: X = 2^(floor(log2 amax) - 2) per 32, P = E2M1(x / X) saturating, x̂ = P * X."""
    x, _ = _data(3)
    xb = x.reshape(x.shape[0], -1, 32)
    blk = np.abs(xb).max(-1)
    e = np.clip(np.floor(np.log2(blk)).astype(np.int32) - 2, -127, 127)
    X = np.ldexp(F32(1), e).astype(F32)[..., None]
    p = _cast(np.clip(xb / X, -6, 6), ml_dtypes.float4_e2m1fn)
    np.testing.assert_array_equal(np.asarray(mx.fake_quantize(jnp.asarray(x))), (p * X).reshape(x.shape))
