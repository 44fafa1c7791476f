"""The per-block NVFP4 / Four Over Six math, the quantized-array type and argument checks (docs/formats/nvfp4.md).

Shared by :mod:`jaxlowfp.nvfp4` (the public API: jit, kernel dispatch) and the Pallas kernel
(``pallas_kernels/nvfp4.py``), which reproduces :func:`quantize_blocks` bit for bit. Two-level scaling, every step
one IEEE float32 rounding::

    S_enc  = min(M*E / amax, FLT_MAX)   (1 if amax == 0);   S_dec = 1 / S_enc
    base   = (blk_amax / M) * S_enc;    s = E4M3_RNE_satfinite(base)   (4/6: s4 = e4m3(base * 1.5))
    inv    = min(1 / (s * S_dec), FLT_MAX);   q_i = E2M1_RNE_satfinite(x_i * inv);   x̂_i = (q_i * s) * S_dec

No operation needs a full-size divisor, a barrier or row chunking: divisions by constants are integer-exact
(:func:`~jaxlowfp._core.bits.div_const`), the 4/6 error's ``((q*s)*amax) / (M*E)`` is a per-block quotient times a
power of two (:func:`block_errors`), and each reduction reads the tensor once.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlowfp._core import names as _names
from jaxlowfp._core.bits import FLT_MAX, SIGN, div_const, from_bits, ieee_div, materialize, no_contract, u32
from jaxlowfp._core.reduce import abs_max, accumulate_error, column_loop, combine_rows, pairwise_rows, unrolled
from jaxlowfp._core.checks import float_input, one_of
from jaxlowfp._core.minifloat import E2M1_THRESHOLDS, E2M1, E4M3


class BlockConfig(Protocol):
    """What the argument checks read of a block-format config (NVFP4Config, and the IF formats' IFConfig)."""

    @property
    def block_shape(self) -> tuple[int, int]: ...

    @property
    def rounding(self) -> str: ...

    @property
    def rows(self) -> int: ...


NVFP4Rule = Literal["static_6", "static_4", "abs_max", "mae", "mse", "search"]
Rounding = Literal["nearest", "stochastic", "stochastic_unbiased", "ms_eden"]
KERNEL_RULES = _names.NVFP4_KERNEL_RULES  # the rules the Pallas kernels implement
RULES = _names.NVFP4_RULES  # every accepted rule; "search": the per-block E4M3 scale search (jnp only)
FOUR_OVER_SIX = _names.NVFP4_FOUR_OVER_SIX
ROUNDINGS = _names.ROUNDINGS
STOCHASTIC = ("stochastic", "stochastic_unbiased", "ms_eden")  # the roundings that need a PRNG key
# Scale search (rule="search"): every E4M3 scale from e4m3(base * 0.81) to e4m3(base * 1.8), the range of
# llm-compressor's nvfp4_expanded_mse grid (1.8 * (1 - i / 200), i < 111); at most SEARCH_CODES codes (a test
# sweeps every base).
SEARCH_RANGE = (0.81, 1.8)
SEARCH_CODES = 12
# MS-EDEN (rounding="ms_eden", Quartet II, arXiv 2601.22813), constants of fouroversix's Triton kernel
# kernels/triton/quartet_ii.py (eden_1x16s_fp4_kernel) and model/modules/linear.py:
EDEN_SCALE_MAX = 255.99  # the E4M3 target of the tensor scale, below 448 so the corrected scale still fits
EDEN_SCALE_OVERRIDE = (17 / 16) * 0.93  # QUARTET_II_BACKWARD_SCALE_OVERRIDE
EDEN_VAL_MAX = float(np.float32(6.0 / EDEN_SCALE_OVERRIDE))  # a block max maps to 6 / 0.988 = 6.07
UNBIASED_FACTOR = 16 / 17  # fouroversix RoundStyle.stochastic_unbiased.adjustment_factor (Quartet II)
BLOCK_SHAPES = _names.NVFP4_BLOCK_SHAPES


def check_block_shape(block_shape: Any) -> tuple[int, int]:
    """`block_shape` as a tuple if it is one of BLOCK_SHAPES (a tuple or list of ints), else a ValueError."""
    ok = isinstance(block_shape, (tuple, list)) and all(
        isinstance(b, int) and not isinstance(b, bool) for b in block_shape)
    if not ok or tuple(block_shape) not in BLOCK_SHAPES:
        raise ValueError(f"block_shape={block_shape!r} is not supported; allowed: (1, 16), (16, 16)")
    return tuple(block_shape)
BLOCK = 16
_MANT = 0x400000  # the one mantissa bit of an E2M1 value held in float32 (set for 1.5, 3, 6)


def rule_constants(rule: str) -> tuple[float, float]:
    """(M, E) of `rule`: the element max a block max maps to, and the E4M3 max the tensor scale targets ("search"
    uses the 4/6 constants, so both see the same tensor scale)."""
    one_of(rule, RULES, "rule")
    return {"static_6": (6.0, 448.0), "static_4": (4.0, 448.0)}.get(rule, (6.0, 256.0))


class ScaleConstants(NamedTuple):
    """The float32 constants of a (rule, rounding): ``S_enc = enc / amax``, ``base = (blk_amax / blk_div) * S_enc``
    and the 4/6 error's ``x̂ = ((q*s)*amax) / enc``. With ``a = 16/17`` for "stochastic_unbiased" (else 1):
    ``enc = f32(M*E*a)``, ``blk_div = f32(M*a)``, each rounded once from the double product, as fouroversix does."""

    enc: float
    blk_div: float


def scale_constants(rule: str, rounding: str = "nearest") -> ScaleConstants:
    m, e = rule_constants(rule)
    one_of(rounding, ROUNDINGS, "rounding")
    a = UNBIASED_FACTOR if rounding == "stochastic_unbiased" else 1.0
    return ScaleConstants(float(np.float32(m * e * a)), float(np.float32(m * a)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class NVFP4Config:
    """Static NVFP4 quantization settings (hashable, so `jit` does not retrace).

    Attributes:
      rule: "static_6" | "static_4" | "abs_max" | "mae" | "mse" | "search" (per-block E4M3 scale search, MSE).
      block_shape: (1, 16) blocks along the last axis, or (16, 16) tiles over the last two axes.
      rounding: "nearest" (RNE), "stochastic" (P(up) = fractional distance), "stochastic_unbiased" (the same with
        16/17 headroom and a draw-independent 4/6 choice) or "ms_eden" (Quartet II's MS-EDEN: round to nearest,
        then the EDEN correction folded into a stochastically rounded block scale; rule "static_6", 1x16 only);
        all but "nearest" need a PRNG key.
    """

    rule: NVFP4Rule = "mse"
    block_shape: tuple[int, int] = (1, 16)
    rounding: Rounding = "nearest"

    def __post_init__(self) -> None:
        one_of(self.rule, RULES, "rule")
        one_of(self.rounding, ROUNDINGS, "rounding")
        bs = check_block_shape(self.block_shape)
        object.__setattr__(self, "block_shape", bs)
        if self.rule == "search" and self.rounding != "nearest":
            raise ValueError(f"rule='search' is implemented with rounding='nearest' only; got "
                             f"rounding={self.rounding!r}")
        if self.rounding == "ms_eden" and (self.rule != "static_6" or bs != (1, 16)):
            raise ValueError(f"rounding='ms_eden' sets its own block scale (block max -> {EDEN_VAL_MAX:.4f}, then the "
                             f"EDEN correction) on 1x16 blocks: use rule='static_6', block_shape=(1, 16); got "
                             f"rule={self.rule!r}, block_shape={bs}")

    @property
    def rows(self) -> int:
        return self.block_shape[0]


def global_scales(amax: jax.Array, rule: str, rounding: str = "nearest") -> tuple[jax.Array, jax.Array]:
    """(S_enc, S_dec) float32 scalars: ``S_enc = min(enc / amax, FLT_MAX)`` (``enc = M*E``, times 16/17 rounded
    once for "stochastic_unbiased"), 1 when amax == 0, NaN when amax is not finite or negative (a bad
    caller-supplied amax poisons the tensor visibly); ``S_dec = 1 / S_enc``. "ms_eden": :func:`eden_global_scales`."""
    if rounding == "ms_eden":
        return eden_global_scales(amax)
    return global_scales_enc(amax, scale_constants(rule, rounding).enc)


def global_scales_enc(amax: jax.Array, enc: float) -> tuple[jax.Array, jax.Array]:
    """:func:`global_scales` for the constant ``enc`` (= M*E, one float32) of any two-level format."""
    amax = jnp.asarray(amax, jnp.float32)
    s_enc = jnp.minimum(enc / amax, FLT_MAX)
    s_enc = jnp.where(amax == 0, 1.0, s_enc)
    s_enc = jnp.where(jnp.isfinite(amax) & (amax >= 0), s_enc, jnp.nan)
    return s_enc, 1.0 / s_enc


# ---- reductions


def _max_keep_nan(p: jax.Array, q: jax.Array) -> jax.Array:
    """max(p, q), NaN if either is (explicitly: a backend's fast max may drop a NaN operand)."""
    return jnp.where(p != p, p, jnp.where(q != q, q, jnp.maximum(p, q)))


def block_amax(xb: jax.Array, axes: tuple[int, ...] = (-3, -1)) -> jax.Array:
    """float32 ``max |x|`` per block, NaN wherever a NaN is reduced: over the last axis (``axes=(-1,)``) or over the
    block axes (-3, -1) of the [..., R, nb, 16] layout (the default).

    A max and an any-NaN reduction over the contiguous last axis (`jaxlowfp._core.reduce.abs_max`: XLA:CPU's
    library max reduction drops NaN, so the NaN is put back explicitly; two standard reductions, which XLA fuses
    into one pass and can partition when the block axis lies across devices, where a reducer written out as a
    computation is "Unsupported reduction computation" on XLA:CPU), then, for 16x16 tiles, the 16 row maxima folded
    element-wise (a reduction over axes (-3, -1) at once is ten times slower on XLA:CPU).
    """
    if axes not in ((-1,), (-3, -1)):
        raise ValueError(f"axes must be (-1,) or (-3, -1); got {axes!r}")
    m = abs_max(xb.astype(jnp.float32), axis=xb.ndim - 1)
    if axes == (-1,):
        return m
    out = m[..., 0, :]
    for r in range(1, m.shape[-2]):
        out = _max_keep_nan(out, m[..., r, :])
    return out


def tensor_amax(blk: jax.Array) -> jax.Array:
    """The tensor's ``max |x|`` from its block maxima: NaN blocks count as +Inf (not finite either way, so the
    global scale is NaN: :func:`global_scales`). A separate small reduction, so XLA does not fuse it with the
    per-block one into a second pass over the tensor."""
    return jnp.max(jnp.where(jnp.isnan(blk), jnp.inf, blk))


# ---- E2M1 rounding


def e2m1_rne(a: jax.Array) -> jax.Array:
    """E2M1 round-to-nearest-even magnitude of float32 ``a >= 0``, saturating at 6 (zero derivative)::

        m = 2^(22 + max(floor(log2 min(a, 8)), 0))     (from the exponent bits: 2^22 below 2, 2^23 in [2, 4), 2^24)
        v = min((min(a, 8) + m) - m, 6)

    The add rounds ``a`` to a multiple of ulp(m) = 0.5, 1 or 2 (the E2M1 spacing of a's binade) with IEEE
    ties-to-even, which are exactly E2M1's ties (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
    5 -> 4); the subtraction is exact. Four float and three integer operations instead of seven compare-selects.
    NaN stays NaN (callers give such elements a NaN scale).
    """
    a = jnp.minimum(a, 8.0)
    m = from_bits(jnp.maximum(lax.bitcast_convert_type(a, jnp.uint32) & u32(0x7F800000), u32(0x3F800000))
                  + u32(22 << 23))
    return lax.stop_gradient(jnp.minimum((a + m) - m, 6.0))


def e2m1_stochastic(ay: jax.Array, u: jax.Array) -> jax.Array:
    """Stochastic E2M1 rounding of |y| (float32 >= 0) with uniforms `u` in [0, 1): the grid neighbours lo < hi of
    min(|y|, 6), and hi with probability (|y| - lo) / (hi - lo). All steps are exact (power-of-two steps)."""
    a = jnp.minimum(ay, 6.0)
    step = jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0))
    lo = jnp.floor(a * (1.0 / step)) * step
    frac = (a - lo) * (1.0 / step)
    return lax.stop_gradient(jnp.where(u < frac, lo + step, lo))


def e2m1_index(v: jax.Array) -> jax.Array:
    """E2M1 magnitude index (int32, 0..7) of a magnitude `v` already on the grid {0, .5, 1, 1.5, 2, 3, 4, 6}:
    2v below 1, else the float32 exponent and mantissa bit ((bits >> 22) - 252: 1 -> 2, 1.5 -> 3, ..., 6 -> 7)."""
    hi = (lax.bitcast_convert_type(v, jnp.uint32) >> 22).astype(jnp.int32) - 252
    return jnp.where(v < 1.0, (v * 2.0).astype(jnp.int32), hi)


# ---- the per-block quantizer


class BlockResult(NamedTuple):
    """Output of :func:`quantize_blocks` for blocks laid out [..., R, nb, 16] (see :func:`to_blocks`)."""

    nibbles: jax.Array  # uint8 [..., R, nb, 16]: sign<<3 | E2M1 index (0 in blocks with a NaN scale)
    values: jax.Array  # float32 [..., R, nb, 16]: the signed E2M1 value of each nibble (+0 where the scale is 0)
    scales: jax.Array  # float32 [..., nb]: the chosen E4M3 block scale (a value of float8_e4m3fn, or NaN)
    map4: jax.Array  # bool [..., nb]: block mapped its max to 4


def per_element(p: jax.Array) -> jax.Array:
    """A per-block array [..., nb] broadcastable against its blocks [..., R, nb, 16]."""
    return p[..., None, :, None]


def inverse_scale(s: jax.Array, s_dec: jax.Array) -> jax.Array:
    """``min(1 / (s * S_dec), FLT_MAX)``, 0 where s == 0 (the block's values then round to 0)."""
    return jnp.where(s == 0, 0.0, jnp.minimum(1.0 / (s * s_dec), FLT_MAX))


def error_scale(blk: jax.Array) -> jax.Array:
    """The exact power of two ``p = 2^-e`` that brings a block amax ``blk`` in ``[2^e, 2^(e+1))`` with e < 0 to
    ``[1, 2)``; 1 where e >= 0 and where blk is 0, subnormal, NaN or Inf. Built from blk's exponent bits E
    (``e = E - 127``): ``p = 2^(127 - E)`` for E in [1, 126].

    :func:`block_errors` measures ``d * p`` instead of d: multiplying by a power of two is exact, so every
    squared, summed or compared error is the original's times ``p^2`` (or p) wherever the original is a normal
    float, and the 4/6 ranking is unchanged there; where the original's ``d * d`` is subnormal (a tensor amax
    below about 2^-57) XLA:CPU flushes it to 0 while IEEE float32 keeps it, and the scaled errors are normal
    floats again (issue 45: a flushed tie picked 6 where IEEE picks 4). Blocks are never scaled down, so nothing
    the original kept can underflow; ``|d * p|`` stays below about 8, so nothing can overflow."""
    e = (lax.bitcast_convert_type(blk, jnp.uint32) >> 23) & u32(0xFF)
    return jnp.where((e >= 1) & (e <= 126), from_bits((u32(254) - e) << 23), jnp.float32(1.0))


def block_errors(xb, s, s_dec, amax, blk, rule: str, enc: float, u) -> jax.Array:
    """The 4/6 errors [C, ..., nb] of C candidate block scales `s` [C, ..., nb], in the original domain times the
    block's exact power of two ``p`` (:func:`error_scale`, the same for every candidate of a block)::

        x̂ = ((q * s) * amax) / enc,  d = x̂*p - x*p;   mse: Σ d*d,  mae: Σ |d|   (columns 0..15 in order, then rows
        pairwise),  abs_max: max |d|

    computed without a per-element division: ``q = 2^j * c`` with c in {1/2, 3/2} (E2M1 values are one or 1.5
    times a power of two), so ``x̂ = 2^j * fl(fl(c*s*amax) / enc)`` exactly (``q * s`` is exact and scaling by
    2^j commutes with rounding) from two per-block quotients. Where a product ``(q*s)*amax`` overflows, the
    specification's x̂ is Inf and the block's error Inf: that happens iff it does for the block's largest q
    (``vmax``), so the error is set to Inf there, and the quotients are taken of ``min(product, FLT_MAX)``.
    (Below about 1e-30, where XLA:CPU flushes subnormal results, the two forms may differ, as before.) The
    scaling by ``p`` keeps the squared errors of tiny blocks normal (:func:`error_scale`).

    The sum runs over the columns in :func:`~jaxlowfp._core.reduce.column_loop` (small tensors: a rolled loop,
    every candidate at once; large ones: written out, one candidate at a time), and ``d * d`` passes
    :func:`no_contract` (no FMA into the sum). Blocks with a NaN scale get a NaN error.
    """
    amax, s_dec, blk = (_lead(a) for a in (amax, s_dec, blk))
    inv = inverse_scale(s, s_dec)[..., None, :]
    half = ieee_div(jnp.minimum((0.5 * s) * amax, FLT_MAX), enc)  # x̂ of q = 1/2
    lo = (2.0 * half)[..., None, :]  # x̂ = q * lo for q in {1/2, 1, 2, 4} (mantissa bit clear)
    hi = ieee_div(jnp.minimum((1.5 * s) * amax, FLT_MAX), enc)[..., None, :]  # x̂ = (q/1.5) * hi, q in {1.5, 3, 6}
    p = error_scale(blk)[..., None, :]

    def candidates(inv, lo, hi):
        def column(ax, ui, carry):
            acc, vmax = carry
            v = e2m1_rne(ax * inv) if ui is None else e2m1_stochastic(ax * inv, ui)
            vb = lax.bitcast_convert_type(v, jnp.uint32)
            xhat = from_bits(vb & u32(~_MANT & 0xFFFFFFFF)) * jnp.where((vb & u32(_MANT)) != 0, hi, lo)
            # xhat - ax = ±(x̂ - x): x̂ carries x's sign (or is 0); both scaled by p, exactly
            return accumulate_error(acc, xhat * p - ax * p, rule), (None if ui is None else jnp.maximum(vmax, v))

        return column_loop(xb[None], None if u is None else u[None], column, inv.shape, with_max=u is not None)

    # written out, one candidate per pass: with the candidates stacked XLA fuses the sixteen columns 2x slower
    parts = ([candidates(inv[c:c + 1], lo[c:c + 1], hi[c:c + 1]) for c in range(inv.shape[0])] if unrolled(xb)
             else [candidates(inv, lo, hi)])
    err = combine_rows(jnp.concatenate([a for a, _ in parts]), rule)
    if u is None:
        vmax = e2m1_rne(blk * inv[..., 0, :])  # RNE: monotone in |x|
    else:
        vmax = pairwise_rows(jnp.concatenate([m for _, m in parts]), jnp.maximum)
    return jnp.where(jnp.isinf((vmax * s) * amax), jnp.inf, err)


def _lead(a: Any) -> Any:
    """`a` with a leading candidate axis of 1 (a scalar stays one: it broadcasts as it is, rank promotion off)."""
    return a if jnp.ndim(a) == 0 else a[None]


def search_scales(xb, base, s6, s_dec, amax, blk, enc: float) -> tuple[jax.Array, jax.Array]:
    """Per-block scale search (rule "search"): the E4M3 scale of minimum MSE among every E4M3 value from
    ``e4m3(base * 0.81)`` to ``e4m3(base * 1.8)`` (a block max mapped anywhere from 6/0.81 = 7.4, clipped, down to
    6/1.8 = 3.3), with the 4/6 error of :func:`block_errors` (original domain, global scale included)::

        err* = err(s6);  for each code c in [code(e4m3(0.81 base)), code(e4m3(1.8 base))], in increasing order:
            s = decode(c);  keep s if err(s) < err*          (strict: ties keep s6, then the smaller scale)

    The candidates include s6 = e4m3(base) and the map-to-4 scale e4m3(1.5 base), so the chosen error is never
    above the 4/6 ``mse`` one (same sum order). Returns (scales, moved) with `moved` = the scale is not s6."""
    lo = E4M3.encode(base * np.float32(SEARCH_RANGE[0]), saturate=True).astype(jnp.int32)
    hi = E4M3.encode(base * np.float32(SEARCH_RANGE[1]), saturate=True).astype(jnp.int32)
    codes = [lo + k for k in range(SEARCH_CODES)]
    cands = [jnp.where(jnp.isfinite(s6), E4M3.decode(c.astype(jnp.uint8)), jnp.nan) for c in codes]
    errs = block_errors(xb, jnp.stack([s6, *cands]), s_dec, amax, blk, "mse", enc, None)
    s, best = s6, errs[0]
    for code, sk, ek in zip(codes, cands, errs[1:]):
        better = (code <= hi) & (ek < best)
        s = jnp.where(better, sk, s)
        best = jnp.where(better, ek, best)
    return s, s != s6


# ---- MS-EDEN (Quartet II), from fouroversix's Triton kernel kernels/triton/quartet_ii.py


def eden_global_scales(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MS-EDEN's tensor scale ``S_dec = (amax / 255.99) / (6 / 0.988125)`` (two correctly rounded divisions; 1 when
    amax == 0, NaN when it is not finite or negative), returned as ``(1 / S_dec, S_dec)``."""
    amax = jnp.asarray(amax, jnp.float32)
    s_dec = div_const(div_const(amax, EDEN_SCALE_MAX), EDEN_VAL_MAX)
    s_dec = jnp.where(amax == 0, 1.0, s_dec)
    s_dec = jnp.where(jnp.isfinite(amax) & (amax >= 0), s_dec, jnp.nan)
    return 1.0 / s_dec, s_dec


def e2m1_half_up(a: jax.Array) -> jax.Array:
    """E2M1 magnitude of ``a >= 0`` with ties away from zero (the thresholds of the E2M1 grid taken with ``>=``:
    0.25 -> 0.5, 1.25 -> 1.5, 2.5 -> 3, 5 -> 6), saturating at 6: the rounding of the MS-EDEN kernel."""
    v = jnp.zeros(a.shape, jnp.float32)
    for (t, _), g in zip(E2M1_THRESHOLDS, (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)):
        v = jnp.where(a >= t, g, v)
    return v


def _row_sum(t: jax.Array) -> jax.Array:
    """Σ over the last axis (16 columns, in order) of [..., 1, nb, 16] -> [..., nb]; the terms are >= 0 and pass
    :func:`no_contract` (no FMA into the sum)."""
    acc = no_contract(t[..., 0])
    for i in range(1, BLOCK):
        acc = acc + no_contract(t[..., i])
    return acc[..., 0, :]


def eden_prepare(xb: jax.Array, s_dec: jax.Array, blk: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MS-EDEN's round-to-nearest block scale and scaled values for 1x16 blocks [..., 1, nb, 16]::

        s = e4m3_rne_satfinite((blk_amax / (6 / 0.988125)) / S_dec),  1 where that is 0,  NaN for non-finite blocks
        y = x / (s * S_dec)                                           (IEEE division, as the kernel's ``/``)

    Returns (s [..., nb], y float32 [..., 1, nb, 16])."""
    t = ieee_div(div_const(blk, EDEN_VAL_MAX), jnp.broadcast_to(s_dec, blk.shape))
    s = E4M3.round(t, saturate=True)
    s = jnp.where(jnp.isfinite(blk), jnp.where(s == 0, 1.0, s), jnp.nan)
    xf = xb.astype(jnp.float32)
    return s, ieee_div(xf, jnp.broadcast_to(per_element(s * s_dec), xf.shape))


def eden_scale(y: jax.Array, q: jax.Array, s: jax.Array, u: jax.Array) -> jax.Array:
    """The EDEN-corrected scale, stochastically rounded to E4M3 with per-block uniforms `u` in [0, 1)::

        c    = s * (Σ y² / Σ |y| |q|)      (1 where Σ |y||q| == 0; sums over the block's 16 values)
        b    = code of e4m3_rne(c);  up = e4m3(b) if e4m3(b) > c else e4m3(b + 1);  down = e4m3(b - 1) or e4m3(b)
        s'   = up if u < (c - down) / (up - down) else down          (E[s'] = c between two E4M3 neighbours)

    so ``E[q * s'] = q * c``: the rounded block, rescaled by the least-squares factor <y, y> / <y, q>, which makes
    ``E[<x̂, x>] = <x, x>`` for every block (EDEN's correction, here per 16 values). Guards the kernel does not
    need in range: ``down`` is 0 below the smallest code, ``up`` stays 448 at the top."""
    ay = jnp.abs(y)
    num = _row_sum(ay * ay)
    den = _row_sum(ay * jnp.abs(q))
    c = s * jnp.where(den == 0, 1.0, ieee_div(num, jnp.where(den == 0, 1.0, den)))
    b = E4M3.encode(c, saturate=True).astype(jnp.int32)
    curr = E4M3.decode(b.astype(jnp.uint8))
    nxt = jnp.where(b >= 0x7E, curr, E4M3.decode(jnp.minimum(b + 1, 0x7E).astype(jnp.uint8)))
    prv = jnp.where(b <= 0, 0.0, E4M3.decode(jnp.maximum(b - 1, 0).astype(jnp.uint8)))
    above = curr > c
    up = jnp.where(above, curr, nxt)
    down = jnp.where(above, prv, curr)
    gap = up - down
    p = jnp.where(gap > 0, ieee_div(c - down, jnp.where(gap > 0, gap, 1.0)), 0.0)
    return jnp.where(jnp.isfinite(s), jnp.where(u < p, up, down), jnp.nan)


def ms_eden_blocks(xb: jax.Array, s_dec: jax.Array, blk: jax.Array, u: jax.Array) -> BlockResult:
    """NVFP4 with MS-EDEN (rounding "ms_eden", 1x16 blocks): :func:`eden_prepare`, E2M1 round to nearest with ties
    away from zero (:func:`e2m1_half_up`), then :func:`eden_scale`; x̂ = (q * s') * S_dec."""
    s, y = eden_prepare(xb, s_dec, blk)
    v = e2m1_half_up(jnp.abs(y))
    return _signed_result(xb, v, eden_scale(y, v, s, u), jnp.zeros(s.shape, jnp.bool_))


def _signed_result(xb: jax.Array, v: jax.Array, s: jax.Array, map4: jax.Array) -> BlockResult:
    """BlockResult of E2M1 magnitudes `v` with x's sign bit (+0 where s == 0), nibbles 0 where s is NaN."""
    xf = xb.astype(jnp.float32)
    sign = lax.bitcast_convert_type(xf, jnp.uint32) & per_element(jnp.where(s == 0, u32(0), u32(SIGN)))
    values = from_bits(lax.bitcast_convert_type(v, jnp.uint32) | sign)
    nib = ((sign >> 28).astype(jnp.int32) | e2m1_index(v)).astype(jnp.uint8)
    nib = jnp.where(per_element(jnp.isnan(s)), jnp.uint8(0), nib)
    return BlockResult(nib, values, s, map4)


def quantize_blocks(
    xb: jax.Array,
    amax: jax.Array,
    s_enc: jax.Array,
    s_dec: jax.Array,
    *,
    rule: str,
    rounding: str = "nearest",
    u: jax.Array | None = None,
    blk_amax: jax.Array | None = None,
) -> BlockResult:
    """Quantize blocks `xb` [..., R, nb, 16] (the layout of :func:`to_blocks`; any float dtype; R = 1: 1x16
    blocks, R = 16: 16x16 tiles) given the tensor amax and the global scales from :func:`global_scales` (same
    `rule` and `rounding`). Exact operation order (each op one float32 rounding; constants from
    :func:`scale_constants`)::

        blk_amax = max |xb| over the block                         (NaN if any element is NaN; or `blk_amax`)
        base     = (blk_amax / blk_div) * s_enc                   (exact division: blk_div = M, or f32(M*16/17))
        s        = e4m3_rne_satfinite(base)                       4/6: s6 = that, s4 = e4m3(base * 1.5)
        s        = NaN where blk_amax is not finite
        inv      = min(1 / (s * s_dec), FLT_MAX)   (0 where s == 0);   y = x * inv
        |q|      = e2m1 RNE of |y| (saturating at 6), or stochastic with uniforms `u` (shaped like `xb`)
                   (P(up) = fractional distance)
        q        = |q| with x's sign bit (+0 where s == 0);   nibble = sign << 3 | E2M1 index of |q|
        4/6 only: x̂ = ((q * s) * amax) / enc; d = x̂ - x; err per block = sequential sum over the 16 columns,
                  then pairwise over rows (mse: d*d, mae: |d|) or max |d| (abs_max); map4 = err4 < err6
                  (a NaN error keeps 6). The candidates' q: rounding="stochastic" rounds both stochastically with
                  the same draws (as the fouroversix and TE kernels); "nearest" and "stochastic_unbiased" compare
                  the round-to-nearest candidates, so the choice does not depend on the draw.

    The Pallas kernel (``pallas_kernels/nvfp4.py``) reproduces this order bit for bit. ``rule="search"``: see
    :func:`search_scales` (`map4` then says where the search left the map-to-6 scale); ``rounding="ms_eden"``:
    :func:`ms_eden_blocks` (per-block uniforms `u`, shaped like the scales).
    """
    blk = block_amax(xb) if blk_amax is None else blk_amax
    if rounding == "ms_eden":
        assert u is not None, "ms_eden draws per-block uniforms"
        return ms_eden_blocks(xb, s_dec, blk, u)
    enc, blk_div = scale_constants(rule, rounding)
    base = ieee_div(blk, blk_div) * s_enc
    finite = jnp.isfinite(blk)

    def e4m3(v):
        return jnp.where(finite, E4M3.round(v, saturate=True), jnp.nan)

    s = e4m3(base)
    map4 = jnp.full(s.shape, rule == "static_4")
    if rule == "search":
        s, map4 = search_scales(xb, base, s, s_dec, amax, blk, enc)
    if rule in FOUR_OVER_SIX:
        s4 = e4m3(base * 1.5)
        uc = u if rounding == "stochastic" else None
        err4, err6 = block_errors(xb, jnp.stack([s4, s]), s_dec, amax, blk, rule, enc, uc)
        map4 = err4 < err6
        s = jnp.where(map4, s4, s)
    s = materialize(s)  # one fusion computes the scales (and 4/6 choices); the element loop reads them
    ay = jnp.abs(xb.astype(jnp.float32)) * per_element(inverse_scale(s, s_dec))
    v = e2m1_rne(ay) if u is None else e2m1_stochastic(ay, u)
    return _signed_result(xb, v, s, map4)


# ---- layout: tensors <-> blocks


def to_blocks(x: jax.Array, rows: int) -> jax.Array:
    """[..., K] -> [..., 1, K/16, 16] (rows = 1) or [..., M, K] -> [..., M/16, 16, K/16, 16] (rows = 16): a
    reshape (no transpose); a block is axes (-3, -1) and the per-block arrays are [..., K/16] or [..., M/16, K/16],
    the scales' shape."""
    k = x.shape[-1]
    if rows == 1:
        return x.reshape(*x.shape[:-1], 1, k // BLOCK, BLOCK)
    m = x.shape[-2]
    return x.reshape(*x.shape[:-2], m // BLOCK, BLOCK, k // BLOCK, BLOCK)


def from_blocks(xb: jax.Array, shape: tuple[int, ...], rows: int) -> jax.Array:
    return xb.reshape(shape)


def _check_x(x: Any, cfg: BlockConfig) -> jax.Array:
    x = float_input(x, "x")
    need = 2 if cfg.rows > 1 else 1
    if x.ndim < need:
        raise ValueError(f"x must have at least {need} dimension(s) for block_shape={cfg.block_shape}; got {x.shape}")
    if x.shape[-1] % BLOCK:
        raise ValueError(f"the last axis of x (shape {x.shape}) must be a multiple of {BLOCK}")
    if cfg.rows > 1 and x.shape[-2] % BLOCK:
        raise ValueError(f"block_shape=(16, 16) needs the second-to-last axis of x (shape {x.shape}) to be a "
                         f"multiple of 16")
    return x


def validate_args(x: Any, cfg: BlockConfig, global_amax: Any, key: Any) -> tuple[jax.Array, jax.Array | None]:
    """Check `x`, the key and `global_amax` against `cfg` (clear errors); returns (x, global_amax as an array)."""
    x = _check_x(x, cfg)
    if cfg.rounding in STOCHASTIC and key is None:
        raise ValueError(f"rounding={cfg.rounding!r} needs a PRNG key: pass key=jax.random.key(...)")
    if cfg.rounding == "nearest" and key is not None:
        raise ValueError("key is only used with rounding='stochastic' or 'stochastic_unbiased'; got "
                         "rounding='nearest' and a key")
    if global_amax is not None:
        global_amax = float_input(global_amax, "global_amax")
        if global_amax.ndim != 0:
            raise ValueError(f"global_amax must be a scalar; got shape {global_amax.shape}")
        # a concrete value is checked here; a traced one (under jit, a delayed or all-reduced amax) cannot be, and
        # a negative traced global_amax gives NaN outputs: the caller's to keep >= 0. A NaN / Inf amax is the
        # non-finite policy's (every scale NaN, the tensor dequantizes to NaN: module docstring), not refused
        if not isinstance(global_amax, jax.core.Tracer):
            g = float(global_amax)
            if g < 0:
                raise ValueError(f"global_amax must be >= 0 (the amax the global scale is made from); got {g} (a NaN "
                                 f"or Inf amax gives NaN scales, the non-finite policy)")
    return x, global_amax


def validate_kernel_args(
    x: Any, rule: Any, block_shape: Any, global_amax: Any, rounding: Any, key: Any, kernel: str
) -> tuple[NVFP4Config, jax.Array, jax.Array | None]:
    """`validate_args` for a GPU kernel (Triton or Mosaic): round to nearest only, fewer than 2^31 elements (the
    kernels index with int32). Returns ``(cfg, x, global_amax)``."""
    cfg = NVFP4Config(rule=rule, block_shape=block_shape, rounding=rounding)
    if cfg.rule not in KERNEL_RULES:
        raise ValueError(f"the {kernel} kernel implements the rules {', '.join(KERNEL_RULES)}; got rule={rule!r} (use "
                         f"impl='xla', jaxlowfp.nvfp4)")
    if cfg.rounding != "nearest" or key is not None:
        raise ValueError(
            f"the {kernel} kernel implements rounding='nearest' only (got rounding={rounding!r}"
            f"{' and a key' if key is not None else ''}); use impl='xla' (jaxlowfp.nvfp4) for stochastic rounding"
        )
    x, ga = validate_args(x, cfg, global_amax, None)
    if x.size >= 2**31:
        raise ValueError(f"x has {x.size} elements; the kernel indexes with int32 and supports fewer than 2^31")
    return cfg, x, ga


def pack_nibbles(nib: jax.Array) -> jax.Array:
    """uint8 4-bit codes [..., K] -> bytes [..., K // 2], element 2j in the low nibble, 2j + 1 in the high one."""
    lo, hi = jnp.unstack(nib.reshape(*nib.shape[:-1], nib.shape[-1] // 2, 2), axis=-1)  # no slices: lowers in Triton
    return lo | (hi << 4)


def unpack_nibbles(codes: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_nibbles`."""
    nib = jnp.stack([codes & 0xF, codes >> 4], axis=-1)
    return nib.reshape(*codes.shape[:-1], codes.shape[-1] * 2)


@functools.partial(jax.jit, static_argnames=("rows", "shape", "dtype"))
def dequantize_blocks(codes, scales, global_scale, *, rows: int, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """``(q * s) * global_scale`` from packed codes and E4M3 scales, in `dtype` (one rounding: q * s is exact)."""
    vb = to_blocks(E2M1.decode(unpack_nibbles(codes)), rows)
    out = (vb * per_element(scales.astype(jnp.float32).reshape(*vb.shape[:-3], vb.shape[-2]))) * global_scale
    return from_blocks(out, shape, rows).astype(dtype)
