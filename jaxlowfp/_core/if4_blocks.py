"""The per-block math of the adaptive block-scaled formats IF4, IF6 and IF3, their array type and config
(``docs/formats/if4.md``); public face :mod:`jaxlowfp.if4`.

One NVFP4-style two-level scale per block (``M`` the FP grid's max, E4M3 max 448: the ``static_6`` scale of
:mod:`jaxlowfp._core.nvfp4_blocks` with ``M*448`` for ``6*448``), then each block is rounded onto two grids and keeps
the one with the smaller error in the original domain; an INT block sets the sign bit of its E4M3 scale::

    S_enc = min(M*448 / amax, FLT_MAX);  S_dec = 1 / S_enc;  s = E4M3_RNE_satfinite((blk_amax / M) * S_enc)
    inv   = min(1 / (s * S_dec), FLT_MAX);  y = x * inv
    FP:  q_f = FP_RNE_satfinite(y)                               x̂_f = ((q_f * s) * amax) / (M*448)
    INT: q_i = round_half_even(clamp(y * rcp, +-N))               x̂_i = (((q_i * s) * amax) * step) / (M*448)
    err  = Σ d² | Σ |d| | max |d|  (d = x̂ - x; columns in order, then rows pairwise);  INT iff err_i < err_f

==========  =====================  ====  ============  ==================  ========================
format      FP grid                M     INT grid      step (rcp)          codes
==========  =====================  ====  ============  ==================  ========================
if4         E2M1 {0 .. 6}          6     INT4 +-7      0.8571428571 (6/7)  4 bits, two a byte; INT in two's complement
if6_e2m3    E2M3 {0 .. 7.5}        7.5   INT6 +-31     0.2419355           6 bits a byte; sign-magnitude
if6_e3m2    E3M2 {0 .. 28}         28    INT6 +-31     0.9032258065        6 bits a byte; sign-magnitude
if3         E2M0 {0, 1, 2, 4}      4     INT3 +-3      1.3333333333 (4/3)  3 bits a byte; sign-magnitude
==========  =====================  ====  ============  ==================  ========================

The constants are fouroversix's (``kernels/constants.py``, rounded once to float32; ``rcp`` the reciprocal it
writes: 1.16666666, 4.1333333333, 1.1071428571, 0.75), the order of operations that of its PyTorch reference
``quantize/pytorch/reference.py: select_intfloat`` (IF4, IF6; bit-exact against it in ``tests/test_if4.py``), and for
IF3, which only its Triton kernels have (``kernels/triton/fp3.py``, ``int3.py``, ``quantize.py``), those kernels':
E2M0 rounds ties down (``|y| <= 0.5 -> 0``, ``<= 1.5 -> 1``, ``<= 3 -> 2``, else 4). Decoding::

    x̂ = (q_f * |s|) * S_dec        (FP block: q * s exact)
    x̂ = ((q_i * |s|) * step) * S_dec   (INT block)
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlowfp._core import names as _names
from jaxlowfp._core.bits import FLT_MAX, SIGN, from_bits, ieee_div, materialize, pow2, u32
from jaxlowfp._core.checks import one_of
from jaxlowfp._core.minifloat import E2M1, E4M3, MiniFloat
from jaxlowfp._core.reduce import accumulate_error, column_loop, combine_rows
from jaxlowfp._core.nvfp4_blocks import (
    ROUNDINGS,
    UNBIASED_FACTOR,
    Rounding,
    check_block_shape,
    block_errors,
    inverse_scale,
    e2m1_half_up,
    e2m1_index,
    e2m1_rne,
    e2m1_stochastic,
    eden_global_scales,
    error_scale,
    eden_prepare,
    eden_scale,
    from_blocks,
    global_scales_enc,
    per_element,
    to_blocks,
    unpack_nibbles,
)

IFFormat = Literal["if4", "if6_e2m3", "if6_e3m2", "if3"]
IFRule = Literal["abs_max", "mae", "mse"]
FORMATS = _names.IF_FORMATS
RULES = _names.IF_RULES
E4M3_MAX = 448.0

E2M3 = MiniFloat(
    name="e2m3", bits=6, max_finite=7.5, min_normal=1.0, min_subnormal=0.125, default_target_max=7.5,
    default_grad_target_max=7.5, has_inf=False, has_nan=False, exponent_bits=2, mantissa_bits=3, bias=1,
    specials="none",
)
E3M2 = MiniFloat(
    name="e3m2", bits=6, max_finite=28.0, min_normal=0.25, min_subnormal=0.0625, default_target_max=28.0,
    default_grad_target_max=28.0, has_inf=False, has_nan=False, exponent_bits=3, mantissa_bits=2, bias=3,
    specials="none",
)


class Grid(NamedTuple):
    """The two grids of an IF format: FP max `fp_max` (= M), INT max `int_max`, the INT spacing `step` in FP units
    and its reciprocal `rcp` (float32, as fouroversix writes them), the code width `bits`."""

    fp_max: float
    int_max: int
    step: float
    rcp: float
    bits: int


def _f32(v: float) -> float:
    return float(np.float32(v))


GRIDS = {
    "if4": Grid(6.0, 7, _f32(0.8571428571), _f32(1.16666666), 4),
    "if6_e2m3": Grid(7.5, 31, _f32(0.2419355), _f32(4.1333333333), 6),
    "if6_e3m2": Grid(28.0, 31, _f32(0.9032258065), _f32(1.1071428571), 6),
    "if3": Grid(4.0, 3, _f32(1.3333333333), _f32(0.75), 3),
}


def scale_constants(fmt: str, rounding: str = "nearest") -> tuple[float, float]:
    """(enc, blk_div) = (f32(M*448*a), f32(M*a)), a = 16/17 for "stochastic_unbiased", else 1 (as fouroversix's
    ``compute_nv_scale_factors``, whose IF scale type has the E4M3 max 448 for every rule)."""
    m = GRIDS[fmt].fp_max
    a = UNBIASED_FACTOR if rounding == "stochastic_unbiased" else 1.0
    return _f32(m * E4M3_MAX * a), _f32(m * a)


def global_scales(amax: jax.Array, fmt: str, rounding: str = "nearest") -> tuple[jax.Array, jax.Array]:
    """(S_enc, S_dec) of an IF tensor (MS-EDEN: its own, :func:`~jaxlowfp._core.nvfp4_blocks.eden_global_scales`)."""
    one_of(fmt, FORMATS, "format")
    if rounding == "ms_eden":
        return eden_global_scales(amax)
    return global_scales_enc(amax, scale_constants(fmt, rounding)[0])


@dataclasses.dataclass(frozen=True, kw_only=True)
class IFConfig:
    """Static IF quantization settings (hashable, so `jit` does not retrace).

    Attributes:
      format: "if4" (default), "if6_e2m3", "if6_e3m2" or "if3".
      rule: the per-block grid choice: "mse" (default), "mae" or "abs_max" (errors in the original domain).
      block_shape: (1, 16), or (16, 16) tiles over the last two axes (one scale and one choice per tile).
      rounding: "nearest"; IF4 also "stochastic" (both grids rounded with the same uniforms, the lower error
        kept), "stochastic_unbiased" (16/17 headroom, the choice made on the round-to-nearest candidates, then
        stochastic rounding on the chosen grid) and "ms_eden" (rule "mse", 1x16: :func:`if_ms_eden_blocks`).
    """

    format: IFFormat = "if4"
    rule: IFRule = "mse"
    block_shape: tuple[int, int] = (1, 16)
    rounding: Rounding = "nearest"

    def __post_init__(self) -> None:
        one_of(self.format, FORMATS, "format")
        if self.rule in ("static_6", "static_4"):
            raise ValueError(f"rule={self.rule!r}: an IF format chooses a grid per block; allowed: "
                             f"{', '.join(map(repr, RULES))} (for a static rule use jaxlowfp.nvfp4)")
        one_of(self.rule, RULES, "rule")
        one_of(self.rounding, ROUNDINGS, "rounding")
        bs = check_block_shape(self.block_shape)
        object.__setattr__(self, "block_shape", bs)
        if self.rounding != "nearest" and self.format != "if4":
            raise ValueError(f"rounding={self.rounding!r} is implemented for format='if4' only (fouroversix rounds "
                             f"FP6 and FP3 to nearest); got format={self.format!r}")
        if self.rounding == "ms_eden" and (self.rule != "mse" or bs != (1, 16)):
            raise ValueError(f"rounding='ms_eden' chooses the grid by the MSE of the scaled block, on 1x16 blocks: "
                             f"use rule='mse', block_shape=(1, 16); got rule={self.rule!r}, block_shape={bs}")

    @property
    def rows(self) -> int:
        return self.block_shape[0]

    @property
    def grid(self) -> Grid:
        return GRIDS[self.format]


# ---- the grids


def e2m0_index(a: jax.Array) -> jax.Array:
    """E2M0 (FP3) magnitude index 0..3 of ``a >= 0`` (values 0, 1, 2, 4): fouroversix's ``convert_to_e2m0``
    thresholds, ties toward zero (0.5 -> 0, 1.5 -> 1, 3 -> 2); saturates at 4."""
    return (a > 0.5).astype(jnp.int32) + (a > 1.5).astype(jnp.int32) + (a > 3.0).astype(jnp.int32)


def _e2m0_value(idx: jax.Array) -> jax.Array:
    return jnp.where(idx == 3, 4.0, idx.astype(jnp.float32))


def fp_round(a: jax.Array, fmt: str, u: jax.Array | None = None) -> jax.Array:
    """The FP grid's magnitude of ``a >= 0`` (float32): round to nearest (even) saturating at the max, or IF4 with
    uniforms `u` the stochastic E2M1 rounding of :mod:`jaxlowfp._core.nvfp4_blocks`."""
    if fmt == "if4":
        return e2m1_rne(a) if u is None else e2m1_stochastic(a, u)
    if fmt == "if3":
        return _e2m0_value(e2m0_index(a))
    return lax.stop_gradient((E2M3 if fmt == "if6_e2m3" else E3M2).round(a, saturate=True))


def int_round(a: jax.Array, g: Grid, u: jax.Array | None = None) -> jax.Array:
    """The INT grid's magnitude (an integer in float32) of ``a >= 0``: ``round_half_even(min(a * rcp, N))``, or with
    uniforms `u` ``floor(t) + [u < frac(t)]`` (P(up) = the fractional part; exact)."""
    t = jnp.minimum(a * np.float32(g.rcp), np.float32(g.int_max))
    if u is None:
        return lax.stop_gradient(jnp.round(t))
    lo = jnp.floor(t)
    return lax.stop_gradient(jnp.where(u < t - lo, lo + 1.0, lo))


def _fp_code(v: jax.Array, fmt: str) -> jax.Array:
    """Magnitude code (int32) of an FP grid value `v` >= 0."""
    if fmt == "if4":
        return e2m1_index(v)
    if fmt == "if3":
        return e2m0_index(v)
    return (E2M3 if fmt == "if6_e2m3" else E3M2).encode(v).astype(jnp.int32)


def _errors(xb: jax.Array, aux: jax.Array | None, xhat_of, rule: str, p: jax.Array | None = None) -> jax.Array:
    """Block errors [..., nb]: ``xhat_of(|x_i|, aux_i)`` is the magnitude of x̂ in column i (sums in column order,
    then rows pairwise: :func:`~jaxlowfp._core.reduce.accumulate_error` folded by
    :func:`~jaxlowfp._core.reduce.column_loop`); with `p` [..., 1, nb] the differences are taken of x̂ * p
    and |x| * p (:func:`~jaxlowfp._core.nvfp4_blocks.error_scale`, as
    :func:`~jaxlowfp._core.nvfp4_blocks.block_errors` does, so the FP and INT errors stay comparable)."""
    def column(ax, ai, carry):
        xhat = xhat_of(ax, ai)
        return accumulate_error(carry[0], xhat - ax if p is None else xhat * p - ax * p, rule), None

    return combine_rows(column_loop(xb, aux, column)[0], rule)


# odd parts c of the grid magnitudes (every value is c * 2^j): INT: the odd integers up to N; FP6 / FP3 from their
# mantissas (E2M3: 8..15 and the subnormals 1..7, E3M2: 4..7 and 1..3, E2M0: 1)
_ODD_FP = {"if6_e2m3": (1, 3, 5, 7, 9, 11, 13, 15), "if6_e3m2": (1, 3, 5, 7), "if3": (1,)}


def _odd_split(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(c, j) int32 with ``v = c * 2^j``, c odd, for float32 grid values v > 0 (normal)."""
    b = lax.bitcast_convert_type(v, jnp.uint32)
    sig = (b & u32(0x7FFFFF)) | u32(0x800000)
    tz = lax.population_count((sig & (~sig + u32(1))) - u32(1))  # trailing zeros
    return (sig >> tz).astype(jnp.int32), ((b >> 23) & u32(0xFF)).astype(jnp.int32) - 150 + tz.astype(jnp.int32)


class _HatTable(NamedTuple):
    """Per-block quotients of :func:`_grid_hat`: ``h[k] = fl(fl(fl(odds[k] * s) * amax [* step]) / enc)``."""

    odds: tuple
    h: list
    s: jax.Array
    amax: jax.Array
    step: float | None


def _hat_table(s, amax, step: float | None, enc: float, odds: tuple[int, ...]) -> _HatTable:
    """The quotients of every odd part at once: one correctly rounded division (:func:`ieee_div`, the divisor a
    barrier-protected array) over the small per-block stack (one integer long division per element of
    :func:`~jaxlowfp._core.bits.div_const` compiles far slower for sixteen odd parts)."""
    sb = s[..., None, :]
    ps = []
    for c in odds:
        p = (np.float32(c) * sb) * amax
        ps.append(jnp.minimum(p if step is None else p * np.float32(step), FLT_MAX))
    stacked = jnp.stack(ps)
    h = ieee_div(stacked, jnp.full(stacked.shape, enc, jnp.float32))
    return _HatTable(odds, list(h), sb, amax, step)


def _grid_hat(v: jax.Array, t: _HatTable) -> jax.Array:
    """``x̂ = ((v * s) * amax [* step]) / enc`` for grid values `v` [..., R, nb], with one correctly rounded
    division per odd part per block (:func:`_hat_table`) instead of one per element: ``v = c * 2^j`` and scaling
    by 2^j commutes with each rounding, so ``x̂ = 2^j * h[c]`` (as
    :func:`~jaxlowfp._core.nvfp4_blocks.block_errors` does for E2M1). Where the element's own product overflows,
    x̂ is Inf, as the direct form gives."""
    c, j = _odd_split(jnp.where(v > 0, v, 1.0))
    if len(t.odds) <= 4:
        h = t.h[0]
        for ck, hk in zip(t.odds[1:], t.h[1:]):
            h = jnp.where(c == ck, hk, h)
    else:  # many odd parts (INT6, E2M3): one gather instead of a long select chain (faster to compile)
        lut = np.zeros(max(t.odds) // 2 + 1, np.int32)
        lut[[k // 2 for k in t.odds]] = np.arange(len(t.odds))
        idx = jnp.asarray(lut)[jnp.clip(c // 2, 0, len(lut) - 1)]
        table = jnp.stack([jnp.broadcast_to(hk, idx.shape) for hk in t.h], axis=-1)
        h = jnp.take_along_axis(table, idx[..., None], axis=-1)[..., 0]
    xhat = jnp.where(v > 0, h * pow2(jnp.clip(j, -126, 127)), 0.0)
    p = (v * t.s) * t.amax
    p = p if t.step is None else p * np.float32(t.step)
    return jnp.where(jnp.isinf(p), jnp.inf, xhat)


def _candidate_errors(xb, s, s_dec, amax, blk, fmt: str, rule: str, enc: float, u):
    """(err_fp, err_int) per block for the scales `s` (uniforms `u`: the stochastic candidates, shared)."""
    g = GRIDS[fmt]
    inv = inverse_scale(s, s_dec)[..., None, :]
    t_int = _hat_table(s, amax, g.step, enc, tuple(range(1, g.int_max + 1, 2)))
    t_fp = None if fmt == "if4" else _hat_table(s, amax, None, enc, _ODD_FP[fmt])

    def int_hat(ax, ui):
        return _grid_hat(int_round(ax * inv, g, ui), t_int)

    def fp_hat(ax, ui):
        assert t_fp is not None  # only the formats with an FP grid call it
        return _grid_hat(fp_round(ax * inv, fmt, ui), t_fp)

    p = error_scale(blk)[..., None, :]  # block_errors' exact power of two, for every candidate of the block
    if fmt == "if4":
        err_fp = block_errors(xb, s[None], s_dec, amax, blk, rule, enc, u)[0]
    else:
        err_fp = _errors(xb, u, fp_hat, rule, p)
    return err_fp, _errors(xb, u, int_hat, rule, p)


class IFBlockResult(NamedTuple):
    """Output of :func:`if_blocks` for blocks laid out [..., R, nb, 16]."""

    codes: jax.Array  # uint8 [..., R, nb, 16]: one code per element (IF4: a nibble); 0 in blocks with a NaN scale
    values: jax.Array  # float32 [..., R, nb, 16]: FP value, or the integer of an INT block, with x's sign bit
    scales: jax.Array  # float32 [..., nb]: |E4M3 block scale| (or NaN)
    is_int: jax.Array  # bool [..., nb]: the block uses the INT grid


def _element_result(xb, ay, a_fp, a_int, s, is_int, fmt: str) -> IFBlockResult:
    """Codes and signed values of magnitudes `a_fp` / `a_int` (the chosen grid per block) of the scaled
    magnitudes `ay`; a code is negative where ``x * inv < 0`` (the reference's sign: -0.0 and values that
    scale to 0 give +0 codes; an integer rounded to 0 has no sign)."""
    g = GRIDS[fmt]
    xf = xb.astype(jnp.float32)
    isi = per_element(is_int)
    v = jnp.where(isi, a_int, a_fp)
    neg = (lax.bitcast_convert_type(xf, jnp.uint32) >= u32(SIGN)) & (ay > 0)  # x * inv < 0
    qi = a_int.astype(jnp.int32)
    negative = neg & jnp.where(isi, qi > 0, True)  # the value's sign is its code's (fake == dequantize bitwise)
    values = from_bits(lax.bitcast_convert_type(v, jnp.uint32) | jnp.where(negative, u32(SIGN), u32(0)))
    top = 1 << (g.bits - 1)
    if fmt == "if4":
        int_code = jnp.where(neg & (qi > 0), 16 - qi, qi)  # two's complement nibble (-0 -> 0)
    else:
        int_code = jnp.where(neg & (qi > 0), top, 0) | qi  # sign-magnitude
    fp_code = jnp.where(neg, top, 0) | _fp_code(a_fp, fmt)
    codes = jnp.where(isi, int_code, fp_code).astype(jnp.uint8)
    codes = jnp.where(per_element(jnp.isnan(s)), jnp.uint8(0), codes)
    return IFBlockResult(codes, values, s, is_int)


def if_blocks(
    xb: jax.Array,
    amax: jax.Array,
    s_enc: jax.Array,
    s_dec: jax.Array,
    *,
    fmt: str,
    rule: str,
    rounding: str = "nearest",
    u: jax.Array | None = None,
    blk_amax: jax.Array,
) -> IFBlockResult:
    """Quantize blocks `xb` [..., R, nb, 16] to the IF format `fmt` (module docstring), given the tensor amax,
    the global scales of :func:`global_scales` and the block maxima. `u`: uniforms shaped like `xb` for the
    stochastic roundings, per block [..., nb] for "ms_eden"."""
    if rounding == "ms_eden":
        assert u is not None, "ms_eden draws per-block uniforms"
        return if_ms_eden_blocks(xb, s_dec, blk_amax, u)
    enc, blk_div = scale_constants(fmt, rounding)
    blk = blk_amax
    finite = jnp.isfinite(blk)
    s = jnp.where(finite, E4M3.round(ieee_div(blk, blk_div) * s_enc, saturate=True), jnp.nan)
    uc = u if rounding == "stochastic" else None  # "stochastic_unbiased" chooses on the round-to-nearest candidates
    err_fp, err_int = _candidate_errors(xb, s, s_dec, amax, blk, fmt, rule, enc, uc)
    is_int = materialize(err_int < err_fp)  # NaN errors keep FP; ties keep FP
    s = materialize(s)
    ay = jnp.abs(xb.astype(jnp.float32)) * per_element(inverse_scale(s, s_dec))
    g = GRIDS[fmt]
    return _element_result(xb, ay, fp_round(ay, fmt, u), int_round(ay, g, u), s, is_int, fmt)


def if_ms_eden_blocks(xb: jax.Array, s_dec: jax.Array, blk: jax.Array, u: jax.Array) -> IFBlockResult:
    """IF4 with MS-EDEN (fouroversix's ``eden_1x16s_fp4_kernel`` with ``QUANTIZED_VALUE_TYPE == if4``):
    :func:`~jaxlowfp._core.nvfp4_blocks.eden_prepare`, then both grids rounded to nearest in the scaled domain
    (E2M1 ties away from zero; INT ``rint(min(|y| * rcp, 7)) * step``), the INT grid kept where
    ``Σ (|y| - q_i * step)² < Σ (|y| - q_f)²`` (the kernel's choice: the scaled domain, MSE), and the chosen q's
    EDEN
    correction folded into a stochastically rounded scale (:func:`~jaxlowfp._core.nvfp4_blocks.eden_scale`).
    The kernel dequantizes an INT block as ``((q_i * step) * s') * S_dec``; here ``((q_i * s') * step) * S_dec``
    (the module's decoding), which may differ in the last bit."""
    g = GRIDS["if4"]
    s, y = eden_prepare(xb, s_dec, blk)
    ay = jnp.abs(y)
    a_fp = e2m1_half_up(ay)
    a_int = int_round(ay, g)
    q_int = a_int * np.float32(g.step)
    err_fp = _errors(y, a_fp, lambda ax, q: q, "mse")
    err_int = _errors(y, q_int, lambda ax, q: q, "mse")
    is_int = err_int < err_fp
    s2 = eden_scale(y, jnp.where(per_element(is_int), q_int, a_fp), s, u)
    return _element_result(xb, ay, a_fp, a_int, s2, is_int, "if4")


def decode_values(codes: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """(FP value, INT value) float32 of unpacked codes (one per element): both readings of every code."""
    g = GRIDS[fmt]
    c = codes.astype(jnp.int32)
    if fmt == "if4":
        return E2M1.decode(codes), ((c ^ 8) - 8).astype(jnp.float32)
    top = 1 << (g.bits - 1)
    mag = c & (top - 1)
    neg = (c & top) != 0
    iv = jnp.where(neg, -mag, mag).astype(jnp.float32)
    if fmt == "if3":
        fv = _e2m0_value(mag)
        return jnp.where(neg, -fv, fv), iv
    return (E2M3 if fmt == "if6_e2m3" else E3M2).decode(codes), iv


@functools.partial(jax.jit, static_argnames=("fmt", "rows", "shape", "dtype"))
def dequantize_blocks(codes, scales, global_scale, *, fmt: str, rows: int, shape: tuple[int, ...],
                      dtype: Any) -> jax.Array:
    """x̂ from codes and flagged E4M3 scales (`jaxlowfp.QArray` of an IF kind), in `dtype`."""
    g = GRIDS[fmt]
    flat = unpack_nibbles(codes) if fmt == "if4" else codes
    fv, iv = decode_values(flat, fmt)
    sbits = lax.bitcast_convert_type(scales, jnp.uint8)
    s = lax.bitcast_convert_type(sbits & jnp.uint8(0x7F), jnp.float8_e4m3fn).astype(jnp.float32)
    fb, ib = to_blocks(fv, rows), to_blocks(iv, rows)
    nb = fb.shape[-2]
    s = per_element(s.reshape(*fb.shape[:-3], nb))
    is_int = per_element((sbits >> 7).reshape(*fb.shape[:-3], nb) == 1)
    out = jnp.where(is_int, ((ib * s) * np.float32(g.step)) * global_scale, (fb * s) * global_scale)
    return from_blocks(out, shape, rows).astype(dtype)
