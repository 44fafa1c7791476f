"""Element-format descriptors against `ml_dtypes` casts (E4M3/E5M2/E2M1) and `jaxlowfp.hif8` (HIF8 delegation)."""
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlowfp import formats, hif8

MINI = {
    "e4m3": (formats.E4M3, ml_dtypes.float8_e4m3fn),
    "e5m2": (formats.E5M2, ml_dtypes.float8_e5m2),
    "e2m1": (formats.E2M1, ml_dtypes.float4_e2m1fn),
}
ON_JIT = pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])


def oracle_values(t) -> np.ndarray:
    """Every code's value as ml_dtypes decodes it, indexed by code."""
    n = 16 if t == ml_dtypes.float4_e2m1fn else 256
    return np.arange(n, dtype=np.uint8).view(t).astype(np.float32)


def oracle_cast(x: np.ndarray, t, saturate: bool):
    """(codes, values) of ml_dtypes' RNE cast; saturate clamps to +-max first (the satfinite convention)."""
    x = np.asarray(x)
    if saturate:
        m = float(ml_dtypes.finfo(t).max)
        x = np.where(np.isnan(x), x, np.clip(x.astype(np.float32), -m, m)).astype(x.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        y = x.astype(t)
    return y.view(np.uint8), y.astype(np.float32)


def same_bits(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


def boundary_values(t) -> np.ndarray:
    """Every value, every midpoint between neighbours (and beyond max), each +-1 float32 ulp, both signs."""
    vals = oracle_values(t)
    pos = np.unique(vals[np.isfinite(vals) & (vals >= 0)]).astype(np.float64)
    nxt = 2.0 * pos[-1] - pos[-2]  # the value one step past max (same exponent step), bounds the overflow tie
    grid = np.concatenate([pos, [nxt, 2 * nxt]])
    mids = (grid[:-1] + grid[1:]) / 2  # few significant bits: exact in float32
    pts = np.concatenate([pos, mids, grid, pos / 4, pos * 0.75]).astype(np.float32)
    pts = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))])
    return np.concatenate([pts, -pts])


def wide_random(n=50_000, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.exp2(rng.uniform(-30.0, 20.0, n)) * rng.choice([-1.0, 1.0], n)
    return x.astype(np.float32)


SPECIALS = np.array(
    [0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 1e-38, -1e-38, np.finfo(np.float32).max, -3e38], np.float32
)


def sweep(t) -> np.ndarray:
    return np.concatenate([boundary_values(t), wide_random(), SPECIALS])


def run(f, use_jit):
    return jax.jit(f) if use_jit else f


@pytest.mark.parametrize("name", list(MINI))
def test_every_code_decodes_like_ml_dtypes(name):
    fmt, t = MINI[name]
    ref = oracle_values(t)
    codes = np.arange(len(ref), dtype=np.uint8)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        got = np.asarray(fmt.decode(codes, dtype)).astype(np.float32)
        assert same_bits(got, ref).all(), name


@pytest.mark.parametrize("name", list(MINI))
@ON_JIT
def test_encode_round_match_ml_dtypes_float32(name, use_jit):
    """encode and round, saturating or not (under jit: one program for the four)."""
    fmt, t = MINI[name]
    x = sweep(t)
    both = run(lambda v: [(fmt.encode(v, saturate=sat), fmt.round(v, saturate=sat)) for sat in (False, True)],
               use_jit)(x)
    for saturate, (codes, vals) in zip((False, True), both):
        codes, vals = np.asarray(codes), np.asarray(vals)
        ref_codes, ref_vals = oracle_cast(x, t, saturate)
        assert codes.dtype == np.uint8 and vals.dtype == np.float32
        np.testing.assert_array_equal(codes, ref_codes, err_msg=f"saturate={saturate}")
        assert same_bits(vals, ref_vals).all(), saturate


@pytest.mark.parametrize("name", list(MINI))
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_encode_round_match_ml_dtypes_half_inputs(name, dtype):
    fmt, t = MINI[name]
    with np.errstate(over="ignore"):
        x = sweep(t).astype(dtype)  # every bf16/f16 value near the grid, each cast once by ml_dtypes
    ref_codes, ref_vals = oracle_cast(x, t, saturate=False)
    codes, vals = jax.jit(lambda v: (fmt.encode(v), fmt.round(v)))(x)  # one program
    np.testing.assert_array_equal(np.asarray(codes), ref_codes)
    assert vals.dtype == jnp.dtype(dtype)
    assert same_bits(np.asarray(vals).astype(np.float32), ref_vals).all()


def test_nan_handling():
    nan = np.array([np.nan, -np.nan], np.float32)
    assert np.isnan(np.asarray(formats.E4M3.round(nan))).all()
    np.testing.assert_array_equal(np.asarray(formats.E4M3.encode(nan)) & 0x7F, [0x7F, 0x7F])
    np.testing.assert_array_equal(np.asarray(formats.E5M2.encode(nan)) & 0x7F, [0x7E, 0x7E])
    # E2M1 has no NaN code: NaN encodes to +0 (ml_dtypes also gives a zero), while round keeps NaN visible.
    np.testing.assert_array_equal(np.asarray(formats.E2M1.encode(nan)), [0, 0])
    assert np.isnan(np.asarray(formats.E2M1.round(nan))).all()


def test_overflow_hand_table():
    x = np.array([448, 463.99, 464, 464.01, 1e9, np.inf], np.float32)
    np.testing.assert_array_equal(np.asarray(formats.E4M3.encode(x)), [0x7E, 0x7E, 0x7E, 0x7F, 0x7F, 0x7F])
    np.testing.assert_array_equal(np.asarray(formats.E4M3.encode(x, saturate=True)), [0x7E] * 6)
    y = np.array([57344, 61439, 61440, np.inf], np.float32)
    np.testing.assert_array_equal(np.asarray(formats.E5M2.encode(y)), [0x7B, 0x7B, 0x7C, 0x7C])
    np.testing.assert_array_equal(np.asarray(formats.E5M2.round(y, saturate=True)), [57344.0] * 4)
    z = np.array([4.99, 5.0, 5.01, 7.0, -np.inf], np.float32)
    np.testing.assert_array_equal(np.asarray(formats.E2M1.round(z)), [4, 4, 6, 6, -6])


def test_descriptor_constants_match_ml_dtypes():
    for fmt, t in MINI.values():
        fi = ml_dtypes.finfo(t)
        assert fmt.max_finite == float(fi.max)
        assert fmt.min_normal == float(fi.smallest_normal)
        assert fmt.min_subnormal == float(fi.smallest_subnormal)
        assert fmt.default_target_max == fmt.max_finite
        assert np.asarray([fmt.max_code], np.uint8).view(t).astype(np.float32)[0] == fmt.max_finite
    assert (formats.E4M3.has_inf, formats.E5M2.has_inf, formats.E2M1.has_nan) == (False, True, False)


def test_hif8_delegates():
    f = formats.HIF8
    assert (f.max_finite, f.default_target_max, f.default_grad_target_max) == (32768.0, 15.0, 224.0)
    x = jnp.asarray(wide_random(2000), jnp.float32)
    for sat in (False, True):
        np.testing.assert_array_equal(np.asarray(f.encode(x, saturate=sat)), np.asarray(hif8.encode(x, saturate=sat)))
        np.testing.assert_array_equal(np.asarray(f.round(x, saturate=sat)), np.asarray(hif8.round(x, saturate=sat)))
    codes = jnp.arange(256, dtype=jnp.uint8)
    assert same_bits(f.decode(codes, jnp.bfloat16).astype(jnp.float32), hif8.decode(codes, jnp.float32)).all()


def test_get_and_hashable_config():
    assert formats.get("E4M3") is formats.E4M3 and formats.get(formats.E2M1) is formats.E2M1
    assert {formats.get(n).name for n in ("hif8", "e4m3", "e5m2", "e2m1")} == {"hif8", "e4m3", "e5m2", "e2m1"}
    with pytest.raises(ValueError, match="unknown format 'fp8'.*allowed"):
        formats.get("fp8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        formats.E4M3.max_finite = 1.0  # type: ignore[misc]
    assert hash(formats.E4M3) == hash(dataclasses.replace(formats.E4M3))
    # a format is static config: passing it to jit as a static argument does not retrace
    traces = []

    @jax.jit
    def f(x):
        traces.append(1)
        return formats.E4M3.round(x)

    f(jnp.ones(3)), f(jnp.zeros(3))
    assert len(traces) == 1


def test_bad_inputs():
    with pytest.raises(TypeError, match="float64"):
        formats.E4M3.encode(np.ones(3, np.float64))
    with pytest.raises(TypeError, match="int32"):
        formats.E5M2.round(jnp.ones(3, jnp.int32))
    with pytest.raises(TypeError, match="uint8"):
        formats.E2M1.decode(jnp.ones(3, jnp.int32))
    with pytest.raises(TypeError, match="dtype must be"):
        formats.E4M3.decode(jnp.ones(3, jnp.uint8), jnp.int8)
    with pytest.raises(ValueError, match="default_target_max"):
        dataclasses.replace(formats.E4M3, default_target_max=1000.0)
    with pytest.raises(TypeError):
        formats.MiniFloat("e4m3")  # keyword-only
