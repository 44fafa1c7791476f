"""Pallas NVFP4 kernels (interpret mode) against an independent numpy/ml_dtypes oracle and the jnp twin.

The oracle below is written from docs/formats/nvfp4.md with numpy float32 arithmetic (IEEE, one rounding per op, no FMA)
and ml_dtypes casts for E4M3 and E2M1 (round to nearest even); it shares no code with jaxlowfp.nvfp4 or the kernel.
Blocks holding NaN or Inf must get a NaN scale (their codes are meaningless: they decode to NaN) and are compared
on that alone.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxlowfp
from jaxlowfp import nvfp4
from jaxlowfp.dispatch import INTERPRET_ENV, PallasUnavailableError
from jaxlowfp_pallas import nvfp4 as pk

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
RULES = ("static_6", "static_4", "abs_max", "mae", "mse")
DTYPES = (np.float32, ml_dtypes.bfloat16, np.float16)
TILE = (16, 128)  # on the [48, 320] view: 3 x 3 grid steps, the last column tile ragged


# ---- independent oracle ------------------------------------------------------------------------------------------


def _blocks(x: np.ndarray, rows: int) -> np.ndarray:
    """[..., M, K] -> [..., M, K/16, 1, 16] or [..., M/16, K/16, 16, 16]."""
    k = x.shape[-1]
    if rows == 1:
        return x.reshape(*x.shape[:-1], k // 16, 1, 16)
    m = x.shape[-2]
    return x.reshape(*x.shape[:-2], m // 16, 16, k // 16, 16).swapaxes(-3, -2)


def _unblocks(b: np.ndarray, shape, rows: int) -> np.ndarray:
    return b.reshape(shape) if rows == 1 else b.swapaxes(-3, -2).reshape(shape)


def oracle(x: np.ndarray, rule: str, block_shape, global_amax=None) -> dict:
    """NVFP4 with numpy float32 and ml_dtypes casts (docs/formats/nvfp4.md sections 0, 3.3, 4.1)."""
    m_, e_ = {"static_6": (6, 448), "static_4": (4, 448)}.get(rule, (6, 256))
    xf = x.astype(F32)
    rows = block_shape[0]
    with np.errstate(all="ignore"):
        amax = F32(np.max(np.abs(xf))) if global_amax is None else F32(global_amax)
        s_enc = F32(0) + np.minimum(F32(m_ * e_) / amax, FLT_MAX)
        s_enc = F32(1) if amax == 0 else (s_enc if np.isfinite(amax) else F32(np.nan))
        s_dec = F32(1) / s_enc
        xb = _blocks(xf, rows)
        blk = np.max(np.abs(xb), axis=(-2, -1))  # numpy's max propagates NaN
        finite = np.isfinite(blk)
        base = (blk / F32(m_)) * s_enc

        def e4m3(v):
            s = np.minimum(v, F32(448)).astype(ml_dtypes.float8_e4m3fn).astype(F32)
            return np.where(finite, s, F32(np.nan))

        def candidate(s):
            inv = np.minimum(F32(1) / (s * s_dec), FLT_MAX)
            y = xb * inv[..., None, None]
            e2 = np.clip(y, -6, 6).astype(ml_dtypes.float4_e2m1fn)
            zero = (s == 0)[..., None, None]
            return np.where(zero, 0, e2.view(np.uint8)), np.where(zero, F32(0), e2.astype(F32))

        def error(q, s):
            d = ((q * s[..., None, None]) * amax) / F32(m_ * e_) - xb
            if rule == "abs_max":
                return np.max(np.abs(d), axis=(-2, -1))
            t = d * d if rule == "mse" else np.abs(d)
            acc = t[..., 0]
            for j in range(1, 16):  # columns in order, one IEEE add each
                acc = acc + t[..., j]
            while acc.shape[-1] > 1:  # rows of a 16x16 tile: pairwise by halves
                h = acc.shape[-1] // 2
                acc = acc[..., :h] + acc[..., h:]
            return acc[..., 0]

        s6 = e4m3(base)
        nib, q = candidate(s6)
        s, near_ties, map4 = s6, 0, np.zeros(s6.shape, bool)
        if rule in ("abs_max", "mae", "mse"):
            s4 = e4m3(base * F32(1.5))
            nib4, q4 = candidate(s4)
            err6, err4 = error(q, s6), error(q4, s4)
            map4 = err4 < err6
            # blocks whose two different candidates have errors within 4 ulp: where another summation order
            # (e.g. fused multiply-adds on a GPU) could flip the choice
            near = np.abs(err4 - err6) <= 4 * np.spacing(np.maximum(err4, err6))
            near_ties = int(np.sum(near & (s4 != s6) & finite))
            sel = map4[..., None, None]
            nib, q, s = np.where(sel, nib4, nib), np.where(sel, q4, q), np.where(map4, s4, s6)
        fake = ((q * s[..., None, None]) * s_dec).astype(x.dtype)
    nib = _unblocks(nib.astype(np.uint8), x.shape, rows)
    codes = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return dict(codes=codes, scales=s, s_dec=s_dec, fake=_unblocks(fake, x.shape, rows), near_ties=near_ties,
                map4=map4, nan_blocks=~finite)


# ---- data ----------------------------------------------------------------------------------------------------------


def make_x(shape, dtype, *, specials: bool, seed: int = 0) -> np.ndarray:
    """Log-normal magnitudes over ~12 binades with zero, -0, tiny and saturating blocks (and NaN/Inf blocks)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * np.exp(1.5 * rng.standard_normal(shape))).astype(F32)
    f = x.reshape(-1, shape[-1])
    f[0, :16] = 0.0
    f[0, 16:32] = -0.0
    f[1, :16] *= 1e-30  # scale underflows: E4M3 subnormal or zero scales
    f[2, 32:48] = [6.0, -4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, 0.0]
    if specials:
        f[5, 17] = np.nan
        f[7, 40] = np.inf
        f[20, 300] = -np.inf
    return x.astype(dtype)


# ---- comparisons -----------------------------------------------------------------------------------------------


def _scale_bytes(scales) -> np.ndarray:
    return np.asarray(scales).view(np.uint8)


def _nan_block_mask(nan_blocks: np.ndarray, shape, rows: int) -> np.ndarray:
    """Per packed code byte: True where its block holds NaN/Inf."""
    per_elem = _unblocks(np.broadcast_to(nan_blocks[..., None, None], nan_blocks.shape + (rows, 16)), shape, rows)
    return per_elem[..., 0::2]


def _check_against(got: jaxlowfp.QArray, want_codes, want_scale_bytes, want_nan, nan_blocks, x, rows, what):
    gs = _scale_bytes(got.scales)
    gnan = np.isnan(np.asarray(got.scales.astype(jnp.float32)))
    np.testing.assert_array_equal(gnan, nan_blocks, err_msg=f"{what}: NaN scales must be exactly the NaN/Inf blocks")
    bad = (gs != want_scale_bytes) & ~(gnan & want_nan)
    bad &= ~nan_blocks
    assert not bad.any(), f"{what}: {bad.sum()} scale bytes differ, e.g. at {np.argwhere(bad)[:4].tolist()}"
    skip = _nan_block_mask(nan_blocks, x.shape, rows)
    badc = (np.asarray(got.codes) != want_codes) & ~skip
    assert not badc.any(), f"{what}: {badc.sum()} code bytes differ, e.g. at {np.argwhere(badc)[:4].tolist()}"


def _same_values(got, want, what):
    g, w = np.asarray(got), np.asarray(want)
    assert g.dtype == w.dtype and g.shape == w.shape, (what, g.dtype, w.dtype, g.shape, w.shape)
    gn, wn = np.isnan(g.astype(F32)), np.isnan(w.astype(F32))
    bad = (g.view(np.uint8 if g.itemsize == 1 else (np.uint16 if g.itemsize == 2 else np.uint32))
           != w.view(np.uint8 if w.itemsize == 1 else (np.uint16 if w.itemsize == 2 else np.uint32))) & ~(gn & wn)
    assert not bad.any(), f"{what}: {bad.sum()} values differ, e.g. got {g[bad][:4]} want {w[bad][:4]}"


def _id(v) -> str:
    if isinstance(v, tuple):
        return "x".join(map(str, v))
    return np.dtype(v).name if isinstance(v, type) else str(v)


QUANT_CASES = [
    (rule, bs, DTYPES[(i + j) % 3]) for i, rule in enumerate(RULES) for j, bs in enumerate([(1, 16), (16, 16)])
]


@pytest.mark.parametrize("rule,block_shape,dtype", QUANT_CASES, ids=_id)
def test_quantize_matches_oracle_and_twin(rule, block_shape, dtype, record_property):
    rows = block_shape[0]
    shape = (48, 320) if rows == 1 else (3, 16, 320)  # 16x16: leading axes fold into the same [48, 320] view
    twin = jax.jit(nvfp4.quantize, static_argnames=("rule", "block_shape"))
    decision_diffs = ties = 0
    for specials, global_amax in ((False, None), (True, 3.0)):
        x = make_x(shape, dtype, specials=specials)
        ga = None if global_amax is None else jnp.float32(global_amax)
        got = pk.quantize(jnp.asarray(x), rule=rule, block_shape=block_shape, global_amax=ga, interpret=True,
                          tile_shape=TILE)
        want = oracle(x, rule, block_shape, global_amax)
        assert got.scales.dtype == jnp.float8_e4m3fn and got.codes.dtype == jnp.uint8
        assert (got.rule, got.block_shape, got.shape, got.dtype) == (rule, block_shape, x.shape, jnp.dtype(dtype))
        want_bytes = want["scales"].astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        what = f"{rule} {block_shape} {np.dtype(dtype).name} global_amax={global_amax}"
        _check_against(got, want["codes"], want_bytes, np.isnan(want["scales"]), want["nan_blocks"], x, rows,
                       f"{what} vs oracle")
        assert np.float32(got.global_scale).tobytes() == want["s_dec"].tobytes(), what
        # the twin: bit for bit outside NaN/Inf blocks (there, see test_twin_nan_block_scale)
        t = twin(jnp.asarray(x), rule=rule, block_shape=block_shape, global_amax=ga)
        tb = _scale_bytes(t.scales)
        _check_against(got, np.asarray(t.codes), tb, np.isnan(np.asarray(t.scales.astype(jnp.float32))),
                       want["nan_blocks"], x, rows, f"{what} vs jnp twin")
        if rule in ("mae", "mse"):  # 4-vs-6 decisions: count differences and the near-ties present in the data
            decision_diffs += int(np.sum((_scale_bytes(got.scales) != want_bytes) & ~want["nan_blocks"]))
            ties += want["near_ties"]
            if not specials and rows == 1:
                assert 0 < want["map4"].mean() < 1, "both candidates must win somewhere"
    record_property("decision_differences", decision_diffs)
    record_property("near_ties_in_data", ties)
    assert decision_diffs == 0


FAKE_CASES = [
    ("static_6", (1, 16), ml_dtypes.bfloat16, TILE),
    ("mse", (1, 16), np.float32, TILE),
    ("abs_max", (16, 16), ml_dtypes.bfloat16, None),  # the default interpret tile: one grid step
]


@pytest.mark.parametrize("rule,block_shape,dtype,tile", FAKE_CASES, ids=_id)
def test_fake_quantize_matches_oracle_and_twin(rule, block_shape, dtype, tile):
    shape = (48, 320) if block_shape[0] == 1 else (3, 16, 320)
    for specials, global_amax in ((False, None), (True, 3.0)):
        x = make_x(shape, dtype, specials=specials, seed=1)
        ga = None if global_amax is None else jnp.float32(global_amax)
        got = pk.fake_quantize(jnp.asarray(x), rule=rule, block_shape=block_shape, global_amax=ga, interpret=True,
                               tile_shape=tile)
        want = oracle(x, rule, block_shape, global_amax)
        nan_elems = _unblocks(np.broadcast_to(want["nan_blocks"][..., None, None],
                                              want["nan_blocks"].shape + (block_shape[0], 16)), x.shape, block_shape[0])
        assert np.isnan(np.asarray(got, F32)[nan_elems]).all(), "a NaN/Inf block dequantizes to NaN"
        g = np.where(nan_elems, 0, np.asarray(got)).astype(x.dtype)
        _same_values(g, np.where(nan_elems, 0, want["fake"]).astype(x.dtype), f"{rule} fake vs oracle")
        t = jax.jit(nvfp4.fake_quantize, static_argnames=("rule", "block_shape"))(
            jnp.asarray(x), rule=rule, block_shape=block_shape, global_amax=ga)
        _same_values(g, np.where(nan_elems, 0, np.asarray(t)).astype(x.dtype), f"{rule} fake vs jnp twin")


def test_packaging_dequantize_and_user_jit():
    """The kernel's QArray dequantizes (jaxlowfp.nvfp4.dequantize) to the twin's fake-quant, inside a user jit
    with a traced global amax; the kernel wrapper's jit is reused across amax values."""
    x = jnp.asarray(make_x((48, 320), np.float32, specials=False, seed=2))
    f = jax.jit(lambda v, a: nvfp4.dequantize(
        pk.quantize(v, rule="static_6", global_amax=a, interpret=True, tile_shape=TILE), jnp.float32))
    twin = jax.jit(lambda v, a: nvfp4.fake_quantize(v, rule="static_6", global_amax=a))
    for a in (5.0, 40.0):
        want = twin(x, jnp.float32(a))
        _same_values(f(x, jnp.float32(a)), want, f"dequantize(kernel) vs twin fake, amax {a}")


def test_twin_nan_block_scale():
    """Documents a twin discrepancy for the lead: XLA:CPU's vectorised max can drop a NaN inside a 16-block, so
    jaxlowfp.nvfp4 may give such a block a finite scale instead of its documented NaN. The kernel (and the oracle)
    give NaN. Reported, not asserted on the twin."""
    x = make_x((48, 320), np.float32, specials=True)
    got = pk.quantize(jnp.asarray(x), rule="static_6", global_amax=jnp.float32(3.0), interpret=True, tile_shape=TILE)
    assert np.isnan(np.asarray(got.scales.astype(jnp.float32))[5, 1])


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(rounding="stochastic", key=jax.random.key(0)), ValueError, "rounding='nearest' only.*impl='xla'"),
        (dict(rule="max"), ValueError, "rule='max'"),
        (dict(block_shape=(4, 16)), ValueError, "block_shape"),
        (dict(tile_shape=(16, 96)), ValueError, "power of two"),
        (dict(tile_shape=512), ValueError, r"tile_shape must be a pair"),
        (dict(tile_shape=(8, 64), block_shape=(16, 16)), ValueError, r"tile rows \(bm\)"),
        (dict(tile_shape=(1024, 2048)), ValueError, "2\\^20"),
        (dict(global_amax=jnp.ones(2, jnp.float32)), ValueError, "global_amax must be a scalar"),
        (dict(x=np.ones((4, 24), np.float32)), ValueError, "multiple of 16"),
        (dict(x=np.ones((4, 32), np.float64)), TypeError, "float64"),
    ],
)
def test_bad_input(kwargs, err, match):
    args = dict(x=np.ones((16, 32), np.float32), interpret=True)
    args.update(kwargs)
    with pytest.raises(err, match=match):
        pk.quantize(args.pop("x"), **args)


def test_no_silent_interpret_on_cpu(monkeypatch):
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    with pytest.raises(PallasUnavailableError, match=r"nvfp4\.fake_quantize.*interpret=True"):
        pk.fake_quantize(jnp.ones((16, 32), jnp.float32))
    with pytest.raises(PallasUnavailableError, match=r"nvfp4\.quantize"):
        pk.quantize(jnp.ones((16, 32), jnp.float32))


@pytest.mark.parametrize("k", [1, 9])
def test_div_by_3_pow2_is_ieee(k):
    """The kernels' integer-exact fl(a / (3 * 2^k)) against numpy's IEEE float32 division, on random bit patterns
    (normals, subnormals, zeros, Inf, NaN) and results that land in the subnormal range."""
    from jaxlowfp._core.bits import div_by_3_pow2

    rng = np.random.default_rng(k)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    bits[:40_000] = rng.integers(0, 0x02000000, 40_000).astype(np.uint32)  # tiny: subnormal inputs and results
    bits[40_000:40_008] = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00000001, 0x00800000, 0x7F7FFFFF]
    a = bits.view(np.float32)
    got = np.asarray(jax.jit(div_by_3_pow2, static_argnums=1)(jnp.asarray(a), k))
    with np.errstate(all="ignore"):
        want = a / F32(3 * 2**k)
    _same_values(got, want, f"a / (3 * 2^{k})")
