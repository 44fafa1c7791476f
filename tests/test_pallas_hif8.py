"""Pallas HiF8 scaled fake-quant (interpret mode) against en_dtypes and the jnp twin, bit for bit.

The twin is ``jaxlowfp.qat.scaled_round`` (values and saturated count). The amax and the counters are checked
against numpy: XLA:CPU's ``jnp.max`` can drop a NaN (test_amax_nan_where_xla_cpu_max_drops_it); numpy cannot.
"""
from __future__ import annotations

import en_dtypes
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxlowfp import hif8, qat
from jaxlowfp.dispatch import INTERPRET_ENV, PallasUnavailableError
from jaxlowfp_pallas import hif8 as phif8


_twin = jax.jit(lambda x, scale, clip: qat.scaled_round(x, scale, clip, "hif8"), static_argnums=2)


def _oracle(x: np.ndarray, scale: float, clip: float):
    """Independent numpy reference: en_dtypes does the HiF8 rounding (float32 IEEE arithmetic elsewhere)."""
    xf = x.astype(np.float32)
    s = np.float32(scale)
    xs = xf * (np.float32(1.0) / s)
    with np.errstate(invalid="ignore"):
        c = np.clip(xs, -clip, clip)
    y = (c.astype(en_dtypes.hifloat8).astype(np.float32) * s).astype(x.dtype)
    amax = np.float32(np.max(np.abs(xf)))
    with np.errstate(invalid="ignore"):
        sat = int(np.sum(np.abs(xs) > clip))
    under = int(np.sum((xf != 0) & (y.astype(np.float32) == 0)))
    return y, amax, sat, int(np.sum(~np.isfinite(xf))), under


NAMES = ("y", "amax", "saturated", "nonfinite", "underflow")


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def _assert_same(got, want, what: str):
    """Bit-equal, except that any NaN must meet a NaN (the NaN payload after `* scale` is hardware-defined)."""
    g, w = np.asarray(got), np.asarray(want)
    assert g.dtype == w.dtype and g.shape == w.shape, (what, g.dtype, w.dtype, g.shape, w.shape)
    gn, wn = np.isnan(g.astype(np.float32)), np.isnan(w.astype(np.float32))
    np.testing.assert_array_equal(gn, wn, err_msg=f"{what}: NaN positions differ")
    bad = (_bits(g) != _bits(w)) & ~gn
    assert not bad.any(), f"{what}: {bad.sum()} elements differ, e.g. got {g[bad][:5]} want {w[bad][:5]}"


def _hard_values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Log-uniform magnitudes over 40 binades, exact HiF8 rounding ties, specials and whole special blocks."""
    n = int(np.prod(shape))
    x = (rng.choice([-1.0, 1.0], n) * np.exp2(rng.uniform(-30, 12, n))).astype(np.float32)
    grid = np.unique(np.abs(np.asarray(hif8.all_values())[np.isfinite(hif8.all_values())]))
    ties = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)  # midpoints: TA rounds them away from zero
    k = min(len(ties), n // 4)
    x[:k] = ties[:k] * rng.choice([-1.0, 1.0], k)
    x[k : k + 10] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 15.0, -15.0, 15.000001, 1e-12, -3e-12]  # last: underflow
    x[-40:-20] = 0.0  # a zero run crossing a block edge
    return x.reshape(shape)


CASES = [  # (shape, dtype, scale, clip, block_size): ragged grids of 3..35 steps
    ((37, 29), np.float32, 0.375, 15.0, 128),
    ((5, 300), ml_dtypes.bfloat16, 2.0**-7, 15.0, 256),
    ((1111,), np.float32, 1.0, 32768.0, 64),
    ((3, 7, 50), np.float16, 3.0e-3, 224.0, 512),
]


@pytest.mark.parametrize("shape,dtype,scale,clip,block", CASES)
def test_matches_en_dtypes_and_jnp_twin(shape, dtype, scale, clip, block):
    x = _hard_values(np.random.default_rng(len(shape) + block), shape).astype(dtype)
    got = phif8.scaled_fake_quant(jnp.asarray(x), jnp.float32(scale), clip, interpret=True, block_size=block)
    y_twin, sat_twin = _twin(jnp.asarray(x), jnp.float32(scale), clip)
    _assert_same(got.y, y_twin, "y vs jnp twin")
    _assert_same(got.saturated_count, sat_twin, "saturated count vs jnp twin")
    for name, g, w in zip(NAMES, got, _oracle(x, scale, clip)):
        _assert_same(g, np.asarray(w, dtype=np.asarray(g).dtype), f"{name} vs en_dtypes/numpy oracle")
    assert np.isnan(got.amax) and int(got.nonfinite_count) == 3  # one NaN, two infinities were planted
    assert int(got.underflow_count) > 0 or dtype == np.float16  # float16 flushes 1e-12 to zero already


def test_amax_without_nan_and_special_blocks():
    """NaN-free amax (Inf wins), an all-NaN block, an all-zero block and a block that is only padding."""
    block = 64
    x = np.ones(block * 3 + 5, np.float32)
    x[:block] = np.nan  # whole first block NaN
    x[block : 2 * block] = 0.0
    x[2 * block + 3] = -np.inf
    got = phif8.scaled_fake_quant(jnp.asarray(x), 0.5, 15.0, interpret=True, block_size=block)
    for name, g, w in zip(NAMES, got, _oracle(x, 0.5, 15.0)):
        _assert_same(g, np.asarray(w, dtype=np.asarray(g).dtype), name)
    x[:block] = -7.0  # now no NaN: amax must be the Inf
    got = phif8.scaled_fake_quant(jnp.asarray(x), 0.5, 15.0, interpret=True, block_size=block)
    assert float(got.amax) == np.inf and int(got.saturated_count) == 1 and int(got.nonfinite_count) == 1


def test_amax_nan_where_xla_cpu_max_drops_it(record_property):
    """Why amax is checked against numpy and the kernel counts NaN explicitly: on XLA:CPU (jax 0.12) a jitted
    ``jnp.max(jnp.abs(x))`` over 4096 elements with one NaN returned a number. The kernel must return NaN."""
    x = np.ones(4096, np.float32)
    x[81] = np.nan
    record_property("xla_cpu_max_dropped_nan", bool(not np.isnan(jax.jit(lambda v: jnp.max(jnp.abs(v)))(x))))
    got = phif8.scaled_fake_quant(jnp.asarray(x), 1.0, 15.0, interpret=True)
    assert np.isnan(got.amax) and int(got.nonfinite_count) == 1


def test_inside_user_jit_and_no_retrace():
    """Called from a user's jit with a traced scale; equal to the twin; the kernel wrapper is traced once."""
    x = jnp.asarray(_hard_values(np.random.default_rng(7), (8, 96)))
    f = jax.jit(lambda x, s: phif8.scaled_fake_quant(x, s, 15.0, interpret=True, block_size=256))
    before = phif8._scaled_fake_quant._cache_size()
    for s in (0.25, 3.0):
        got = f(x, jnp.float32(s))
        y, sat = _twin(x, jnp.float32(s), 15.0)
        _assert_same(got.y, y, "y")
        _assert_same(got.saturated_count, sat, "saturated")
    assert phif8._scaled_fake_quant._cache_size() - before <= 1


def test_default_block_interpret_single_step():
    x = jnp.asarray(np.linspace(-40, 40, 3000, dtype=np.float32))
    got = phif8.scaled_fake_quant(x, 2.0, 15.0, interpret=True)
    for name, g, w in zip(NAMES, got, _oracle(np.asarray(x), 2.0, 15.0)):
        _assert_same(g, np.asarray(w, dtype=np.asarray(g).dtype), name)


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(x=np.ones(4, np.float64)), TypeError, "float64"),
        (dict(x=np.ones(4, np.int32)), TypeError, "int32"),
        (dict(x=np.ones((0, 4), np.float32)), ValueError, "at least one element"),
        (dict(scale=jnp.bfloat16(1.0)), TypeError, "scale must be a float32 scalar"),
        (dict(scale=jnp.ones(3, jnp.float32)), TypeError, "scale must be a float32 scalar"),
        (dict(scale=jnp.ones((1,), jnp.float32)), TypeError, "scale must be a float32 scalar"),
        (dict(clip=0.0), ValueError, r"clip=0.0 must be in \(0, 32768"),
        (dict(clip=40000.0), ValueError, "range of hif8"),
        (dict(clip=jnp.float32(15.0)), TypeError, "clip must be a Python number"),
        (dict(block_size=96), ValueError, "power of two"),
        (dict(block_size=1 << 21), ValueError, "power of two"),
        (dict(interpret="yes"), TypeError, "interpret must be"),
    ],
)
def test_bad_input(kwargs, err, match):
    args = dict(x=np.ones(4, np.float32), scale=1.0, clip=15.0, interpret=True)
    args.update(kwargs)
    with pytest.raises(err, match=match):
        phif8.scaled_fake_quant(args.pop("x"), args.pop("scale"), args.pop("clip"), **args)


def test_no_silent_interpret_on_cpu(monkeypatch):
    """interpret=None on a CPU: a clear error naming the kernel, unless the env var asks for interpret mode."""
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    x = jnp.ones(8, jnp.float32)
    with pytest.raises(PallasUnavailableError, match=r"hif8\.scaled_fake_quant.*interpret=True"):
        phif8.scaled_fake_quant(x, 1.0, 15.0)
    monkeypatch.setenv(INTERPRET_ENV, "1")
    y, amax, sat, nonfinite, under = phif8.scaled_fake_quant(x, 1.0, 15.0)
    assert float(amax) == 1.0 and int(sat) == int(nonfinite) == int(under) == 0 and float(y[0]) == 1.0
