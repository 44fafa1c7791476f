"""jaxlowfp.QArray: one quantized array for every format (issue 42, item 2)."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jaxlowfp
from jaxlowfp import if4, mx, nvfp4, packed
from jaxlowfp._core.format import ARRAY_KINDS, KINDS
from jaxlowfp.registry import FORMATS

# every kind, with a non-default rule and 16x16 tiles where the kind has them
CASES = [jaxlowfp.Format(kind=k) for k in ARRAY_KINDS] + [
    jaxlowfp.Format.parse("nvfp4-mse-16x16"), jaxlowfp.Format.parse("if4-mae"), jaxlowfp.Format.parse("mxfp4-ceil"),
    jaxlowfp.Format.parse("if6_e3m2-abs_max-16x16"), jaxlowfp.Format.parse("mxfp8_e5m2-ceil"),
]


def _x(shape=(32, 64), dtype=jnp.float32, seed=0):
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 3.0
    return x.at[0, :16].set(0.0).at[1, 3].set(40.0).astype(dtype)  # a zero block and an outlier


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize("fmt", CASES, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_kind_dequantizes_to_fake_quantize_bit_for_bit_under_jit(fmt, dtype):
    x = _x(dtype=dtype)
    # one program: quantize, dequantize and fake_quantize under one jit (no comparison across XLA programs); the
    # QArray comes out of the same program (the eager call, another compilation, is test_layout_of_each_kind's)
    q, got, want = jax.jit(lambda v: (q := jaxlowfp.quantize(v, fmt), jaxlowfp.dequantize(q),
                                      jaxlowfp.fake_quantize(v, fmt)))(x)
    assert isinstance(q, jaxlowfp.QArray) and q.format == fmt and q.shape == x.shape and q.dtype == x.dtype
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert np.abs(np.asarray(got, np.float32) - np.asarray(x, np.float32)).max() > 0  # it did quantize


@pytest.mark.parametrize("fmt", CASES, ids=lambda f: f.name)
def test_layout_of_each_kind(fmt):
    x = _x()
    q = jaxlowfp.quantize(x, fmt)
    four_bit = fmt.element == "e2m1"
    assert q.codes.shape == (32, 32 if four_bit else 64)
    if fmt.per_tensor:
        assert q.scales is None and q.global_scale.shape == () and q.scale is q.global_scale
        assert q.codes.dtype == (jnp.float8_e4m3fn if fmt.kind == "fp8" else jnp.uint8)
    elif fmt.is_mx:
        assert q.global_scale is None and q.scales.dtype == jnp.float8_e8m0fnu and q.scales.shape == (32, 2)
    else:
        assert q.scales.dtype == jnp.float8_e4m3fn and q.global_scale.dtype == jnp.float32
        assert q.scales.shape == ((2, 4) if fmt.rows == 16 else (32, 4))
    leaves = jax.tree.leaves(q)
    assert q.nbytes == sum(a.size * a.dtype.itemsize for a in leaves)
    assert (q.rule, q.block_shape) == (fmt.rule, fmt.block_shape)


def test_the_per_format_modules_return_qarrays_with_their_format():
    x = _x()
    assert nvfp4.quantize(x, rule="mse").format == jaxlowfp.Format.parse("nvfp4-mse")
    assert if4.quantize(x, format="if3", rule="mae").format == jaxlowfp.Format(kind="if3", rule="mae")
    assert mx.quantize(x, format="e5m2").format == jaxlowfp.Format(kind="mxfp8_e5m2")
    assert packed.scaled_quantize(x, "hif8").format == jaxlowfp.Format(kind="hif8")
    q = if4.quantize(x)
    assert q.is_int.shape == q.scales.shape and q.is_int.dtype == jnp.bool_
    # the module functions decode the same arrays (their default dtype is float32)
    np.testing.assert_array_equal(np.asarray(nvfp4.dequantize(nvfp4.quantize(x))),
                                  np.asarray(jaxlowfp.nvfp4.fake_quantize(x)))


def test_format_names_of_the_new_kinds_round_trip_and_stay_out_of_the_lists():
    for k in ARRAY_KINDS:
        f = jaxlowfp.Format(kind=k)
        assert jaxlowfp.Format.parse(f.name) == f
    new = set(ARRAY_KINDS) - set(KINDS)
    assert new == {"if6_e2m3", "if6_e3m2", "if3", "mxfp8_e5m2"}
    assert not any(n.split("-")[0] in new for n in FORMATS)  # the CLI / PTQ lists are unchanged
    with pytest.raises(ValueError, match="pack takes the formats of a packed GEMM weight"):
        packed.pack(jnp.ones((32, 16)), "if3")


def test_qarray_is_a_pytree():
    x = _x()
    for fmt in ("nvfp4", "mxfp4", "fp8"):
        q = jaxlowfp.quantize(x, fmt)
        leaves, tree = jax.tree.flatten(q)
        assert len(leaves) == {"nvfp4": 3, "mxfp4": 2, "fp8": 2}[fmt]  # None scales are no leaf
        r = jax.tree.unflatten(tree, leaves)
        assert r.format == q.format and r.shape == q.shape
        doubled = jax.tree.map(lambda a: a, q)
        assert isinstance(doubled, jaxlowfp.QArray)
        # through jit as argument and result
        out_q, d = jax.jit(lambda a: (a, a.dequantize()))(q)
        assert isinstance(out_q, jaxlowfp.QArray) and out_q.format == q.format
        np.testing.assert_array_equal(np.asarray(out_q.codes).view(np.uint8), np.asarray(q.codes).view(np.uint8))
        np.testing.assert_array_equal(_bits(d), _bits(jax.jit(lambda a: a.dequantize())(q)))


def test_qarray_in_nnx_state():
    class Holder(nnx.Module):
        def __init__(self, q):
            self.w = packed.PackedParam(packed.PackedWeight(array=q, s_enc=None, format=q.format, k=64, n=32))

    h = Holder(jaxlowfp.quantize(_x(), "if4-mse"))
    graphdef, state = nnx.split(h)
    leaves = jax.tree.leaves(state)
    assert len(leaves) == 3  # codes, scales, global scale
    h2 = nnx.merge(graphdef, state)
    assert isinstance(h2.w.get_value().array, jaxlowfp.QArray)
    np.testing.assert_array_equal(np.asarray(h2.w.get_value().array.codes), np.asarray(h.w.get_value().array.codes))


def test_old_names_warn_build_qarrays_and_answer_isinstance():
    x = _x()
    q = nvfp4.quantize(x)
    with pytest.warns(DeprecationWarning, match=r"jaxlowfp.nvfp4.NVFP4Array is deprecated .* use jaxlowfp.QArray"):
        old = nvfp4.NVFP4Array
    assert isinstance(q, old) and not isinstance(mx.quantize(x), old)
    r = old(codes=q.codes, scales=q.scales, global_scale=q.global_scale, rule="static_6", block_shape=(1, 16),
            dtype=q.dtype, shape=q.shape)
    assert type(r) is jaxlowfp.QArray and r.format == q.format
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        qi = if4.quantize(x, format="if6_e2m3")
        ri = if4.IFArray(codes=qi.codes, scales=qi.scales, global_scale=qi.global_scale, format="if6_e2m3",
                         rule="mse", block_shape=(1, 16), dtype=qi.dtype, shape=qi.shape)
        assert ri.format == qi.format and isinstance(qi, if4.IFArray)
        qm = mx.quantize(x, format="e4m3", rule="ceil")
        rm = mx.MXArray(codes=qm.codes, scales=qm.scales, format="e4m3", rule="ceil", dtype=qm.dtype, shape=qm.shape)
        assert rm.format == qm.format and rm.global_scale is None
        qs = packed.scaled_quantize(x, "fp8")
        rs = packed.ScaledArray(codes=qs.codes, scale=qs.scale, elem="e4m3", dtype=qs.dtype, shape=qs.shape)
        assert rs.format == jaxlowfp.Format(kind="fp8") and rs.scales is None
        rp = packed.ScaledArray(qs.codes, qs.scale, "e4m3", qs.dtype, qs.shape)  # positionally, as the dataclass
        assert rp.format == rs.format and rp.global_scale is qs.global_scale
        with pytest.raises(ValueError, match="MXArray format='e9m9'"):
            mx.MXArray(codes=qm.codes, scales=qm.scales, format="e9m9", rule="ceil", dtype=qm.dtype, shape=qm.shape)
    # the rebuilt arrays decode as the originals (one jit program each)
    for a, b in ((r, q), (ri, qi), (rm, qm), (rs, qs)):
        got, want = jax.jit(lambda u, v: (u.dequantize(), v.dequantize()))(a, b)
        np.testing.assert_array_equal(_bits(got), _bits(want))


def test_bad_input_is_a_clear_error():
    x = _x()
    with pytest.raises(TypeError, match="dequantize takes a jaxlowfp.QArray .*got ArrayImpl"):
        jaxlowfp.dequantize(x)
    with pytest.raises(TypeError, match="a PackedWeight's is its .array"):
        jaxlowfp.dequantize(packed.pack(jnp.ones((32, 16)), "nvfp4"))
    with pytest.raises(TypeError, match=r"nvfp4.dequantize expects an NVFP4 jaxlowfp.QArray .*Format\('mxfp4'\)"):
        nvfp4.dequantize(mx.quantize(x))
    with pytest.raises(TypeError, match=r"mx.dequantize expects an MX jaxlowfp.QArray .*Format\('nvfp4'\)"):
        mx.dequantize(nvfp4.quantize(x))
    with pytest.raises(TypeError, match="if4.dequantize expects an IF jaxlowfp.QArray"):
        if4.dequantize(packed.scaled_quantize(x, "fp8"))
    with pytest.raises(TypeError, match="from_nvfp4 takes an NVFP4 jaxlowfp.QArray"):
        packed.from_nvfp4(if4.quantize(x))
    with pytest.raises(TypeError, match="QArray.format must be a jaxlowfp.Format; got str"):
        jaxlowfp.QArray(codes=x, scales=None, global_scale=None, format="nvfp4", dtype=x.dtype, shape=x.shape)
    with pytest.raises(ValueError, match="per-tensor scale of fp8 / hif8"):
        _ = nvfp4.quantize(x).scale
    with pytest.raises(ValueError, match="INT-block flag of the IF formats"):
        _ = nvfp4.quantize(x).is_int
    with pytest.raises(ValueError, match="kind='if5' is not supported"):
        jaxlowfp.Format(kind="if5")
    with pytest.raises(ValueError, match="unknown format 'mxfp8_e4m2'"):
        jaxlowfp.quantize(x, "mxfp8_e4m2")


def test_e8m0_scale_dtype_is_ml_dtypes():
    # the MX scales keep the E8M0 dtype (the OCP layout a checkpoint stores), readable as bytes
    q = jaxlowfp.quantize(_x(), "mxfp8")
    assert np.asarray(q.scales).dtype == ml_dtypes.float8_e8m0fnu
