"""NVFP4's per-block scale search (rule="search") and MS-EDEN rounding (rounding="ms_eden"), against numpy /
ml_dtypes oracles written from their definitions (the search: llm-compressor's nvfp4_expanded_mse range over the
E4M3 grid; MS-EDEN: fouroversix's Triton kernel ``kernels/triton/quartet_ii.py``, which has no CPU path, so no
reference run), plus MS-EDEN's statistical guarantee and its error against stochastic rounding."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlowfp import if4, nvfp4
from jaxlowfp._core import nvfp4_blocks as nb
from jaxlowfp.hadamard import hadamard_matrix

F32 = np.float32
E4M3_VALUES = np.unique(np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64))  # >= 0


def e4m3(v):
    """RNE to E4M3 with saturation at 448 (ml_dtypes' cast after clamping, docs/formats/nvfp4.md 2.2)."""
    return np.minimum(np.asarray(v, F32), F32(448)).astype(ml_dtypes.float8_e4m3fn).astype(F32)


def test_search_candidates_fit():
    """Every base in the E4M3 range has at most SEARCH_CODES codes between e4m3(0.81 base) and e4m3(1.8 base)."""
    base = np.concatenate([np.geomspace(2.0**-16, 256.0, 200_000).astype(F32), E4M3_VALUES.astype(F32)])
    codes = lambda v: e4m3(v).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(int)  # noqa: E731
    lo, hi = codes(base * F32(nb.SEARCH_RANGE[0])), codes(base * F32(nb.SEARCH_RANGE[1]))
    assert (hi - lo + 1).max() <= nb.SEARCH_CODES


def _data(shape=(64, 256), seed=0):
    g = np.random.default_rng(seed)
    x = g.standard_normal(shape).astype(F32)
    x[::7] = g.standard_t(3, (len(x[::7]), shape[1])).astype(F32)
    return x


def test_search_is_the_mse_minimum_and_never_worse_than_four_over_six():
    """float64 oracle: for each block, every E4M3 value in [e4m3(0.81 base), e4m3(1.8 base)] quantized with the
    NVFP4 element step, the one of least squared error (ties: the map-to-6 scale first). The chosen scale must agree
    wherever the best error beats the runner-up by more than float32 noise. Per block the search's MSE is at most
    4/6 mse's (its candidates include both of 4/6's), and overall it drops below 4/6's."""
    x = _data()
    q, y46, y6 = jax.jit(lambda v: (nvfp4.quantize(v, rule="search"), nvfp4.fake_quantize(v, rule="mse"),
                                    nvfp4.fake_quantize(v, rule="static_6")))(x)
    got = np.asarray(q.scales, np.float64)
    amax = np.abs(x).max()
    s_enc = F32(1536) / F32(amax)
    s_dec = F32(1) / s_enc
    xb = x.reshape(64, -1, 16)
    base = (np.abs(xb).max(-1) / F32(6)).astype(F32) * s_enc
    lo, hi = e4m3(base * F32(0.81)), e4m3(base * F32(1.8))
    cands = E4M3_VALUES[None, None, :]
    ok = (cands >= lo[..., None]) & (cands <= hi[..., None])
    inv = np.minimum(np.divide(1.0, cands * np.float64(s_dec), out=np.zeros_like(cands), where=cands > 0), 3.4e38)
    y = np.abs(xb)[..., None, :] * inv[..., None]
    qv = np.minimum(y, 6).astype(F32).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    err = ((qv * cands[..., None] * np.float64(s_dec) - np.abs(xb)[..., None, :]) ** 2).sum(-1)
    err = np.where(ok, err, np.inf)
    best = err.min(-1)
    s6 = e4m3(base).astype(np.float64)
    e6 = np.take_along_axis(err, np.searchsorted(E4M3_VALUES, s6)[..., None], -1)[..., 0]
    second = np.sort(err, -1)[..., 1]
    clear = second - best > 1e-4 * best
    want = E4M3_VALUES[err.argmin(-1)]
    assert clear.mean() > 0.9
    assert np.array_equal(got[clear], want[clear])
    assert np.array_equal(got[e6 == best], s6[e6 == best])  # s6 among the best: kept (ties keep map-to-6)
    assert 0.3 < (got != s6).mean() < 0.95  # the search moves most blocks off map-to-6

    x64 = x.astype(np.float64).reshape(xb.shape)
    e_search, e46, e_6 = (((np.asarray(v, np.float64).reshape(xb.shape) - x64) ** 2).sum(-1)
                          for v in (q.dequantize(), y46, y6))
    assert np.all(e_search <= e46 * (1 + 1e-6))
    assert e_search.sum() < 0.95 * e46.sum() < e_6.sum()


def test_search_tiles_and_errors():
    x = jnp.asarray(_data((32, 64), seed=2))
    q, q46 = jax.jit(lambda v: [nvfp4.quantize(v, rule=r, block_shape=(16, 16)) for r in ("search", "mse")])(x)
    assert q.scales.shape == (2, 4) and q.rule == "search"
    err = lambda y: float(jnp.sum((y - x) ** 2))  # noqa: E731
    assert err(q.dequantize()) <= err(q46.dequantize())
    with pytest.raises(ValueError, match="rounding='nearest' only"):
        nvfp4.quantize(x, rule="search", rounding="stochastic", key=jax.random.key(0))
    with pytest.raises(ValueError, match="kernel implements the rules"):
        nvfp4.quantize(x, rule="search", impl="pallas")


# ---- MS-EDEN


def eden_oracle(x):
    """numpy transcription of eden_1x16s_fp4_kernel (NVFP4, 1x16, no Hadamard: the caller rotates): S_dec, the
    round-to-nearest scale s, the E2M1 values q (ties away from zero) and the corrected scale c (float64)."""
    val_max = F32(6.0 / ((17 / 16) * 0.93))
    amax = F32(np.abs(x).max())
    s_dec = F32(F32(amax / F32(255.99)) / val_max)
    xb = x.reshape(x.shape[0], -1, 16)
    s = e4m3((np.abs(xb).max(-1) / val_max).astype(F32) / s_dec)
    s = np.where(s == 0, F32(1), s)
    y = (xb / (s * s_dec)[..., None]).astype(F32)
    a = np.abs(y)
    q = np.select([a >= 5, a >= 3.5, a >= 2.5, a >= 1.75, a >= 1.25, a >= 0.75, a >= 0.25],
                  [6, 4, 3, 2, 1.5, 1, 0.5], 0.0)
    y64 = y.astype(np.float64)
    c = s * (y64 * y64).sum(-1) / (np.abs(y64) * q).sum(-1)
    return s_dec, s, q, c


def _neighbours(c):
    """Largest E4M3 value <= c and smallest >= c, each widened by a relative 1e-6 (float32 vs float64 sums)."""
    i_lo = np.searchsorted(E4M3_VALUES, c * (1 - 1e-6), side="right") - 1
    i_hi = np.searchsorted(E4M3_VALUES, c * (1 + 1e-6), side="left")
    return E4M3_VALUES[i_lo], E4M3_VALUES[np.minimum(i_hi, len(E4M3_VALUES) - 1)]


def test_ms_eden_against_the_kernel_oracle():
    """Codes (E2M1 of the round-to-nearest scale, ties away), S_dec, and every draw's scale one of the two E4M3
    neighbours of the corrected scale c; the mean over draws is c (z-scores: the scale's stochastic rounding is
    unbiased). And E[<x̂, x>] = <x, x> for every 16-block (EDEN's correction), without any rotation, from the same
    draws' dequantized values."""
    x = _data((8, 64), seed=3)
    s_dec, s, q, c = eden_oracle(x)
    keys = jax.random.split(jax.random.key(5), 2048)
    run = jax.jit(jax.vmap(lambda k: nvfp4.quantize(x, rule="static_6", rounding="ms_eden", key=k)))
    arr = run(keys)
    assert np.asarray(arr.global_scale)[0].tobytes() == s_dec.tobytes()
    codes = np.asarray(arr.codes[0])
    nib = np.stack([codes & 15, codes >> 4], -1).reshape(x.shape)
    mag = (nib & 7).astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    assert np.array_equal(mag, q.reshape(x.shape))
    assert np.array_equal(np.asarray(arr.codes), np.broadcast_to(codes, arr.codes.shape))  # codes: draw-free
    sc = np.asarray(arr.scales, np.float64)  # [draws, 8, 4]
    lo, hi = _neighbours(c)
    assert np.all((sc >= lo) & (sc <= hi))
    gap = hi - lo
    p = np.where(gap > 0, (c - lo) / np.where(gap > 0, gap, 1), 0)
    se = gap * np.sqrt(p * (1 - p) / len(keys))
    z = (sc.mean(0) - c) / np.maximum(se, 1e-6 * c)
    assert np.abs(z).max() < 5.5, np.abs(z).max()
    # the projection per block: 2048 draws, 32 blocks, |z| < 5.5 (a false failure about 32 * 4e-8)
    d = np.asarray(jax.jit(jax.vmap(lambda a: a.dequantize()))(arr), np.float64)
    xb = x.reshape(8, 4, 16).astype(np.float64)
    ratio = (d.reshape(-1, 8, 4, 16) * xb).sum(-1) / (xb * xb).sum(-1)
    z = (ratio.mean(0) - 1) / (ratio.std(0) / np.sqrt(len(keys)) + 1e-9)
    assert np.abs(z).max() < 5.5, np.abs(z).max()


def _rotated_draws(roundings, n, fmt="nvfp4"):
    """n draws of H^T Q(H D x) D (the 16-point Hadamard with fresh random signs D per draw), x 8 x 64 Gaussian, for
    each rounding (one jitted program for all)."""
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(F32)
    h = jnp.asarray(hadamard_matrix(), jnp.float32)

    def one(k, rounding):
        ks, kq = jax.random.split(k)
        d = jnp.where(jax.random.bernoulli(ks, 0.5, (1, 64)), 1.0, -1.0).astype(jnp.float32)
        xr = ((x * d).reshape(-1, 16) @ h).reshape(x.shape)
        if fmt == "nvfp4":
            y = nvfp4.fake_quantize(xr, rule="static_6", rounding=rounding, key=kq)
        else:
            y = if4.fake_quantize(xr, rounding=rounding, key=kq)
        return (y.reshape(-1, 16) @ h.T).reshape(x.shape) * d

    keys = jax.random.split(jax.random.key(1), n)  # the same keys for every rounding, as separate calls had
    out = jax.jit(lambda k: [jax.vmap(lambda kk, r=r: one(kk, r))(k) for r in roundings])(keys)
    return x.astype(np.float64), [np.asarray(o, np.float64) for o in out]


@pytest.mark.parametrize("fmt", ["nvfp4"])  # IF4's MS-EDEN: tests/test_if4.py, bench/nvfp4.py
def test_ms_eden_statistics_against_stochastic_rounding(fmt, record_property):
    """Quartet II's claim, measured: behind a random-sign RHT, MS-EDEN's error per draw is far below stochastic
    rounding's (round-to-nearest level: 0.0093 vs 0.0235 relative for NVFP4 on N(0,1)), every block's projection
    <x̂, x> is unbiased, and what remains of an element-wise bias is tiny (EDEN is exactly unbiased for a uniformly
    random rotation; a 16-point Hadamard with random signs is not one: relative bias² about 6e-6, 1/1500 of the
    per-draw error, detectable after a few thousand draws)."""
    n = 1024
    x, (eden, sr) = _rotated_draws(("ms_eden", "stochastic_unbiased"), n, fmt)
    p = (x**2).mean()
    mse_eden, mse_sr = ((eden - x) ** 2).mean() / p, ((sr - x) ** 2).mean() / p
    bias2 = ((eden.mean(0) - x) ** 2).mean() / p
    blocks = lambda a: a.reshape(*a.shape[:-1], -1, 16)  # noqa: E731
    ratio = (blocks(eden) * blocks(x)).sum(-1) / (blocks(x) ** 2).sum(-1)  # per draw: <x̂, x> / <x, x>
    z_dir = (ratio.mean(0) - 1) / (ratio.std(0) / np.sqrt(n))
    for k, v in dict(mse_eden=mse_eden, mse_sr=mse_sr, bias2=bias2, max_z_dir=np.abs(z_dir).max()).items():
        record_property(k, float(v))
    print(f"\n{fmt}: MS-EDEN {mse_eden:.5f}, stochastic_unbiased {mse_sr:.5f} per draw; bias^2 {bias2:.2e}")
    assert mse_eden < 0.5 * mse_sr
    assert bias2 < 5e-5
    assert np.abs(z_dir).max() < 5.5  # per rotated-back block the projection stays unbiased too


def test_ms_eden_validation():
    x = jnp.ones((2, 32))
    with pytest.raises(ValueError, match="rule='static_6', block_shape=\\(1, 16\\)"):
        nvfp4.quantize(x, rule="mse", rounding="ms_eden", key=jax.random.key(0))
    with pytest.raises(ValueError, match="needs a PRNG key"):
        nvfp4.quantize(x, rule="static_6", rounding="ms_eden")
    with pytest.raises(ValueError, match="no stochastic rounding"):
        nvfp4.quantize(x, rule="static_6", rounding="ms_eden", key=jax.random.key(0), impl="pallas")
