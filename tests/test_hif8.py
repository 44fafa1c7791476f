"""HiF8 codec against the independent oracle `en_dtypes.hifloat8` (Huawei's golden numpy dtype)."""
import en_dtypes
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlowfp import hif8

HIF8 = en_dtypes.hifloat8


def oracle_encode(x) -> np.ndarray:
    """en_dtypes' TA-rounded codes of float32/float16/bfloat16 values (widened exactly to float32 first)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(x).astype(np.float32).astype(HIF8).view(np.uint8)


def oracle_decode(codes) -> np.ndarray:
    return np.asarray(codes, np.uint8).view(HIF8).astype(np.float32)


def same_bits(a, b) -> np.ndarray:
    """Elementwise bit equality of float32 arrays, any NaN equal to any NaN."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


def boundary_values() -> np.ndarray:
    """Every HiF8 value, every midpoint between neighbouring values, each +-1 float32 ulp; both signs.

    The grid comes from the oracle's decode of all 256 codes, not from our code.
    """
    vals = oracle_decode(np.arange(256))
    pos = np.unique(vals[np.isfinite(vals) & (vals >= 0)]).astype(np.float64)
    grid = np.concatenate([pos, [49152.0]])  # 0x6F's would-be value bounds the last interval
    mids = (grid[:-1] + grid[1:]) / 2  # at most 5 significant bits: exact in float32
    pts = np.concatenate([pos, mids, [2.0**-23, 2.0**-24, 40960.0, 49152.0, 65536.0]]).astype(np.float32)
    pts = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))])
    return np.concatenate([pts, -pts])


def denormal_region(n=200_000, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.exp2(rng.uniform(-24.0, -15.0, n)).astype(np.float32)
    return np.concatenate([x, -x])


def overflow_region() -> np.ndarray:
    x = np.concatenate([
        np.linspace(30000, 70000, 40_001, dtype=np.float32),
        np.array([np.inf, np.finfo(np.float32).max, 2.0**16, 2.0**17], np.float32),
    ])
    return np.concatenate([x, -x])


def specials() -> np.ndarray:
    return np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1e-45, -1e-45, 1e-38, -1e-38, 2.0**-126], np.float32)


@pytest.fixture(params=["eager", "jit"])
def mode(request):
    return request.param


def fn(f, mode, **kw):
    g = lambda x: f(x, **kw)  # noqa: E731
    return jax.jit(g) if mode == "jit" else g


def test_decode_all_256_codes(mode):
    codes = np.arange(256, dtype=np.uint8)
    got = np.asarray(fn(hif8.decode, mode)(jnp.asarray(codes)))
    assert same_bits(got, oracle_decode(codes)).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_decode_into_narrow_dtypes_is_exact(dtype):
    codes = np.arange(256, dtype=np.uint8)
    got = np.asarray(hif8.decode(jnp.asarray(codes), dtype)).astype(np.float32)
    assert same_bits(got, oracle_decode(codes)).all()


@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16])
def test_encode_all_16bit_patterns(dtype, mode):
    x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(dtype)
    got = np.asarray(fn(hif8.encode, mode)(jnp.asarray(x)))
    want = oracle_encode(x)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} mismatches, first: {x[bad[:5]]} got {got[bad[:5]]} want {want[bad[:5]]}"


REGIONS = (boundary_values, denormal_region, overflow_region, specials)


def regions(*fns) -> tuple[np.ndarray, np.ndarray]:
    """The regions concatenated (one array: one compilation) and each element's region name."""
    parts = [f() for f in fns]
    return np.concatenate(parts), np.concatenate([np.full(len(p), f.__name__) for f, p in zip(fns, parts)])


def test_encode_float32_regions(mode):
    x, where = regions(*REGIONS)
    got = np.asarray(fn(hif8.encode, mode)(jnp.asarray(x)))
    want = oracle_encode(x)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{bad.size} mismatches in {sorted(set(where[bad]))}, first: {x[bad[:5]]!r} "
                           f"got {got[bad[:5]]} want {want[bad[:5]]}")


def test_encode_random_float32_bit_patterns(mode):
    bits = np.random.default_rng(1).integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    assert (np.asarray(fn(hif8.encode, mode)(jnp.asarray(x))) == oracle_encode(x)).all()


def test_special_codes():
    x = jnp.array([np.nan, np.inf, -np.inf, 0.0, -0.0, -1e-9, 40960.0, -40960.0, 40959.996, 32768.0], jnp.float32)
    assert hif8.encode(x).tolist() == [0x80, 0x6F, 0xEF, 0x00, 0x00, 0x00, 0x6F, 0xEF, 0x6E, 0x6E]
    assert hif8.encode(x, saturate=True).tolist() == [0x80, 0x6E, 0xEE, 0x00, 0x00, 0x00, 0x6E, 0xEE, 0x6E, 0x6E]


def test_saturate_maps_only_overflow_to_max(mode):
    x, where = regions(boundary_values, overflow_region, specials)
    want = oracle_encode(x)
    want = np.where(want == 0x6F, 0x6E, np.where(want == 0xEF, 0xEE, want))
    got = np.asarray(fn(hif8.encode, mode, saturate=True)(jnp.asarray(x)))
    assert (got == want).all(), sorted(set(where[got != want]))
    r = np.asarray(fn(hif8.round, mode, saturate=True)(jnp.asarray(x)))
    assert same_bits(r, oracle_decode(want)).all(), sorted(set(where[~same_bits(r, oracle_decode(want))]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_round_equals_decode_of_encode_and_is_idempotent(dtype, mode):
    """Both saturate settings (in jit mode: one program for the two)."""
    x = np.concatenate([boundary_values(), overflow_region(), specials(), denormal_region(20_000)])
    x = jnp.asarray(x).astype(dtype)

    def both(v):
        return [hif8.round(v, saturate=sat) for sat in (False, True)]

    for sat, r in zip((False, True), jax.jit(both)(x) if mode == "jit" else both(x)):
        assert r.dtype == dtype
        d = hif8.decode(hif8.encode(x, saturate=sat), dtype)  # eager: jit against eager in jit mode
        assert same_bits(np.asarray(r, np.float32), np.asarray(d, np.float32)).all(), sat
        assert same_bits(np.asarray(hif8.round(r, saturate=sat), np.float32), np.asarray(r, np.float32)).all(), sat


def test_round_gives_unsigned_zero():
    r = np.asarray(hif8.round(jnp.array([-1e-9, -0.0, -2.0**-24], jnp.float32)))
    assert (r.view(np.uint32) == 0).all()


def test_shapes_and_vmap():
    x = jnp.linspace(-50.0, 50.0, 2 * 3 * 5, dtype=jnp.float32).reshape(2, 3, 5)
    assert hif8.encode(x).shape == (2, 3, 5)
    assert hif8.encode(jnp.float32(3.3)).shape == ()
    v = jax.vmap(hif8.encode)(x)
    assert (np.asarray(v) == oracle_encode(np.asarray(x))).all()
    assert hif8.round(jnp.zeros((0, 4), jnp.float32)).shape == (0, 4)


@pytest.mark.parametrize(
    "bad, err",
    [
        (np.arange(4, dtype=np.int32), TypeError),
        (jnp.arange(4), TypeError),
        (np.ones(4, np.float64), TypeError),
        (3, TypeError),
    ],
)
def test_bad_inputs_raise(bad, err):
    with pytest.raises(err, match="float32"):
        hif8.encode(bad)
    with pytest.raises(err, match="float32"):
        hif8.round(bad)


def test_float64_message_explains_the_cast():
    with pytest.raises(TypeError, match=r"astype\(jnp.float32\)"):
        hif8.round(np.ones(3))


def test_unknown_rounding_and_bad_codes_raise():
    with pytest.raises(ValueError, match="rounding='rne'.*'ta', 'hybrid'"):
        hif8.encode(jnp.ones(3), rounding="rne")
    with pytest.raises(TypeError, match="uint8"):
        hif8.decode(jnp.ones(3, jnp.int32))
    with pytest.raises(TypeError, match="dtype"):
        hif8.decode(jnp.ones(3, jnp.uint8), jnp.int32)
    with pytest.raises(TypeError, match="float32 inputs only"):
        hif8.round(jnp.ones(3, jnp.float16), rounding="hybrid")


# ---- hybrid ("HR") rounding: a scalar transcription of docs/formats/hif8.md section 6.2, written independently ----

def hybrid_reference(v: float) -> float:
    """HR rounding of one float32 value, straight from the spec text (integer arithmetic on the fields)."""
    bits = int(np.float32(v).view(np.uint32))
    sign = -1.0 if bits >> 31 else 1.0
    ex, frac = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if ex == 0xFF:
        return float("nan") if frac else sign * float("inf")
    if ex == 0:
        return 0.0
    e = ex - 127
    if abs(e) < 4 or abs(v) >= 40960 or e < -23:
        return float(oracle_decode(oracle_encode(np.float32(v))))  # TA (and its overflow/underflow)
    if e == -23:
        f14, t14 = (frac >> 10) + 8192, frac & 0x3FFF
        return sign * 2.0**-22 if f14 >= t14 else 0.0
    m = 2 if abs(e) <= 7 else 1 if abs(e) <= 15 else 0
    keep = frac >> (23 - m)
    rem = frac - (keep << (23 - m))
    f14, t14 = rem >> (23 - m - 14), rem & 0x3FFF
    keep += (f14 >= t14) and rem != 0  # an exact value (nothing discarded) is kept
    val = 2.0**e * (1 + keep / 2**m)  # keep == 2^m carries into the next binade
    return sign * (float("inf") if val >= 49152 else val)


def test_hybrid_hand_computed_values():
    # 17 = 1.0625 * 2^4: m = 2, discarded bits 0x080000 -> f14 = 4096 >= t14 = 0 -> round up to 20 (TA gives 16).
    # 16.5: discarded 0x008000 -> f14 = 256 >= 0 -> 20.  2^-20 * 1.25 (DML): f14 = 0x200000 >> 9 = 4096 -> 2^-19.
    x = jnp.array([17.0, 16.5, 16.0, 3.3, -17.0, 1.25 * 2.0**-20, 1.0 * 2.0**-23], jnp.float32)
    got = np.asarray(hif8.round(x, rounding="hybrid"))
    assert got.tolist() == [20.0, 20.0, 16.0, float(hif8.round(jnp.float32(3.3))), -20.0, 2.0**-19, 2.0**-22]


def test_hybrid_matches_spec_transcription_and_brackets_x(mode):
    rng = np.random.default_rng(2)
    x = np.concatenate([
        (np.exp2(rng.uniform(-24, 16, 20_000)) * rng.choice([-1, 1], 20_000)).astype(np.float32),
        boundary_values(),
    ])
    got = np.asarray(fn(hif8.round, mode, rounding="hybrid")(jnp.asarray(x)))
    want = np.array([hybrid_reference(float(v)) for v in x], np.float32)
    assert same_bits(got, want).all()
    codes = np.asarray(hif8.encode(jnp.asarray(x), rounding="hybrid"))
    assert same_bits(oracle_decode(codes), got).all()
    # Every result is one of the two HiF8 neighbours of x (or TA's result where |E| < 4).
    grid = np.sort(np.unique(np.abs(oracle_decode(np.arange(256))[np.isfinite(oracle_decode(np.arange(256)))])))
    ax = np.abs(x).astype(np.float64)
    fin = np.isfinite(got) & (ax < 32768)
    lo = grid[np.searchsorted(grid, ax[fin], side="right") - 1]
    hi = grid[np.minimum(np.searchsorted(grid, ax[fin], side="left"), grid.size - 1)]
    g = np.abs(got[fin]).astype(np.float64)
    assert ((g == lo) | (g == hi)).all()
