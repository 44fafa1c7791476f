"""Stochastic rounding of NVFP4 and Four Over Six: bias over many draws, and the deterministic parts of
rounding="stochastic_unbiased" against an independent numpy/ml_dtypes oracle written from fouroversix's reference
(``quantize/pytorch/reference.py``: the 16/17 ``adjustment_factor`` in the encode scale, the block-scale divisor and
the 4/6 error's decode).

Unbiasedness test: N fake-quantizations with independent keys; per element z = (mean - x) / (sd / sqrt(N)). An
unbiased rounding keeps every |z| small (max over the elements below 5.5) and their mean near 0; a biased one shows
|z| in the tens (or an exactly repeated wrong value: zero variance, infinite z).
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlowfp import nvfp4

F32 = np.float32
A = 16 / 17
N_DRAWS = 2048
RULES = ("static_6", "static_4", "abs_max", "mae", "mse")
ME = {"static_6": (6, 448), "static_4": (4, 448), "abs_max": (6, 256), "mae": (6, 256), "mse": (6, 256)}


def data(shape=(8, 64), seed=0):
    """N(0,1) with a few blocks scaled by 1/8 and 8 (different E4M3 scale binades)."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(F32)
    x[1] *= F32(0.125)
    x[2] *= F32(8.0)
    return x


# every (x, rule, rounding, block shape) whose draws the tests below take: all drawn by one jitted program
BIAS_CASES = [(rule, rounding, (1, 16)) for rule in RULES for rounding in ("stochastic_unbiased", "stochastic")] + [
    ("static_6", "stochastic_unbiased", (16, 16)), ("mse", "stochastic_unbiased", (16, 16)),
    ("mse", "stochastic", (16, 16))]


@pytest.fixture(scope="module")
def draws():
    """{case: (x, N_DRAWS fake-quantizations)}: one compilation for every case instead of one per case."""
    xs = {(1, 16): data(), (16, 16): data((32, 32), seed=1)}
    keys = jax.random.split(jax.random.key(2024), N_DRAWS)

    @jax.jit
    def run(xs, keys):
        return {c: jax.vmap(lambda k, c=c: nvfp4.fake_quantize(xs[c[2]], rule=c[0], block_shape=c[2], rounding=c[1],
                                                                key=k))(keys) for c in BIAS_CASES}

    out = run(xs, keys)
    return {c: (xs[c[2]], np.asarray(out[c], np.float64)) for c in BIAS_CASES}


def bias_stats(draws, rule, rounding, block_shape=(1, 16)):
    """max |z|, the mean z (times sqrt(#elements): ~N(0, 1) when unbiased) and the relative magnitude bias
    Σ(|mean| - |x|) / Σ|x| of N_DRAWS fake-quantizations. The standard error of each element's mean is the exact
    one, (hi - lo) * s * S_dec * sqrt(p (1 - p) / N) with p = (y - lo) / (hi - lo), where the oracle knows the
    scale (every rule of "stochastic_unbiased", the static rules of "stochastic"); else (plain "stochastic" with a
    4/6 rule: the scale depends on the draw) the sample one, floored at 1e-3 |x| so rare up-draws that happen not
    to occur do not count as bias."""
    x, d = draws[rule, rounding, block_shape]
    mean, x64 = d.mean(0), x.astype(np.float64)
    rows = block_shape[0]
    if rounding == "stochastic_unbiased" or rule in ("static_6", "static_4"):
        sc, dec, y = oracle(x, rule, rows, A if rounding == "stochastic_unbiased" else 1.0)
        lo, hi = neighbours(np.minimum(y, F32(6)))
        p = np.where(hi > lo, (np.minimum(y, 6) - lo) / np.maximum(hi - lo, 1e-30), 0.0)
        se = (hi - lo) * sc[..., None, None].astype(np.float64) * float(dec) * np.sqrt(p * (1 - p) / N_DRAWS)
        se = untiles(se, x.shape, rows)
        tol = 1e-6 * np.abs(x64) + 1e-30  # float32 rounding of x * inv and (q * s) * S_dec
    else:
        se, tol = d.std(0) / np.sqrt(N_DRAWS), 1e-3 * np.abs(x64)
    z = (mean - x64) / np.maximum(se, tol)
    return dict(max_abs_z=float(np.abs(z).max()), mean_z=float(z.mean() * np.sqrt(z.size)),
                magnitude_bias=float((np.abs(mean) - np.abs(x64)).sum() / np.abs(x64).sum()))


@pytest.mark.parametrize("rule", RULES)
def test_stochastic_unbiased_is_unbiased_and_stochastic_is_not(rule, record_property, draws):
    """For every rule rounding="stochastic_unbiased" averages to x. Plain "stochastic" is biased where it can be:
    static_6 block maxima saturate at 6 where the E4M3 scale rounded down, and a 4/6 rule keeps the candidate whose
    draw landed closer; static_4 (block max at 4 * 17/16 at most) never saturates and is unbiased too."""
    unb = bias_stats(draws, rule, "stochastic_unbiased")
    sto = bias_stats(draws, rule, "stochastic")
    for k, v in unb.items():
        record_property(f"unbiased_{k}", v)
    for k, v in sto.items():
        record_property(f"stochastic_{k}", v)
    print(f"\n{rule:9s} stochastic_unbiased {unb}\n{'':9s} stochastic          {sto}")
    assert unb["max_abs_z"] < 5.5 and abs(unb["mean_z"]) < 4, unb
    if rule == "static_4":
        assert sto["max_abs_z"] < 5.5 and abs(sto["mean_z"]) < 4, sto
    else:
        assert sto["max_abs_z"] > 10, sto


def test_unbiased_on_16x16_tiles(draws):
    for rule in ("static_6", "mse"):
        s = bias_stats(draws, rule, "stochastic_unbiased", (16, 16))
        assert s["max_abs_z"] < 5.5 and abs(s["mean_z"]) < 4, (rule, s)
    s = bias_stats(draws, "mse", "stochastic", (16, 16))
    assert s["max_abs_z"] > 10, s


# ---- the deterministic parts, against an independent oracle ------------------------------------------------------


def e4m3(v):
    return np.minimum(v, F32(448)).astype(ml_dtypes.float8_e4m3fn).astype(F32)


def e2m1(y):
    return np.minimum(y, F32(6)).astype(ml_dtypes.float4_e2m1fn).astype(F32)


def tiles(x, rows):
    if rows == 1:
        return x.reshape(*x.shape[:-1], x.shape[-1] // 16, 1, 16)
    m, k = x.shape[-2:]
    return x.reshape(*x.shape[:-2], m // 16, 16, k // 16, 16).swapaxes(-3, -2)


def untiles(xb, shape, rows):
    return xb.reshape(shape) if rows == 1 else xb.swapaxes(-3, -2).reshape(shape)


GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], F32)


def neighbours(y):
    """The E2M1 grid values lo <= y <= hi around y in [0, 6] (lo == hi on the grid)."""
    return GRID[np.searchsorted(GRID, y, side="right") - 1], GRID[np.minimum(np.searchsorted(GRID, y, side="left"), 7)]


def oracle(x, rule, rows, adjust):
    """fouroversix's constants (each Python double product rounded once to float32), numpy float32 arithmetic; the
    4/6 choice from the round-to-nearest candidates' error ((q*s)*amax) / f32(6*256*a), sequential sums."""
    m, e = ME[rule]
    xf = x.astype(F32)
    amax = F32(np.abs(xf).max())
    enc = F32(m * e * adjust) / amax
    dec = F32(1) / enc
    xb = np.abs(tiles(xf, rows))
    base = (xb.max(axis=(-2, -1)) / F32(m * adjust)) * enc
    cands = [e4m3(base)] + ([e4m3(base * F32(1.5))] if rule in ("abs_max", "mae", "mse") else [])
    ys = [xb * (F32(1) / (s * dec))[..., None, None] for s in cands]
    if len(cands) == 1:
        return cands[0], dec, ys[0]
    errs = []
    for s, y in zip(cands, ys):
        dd = ((e2m1(y) * s[..., None, None]) * amax) / F32(m * e * adjust) - xb
        if rule == "abs_max":
            errs.append(np.abs(dd).max(axis=(-2, -1)))
            continue
        t = dd * dd if rule == "mse" else np.abs(dd)
        acc = t[..., 0]
        for j in range(1, 16):
            acc = acc + t[..., j]
        while acc.shape[-1] > 1:
            acc = acc[..., : acc.shape[-1] // 2] + acc[..., acc.shape[-1] // 2 :]
        errs.append(acc[..., 0])
    map4 = errs[1] < errs[0]
    return np.where(map4, cands[1], cands[0]), dec, np.where(map4[..., None, None], ys[1], ys[0])


SHAPES_DTYPES = [((1, 16), np.float32), ((16, 16), ml_dtypes.bfloat16)]


@pytest.fixture(scope="module")
def unbiased_q():
    """{(rule, block_shape): (x, quantize(x, rounding="stochastic_unbiased"))} for every rule and both block shapes,
    from one jitted program (one compilation instead of ten)."""
    x0 = data((32, 64), seed=3) * np.exp(np.random.default_rng(4).uniform(-3, 3, (32, 1)))
    xs = {bs: x0.astype(dtype) for bs, dtype in SHAPES_DTYPES}
    q = jax.jit(lambda xs, k: {(rule, bs): nvfp4.quantize(xs[bs], rule=rule, block_shape=bs,
                                                          rounding="stochastic_unbiased", key=k)
                               for rule in RULES for bs, _ in SHAPES_DTYPES})(xs, jax.random.key(5))
    return {c: (xs[c[1]], v) for c, v in q.items()}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("block_shape,dtype", SHAPES_DTYPES, ids=["1x16-f32", "16x16-bf16"])
def test_stochastic_unbiased_scales_choice_and_neighbours(rule, block_shape, dtype, unbiased_q):
    """Block scales (hence the 4/6 choice), the global scale and every element's two candidate values equal the
    oracle's; with the 16/17 headroom no scaled value exceeds 6, where the plain constants do saturate some."""
    rows = block_shape[0]
    x, q = unbiased_q[rule, block_shape]
    assert x.dtype == dtype
    s, dec, y = oracle(x, rule, rows, A)
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), s.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    assert np.float32(q.global_scale).tobytes() == dec.tobytes()
    assert y.max() <= 6.0
    nib = np.stack([np.asarray(q.codes) & 0xF, np.asarray(q.codes) >> 4], -1).reshape(x.shape)
    got = np.abs(tiles(nib.view(ml_dtypes.float4_e2m1fn).astype(F32), rows))
    lo, hi = neighbours(y)
    assert ((got == lo) | (got == hi)).all()
    assert (got == hi).any() and (got != e2m1(y)).any()  # really stochastic, not round-to-nearest
    if rule in ("static_6", "abs_max"):
        assert oracle(x, rule, rows, 1.0)[2].max() > 6.0  # without the factor some block maxima saturate


def test_stochastic_unbiased_reproducible_and_refusals():
    x = data()
    k = jax.random.key(9)
    kw = dict(rule="mse", rounding="stochastic_unbiased")
    q1, q2 = nvfp4.quantize(x, key=k, **kw), nvfp4.quantize(x, key=k, **kw)
    np.testing.assert_array_equal(np.asarray(q1.codes), np.asarray(q2.codes))
    assert (np.asarray(q1.codes) != np.asarray(nvfp4.quantize(x, key=jax.random.key(10), **kw).codes)).any()
    fq = nvfp4.fake_quantize(x, key=k, **kw)
    np.testing.assert_array_equal(np.asarray(fq), np.asarray(nvfp4.dequantize(q1)))
    np.testing.assert_array_equal(np.asarray(nvfp4.selected_map4(x, key=k, **kw)),
                                  np.asarray(nvfp4.selected_map4(x, rule="mse", rounding="stochastic_unbiased",
                                                                 key=jax.random.key(11))))  # draw-independent
    cfg = nvfp4.NVFP4Config(rule="abs_max", rounding="stochastic_unbiased")
    assert cfg.rounding == "stochastic_unbiased"
    with pytest.raises(ValueError, match="rounding='stochastic_unbiased' needs a PRNG key"):
        nvfp4.fake_quantize(x, rounding="stochastic_unbiased")
    with pytest.raises(ValueError, match="no stochastic rounding.*stochastic_unbiased"):
        nvfp4.fake_quantize(x, rounding="stochastic_unbiased", key=k, impl="pallas")
    with pytest.raises(ValueError, match="rounding='unbiased' is not supported"):
        nvfp4.NVFP4Config(rounding="unbiased")
    y, t = jax.jvp(lambda v: nvfp4.fake_quantize(v, key=k, **kw), (x,), (jnp.ones_like(x),))
    assert np.isfinite(np.asarray(t)).all()
