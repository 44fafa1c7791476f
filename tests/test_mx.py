"""MXFP4 / MXFP8 against a numpy reference written from docs/formats/nvfp4.md section 6 and ml_dtypes casts."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlowfp import mx

F32 = np.float32
ELEM = {"e2m1": ml_dtypes.float4_e2m1fn, "e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
EMAX = {"e2m1": 2, "e4m3": 8, "e5m2": 15}


def ref_quantize(x, elem, rule):
    """(codes, E8M0 scale bytes, dequantized) with float64 log2 on float32 maxima and ml_dtypes element casts."""
    t = ELEM[elem]
    mx_ = float(ml_dtypes.finfo(t).max)
    xb = np.asarray(x).astype(F32).reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        if rule == "floor":
            e = np.floor(np.log2(amax.astype(np.float64))) - EMAX[elem]
        else:
            e = np.ceil(np.log2((amax / F32(mx_)).astype(np.float64)))  # the division is one float32 rounding
    e = np.clip(np.nan_to_num(e, neginf=-127), -127, 127)
    finite = np.isfinite(amax)
    scale = np.where(finite, np.exp2(e), np.nan).astype(F32)  # 2^-127 is a float32 subnormal: exact
    y = xb / scale[..., None]
    with np.errstate(invalid="ignore"):
        p = np.clip(y, -mx_, mx_).astype(t)
    codes = p.view(np.uint8).reshape(x.shape)
    if elem == "e2m1":
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    deq = (p.astype(F32) * scale[..., None]).reshape(x.shape)
    return codes, scale.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8), deq


def same_bits(a, b):
    a, b = np.asarray(a, F32), np.asarray(b, F32)
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


def data(seed=0):
    """Rows of different distributions and magnitudes (1e-30 .. 1e30), edge blocks (amax 7 and 6 * 2^k)."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal(256), rng.laplace(size=256), rng.standard_t(3, 256),
            rng.lognormal(0, 4, 256) * rng.choice([-1, 1], 256), 1e-30 * rng.standard_normal(256),
            1e30 * rng.standard_normal(256)]
    edge = np.zeros(256)
    edge[:32] = np.linspace(-7, 7, 32)  # floor: X = 1, 7 saturates to 6
    edge[32:64] = np.linspace(-6, 6, 32) * 2.0**10
    edge[64:96] = np.linspace(-1, 1, 32) * (6 * 448) * (1 + 2.0**-20)
    edge[96:128] = 0.0
    return np.stack(rows + [edge]).astype(F32)


@pytest.mark.parametrize("elem", list(ELEM))
@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_matches_reference(elem, rule):
    x = data()
    for dtype in (np.float32, ml_dtypes.bfloat16):
        xd = x.astype(dtype)
        q = mx.quantize(xd, format=elem, rule=rule)
        codes, scale_bytes, deq = ref_quantize(xd, elem, rule)
        np.testing.assert_array_equal(np.asarray(q.codes), codes)
        assert q.scales.dtype == jnp.float8_e8m0fnu
        np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), scale_bytes)
        d = mx.dequantize(q)
        assert same_bits(d, deq).all()
        fq = jax.jit(lambda v: mx.fake_quantize(v, format=elem, rule=rule))(xd)
        assert fq.dtype == jnp.dtype(dtype)
        assert same_bits(np.asarray(fq).astype(F32), np.asarray(mx.dequantize(q, dtype)).astype(F32)).all()


def test_rules_by_hand():
    x = np.zeros((1, 64), F32)
    x[0, 0] = 7.0  # block 0: floor -> e = 2 - 2 = 0, 7 saturates to 6; ceil -> e = ceil(log2(7/6)) = 1, 7/2 -> 4
    x[0, 32] = 6.0  # block 1: both rules give X = 1 (floor(log2 6) - 2 = 0, ceil(log2(1)) = 0)
    fl = np.asarray(mx.fake_quantize(x, format="e2m1", rule="floor"))
    ce = np.asarray(mx.fake_quantize(x, format="e2m1", rule="ceil"))
    assert (fl[0, 0], ce[0, 0], fl[0, 32], ce[0, 32]) == (6.0, 8.0, 6.0, 6.0)
    q = mx.quantize(x, format="e2m1", rule="ceil")
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8)[0], [128, 127])
    assert int(q.codes[0, 0]) == 0x06  # 7 / 2 = 3.5 -> 4 (tie to even index 6), element 0 in the low nibble
    # an all-zero block: scale 2^-127 (byte 0) and zero codes
    z = mx.quantize(np.zeros((2, 32), F32), format="e4m3")
    assert not np.asarray(z.codes).any() and not np.asarray(z.scales).view(np.uint8).any()


def test_non_finite_blocks_are_nan():
    x = np.ones((2, 64), F32)
    x[0, 5], x[1, 40] = np.nan, np.inf
    for elem in ELEM:
        q = mx.quantize(x, format=elem)
        ok = 127 - EMAX[elem]  # all-ones block: e = floor(log2 1) - emax
        np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), [[255, ok], [ok, 255]])
        d = np.asarray(mx.dequantize(q))
        assert np.isnan(d[0, :32]).all() and np.isnan(d[1, 32:]).all() and (d[0, 32:] == 1).all()


def test_pytree_and_bad_inputs():
    q = mx.quantize(jnp.ones((2, 64), jnp.bfloat16), format="e5m2", rule="ceil")
    leaves, tree = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 2 and jax.tree_util.tree_unflatten(tree, leaves).format.element == "e5m2"
    assert q.dequantize().dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.quantize(jnp.ones((2, 48)))
    with pytest.raises(ValueError, match="format='e3m2'"):
        mx.quantize(jnp.ones((2, 32)), format="e3m2")
    with pytest.raises(ValueError, match="rule='even'"):
        mx.fake_quantize(jnp.ones((2, 32)), rule="even")
    with pytest.raises(TypeError, match="float64"):
        mx.quantize(np.ones((2, 32)))
    with pytest.raises(TypeError, match="int32"):
        mx.quantize(jnp.ones((2, 32), jnp.int32))
    with pytest.raises(TypeError, match="MX jaxlowfp.QArray"):
        mx.dequantize(jnp.ones(3))


def test_the_old_keywords_still_work_with_a_deprecation_warning():
    x = jnp.linspace(-3.0, 3.0, 64, dtype=jnp.float32).reshape(2, 32)
    with pytest.warns(DeprecationWarning, match=r"mx.quantize\(elem=...\) is deprecated .* use format="):
        old = mx.quantize(x, elem="e4m3")
    with pytest.warns(DeprecationWarning, match=r"scale_rule=...\) is deprecated .* use rule="):
        old_fq = mx.fake_quantize(x, scale_rule="ceil")
    np.testing.assert_array_equal(np.asarray(old.codes), np.asarray(mx.quantize(x, format="e4m3").codes))
    np.testing.assert_array_equal(np.asarray(old_fq), np.asarray(mx.fake_quantize(x, rule="ceil")))
    assert old.format.element == "e4m3"  # MXArray.elem (deprecated) is gone with MXArray: QArray.format says it
    with pytest.warns(DeprecationWarning, match=r"jaxlowfp.mx.MXArray is deprecated .* use jaxlowfp.QArray"):
        assert isinstance(old, mx.MXArray)
    with pytest.warns(DeprecationWarning, match="jaxlowfp.mx.FORMATS"):
        assert mx.ELEMENTS == mx.FORMATS
    with pytest.raises(TypeError, match="pass format= only"):
        mx.quantize(x, elem="e4m3", format="e5m2")
