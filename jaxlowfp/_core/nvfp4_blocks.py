"""The per-block NVFP4 / Four Over Six math, the quantized-array type and argument checks (specs/nvfp4.md).

Shared by :mod:`jaxlowfp.nvfp4` (the public API: jit, chunking, kernel dispatch) and the Pallas kernel
(``pallas_kernels/nvfp4.py``), which reproduces :func:`quantize_blocks` bit for bit. Two-level scaling, every step
one IEEE float32 rounding::

    S_enc  = min(M*E / amax, FLT_MAX)   (1 if amax == 0);   S_dec = 1 / S_enc
    base   = (blk_amax / M) * S_enc;    s = E4M3_RNE_satfinite(base)   (4/6: s4 = e4m3(base * 1.5))
    inv    = min(1 / (s * S_dec), FLT_MAX);   q_i = E2M1_RNE_satfinite(x_i * inv);   x̂_i = (q_i * s) * S_dec
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxlowfp._core.bits import FLT_MAX, no_contract, true_divide
from jaxlowfp._core.checks import float_dtype, float_input, one_of
from jaxlowfp._core.minifloat import E2M1, E4M3, e2m1_index, e2m1_magnitude
from jaxlowfp._core.pytree import pytree_dataclass
from jaxlowfp._core.reduce import abs_max

Rule = Literal["static_6", "static_4", "abs_max", "mae", "mse"]
RULES = ("static_6", "static_4", "abs_max", "mae", "mse")
FOUR_OVER_SIX = ("abs_max", "mae", "mse")
ROUNDINGS = ("nearest", "stochastic")
BLOCK_SHAPES = ((1, 16), (16, 16))
BLOCK = 16


def rule_constants(rule: str) -> tuple[float, float]:
    """(M, E) of `rule`: the element max a block max maps to, and the E4M3 max the tensor scale targets."""
    one_of(rule, RULES, "rule")
    return {"static_6": (6.0, 448.0), "static_4": (4.0, 448.0)}.get(rule, (6.0, 256.0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class NVFP4Config:
    """Static NVFP4 quantization settings (hashable, so `jit` does not retrace).

    Attributes:
      rule: "static_6" | "static_4" | "abs_max" | "mae" | "mse".
      block_shape: (1, 16) blocks along the last axis, or (16, 16) tiles over the last two axes.
      rounding: "nearest" (RNE) or "stochastic" (P(up) = fractional distance; needs a PRNG key).
    """

    rule: Rule = "mse"
    block_shape: tuple[int, int] = (1, 16)
    rounding: Literal["nearest", "stochastic"] = "nearest"

    def __post_init__(self) -> None:
        one_of(self.rule, RULES, "rule")
        one_of(self.rounding, ROUNDINGS, "rounding")
        bs = self.block_shape
        ok = isinstance(bs, (tuple, list)) and all(isinstance(b, int) and not isinstance(b, bool) for b in bs)
        bs = tuple(bs) if ok else None
        if bs not in BLOCK_SHAPES:
            raise ValueError(f"block_shape={self.block_shape!r} is not supported; allowed: (1, 16), (16, 16)")
        object.__setattr__(self, "block_shape", bs)

    @property
    def rows(self) -> int:
        return self.block_shape[0]


@pytree_dataclass(data=("codes", "scales", "global_scale"), meta=("rule", "block_shape", "dtype", "shape"))
class NVFP4Array:
    """A quantized tensor (pytree).

    Attributes:
      codes: uint8 [..., K // 2], two E2M1 codes a byte (``sign<<3 | idx``), element 2j in the low nibble.
      scales: float8_e4m3fn, one per block: [..., K // 16] for (1, 16) blocks, [..., M // 16, K // 16] for tiles.
      global_scale: float32 scalar decode scale ``S_dec = 1 / S_enc`` (= amax / (M * E) to within an ulp).
      rule, block_shape, dtype, shape: static metadata (rule used, block shape, original dtype and shape).
    """

    codes: jax.Array
    scales: jax.Array
    global_scale: jax.Array
    rule: str
    block_shape: tuple[int, int]
    dtype: Any
    shape: tuple[int, ...]

    def dequantize(self, dtype: Any = None) -> jax.Array:
        """``x̂ = (q_i * s_b) * global_scale`` in `dtype` (default: the original dtype)."""
        dtype = float_dtype(self.dtype if dtype is None else dtype)
        return dequantize_blocks(self.codes, self.scales, self.global_scale, rows=self.block_shape[0],
                                 shape=self.shape, dtype=dtype)



def global_scales(amax: jax.Array, rule: str) -> tuple[jax.Array, jax.Array]:
    """(S_enc, S_dec) float32 scalars: ``S_enc = min(M*E / amax, FLT_MAX)``, 1 when amax == 0, NaN when amax is not
    finite or negative (a bad caller-supplied amax poisons the tensor visibly); ``S_dec = 1 / S_enc``."""
    m, e = rule_constants(rule)
    amax = jnp.asarray(amax, jnp.float32)
    s_enc = jnp.minimum((m * e) / amax, FLT_MAX)
    s_enc = jnp.where(amax == 0, 1.0, s_enc)
    s_enc = jnp.where(jnp.isfinite(amax) & (amax >= 0), s_enc, jnp.nan)
    return s_enc, 1.0 / s_enc


def _sequential_sum(t: jax.Array) -> jax.Array:
    """Σ over the last axis in index order ``((t0 + t1) + t2) + ...`` with IEEE adds (unrolled; the caller keeps
    multiplies out of reach of FMA contraction, see :func:`_no_contract`)."""
    acc = t[..., 0]
    for i in range(1, t.shape[-1]):
        acc = acc + t[..., i]
    return acc


def _pairwise_rows(r: jax.Array) -> jax.Array:
    """Σ over the last axis (length 1 or a power of two) by halves: r[:n/2] + r[n/2:], repeated (TE 2D order)."""
    while r.shape[-1] > 1:
        h = r.shape[-1] // 2
        r = r[..., :h] + r[..., h:]
    return r[..., 0]


def _e2m1_stochastic(ay: jax.Array, u: jax.Array) -> jax.Array:
    """Stochastic E2M1 rounding of |y| (float32 >= 0) with uniforms `u` in [0, 1): the grid neighbours lo < hi of
    min(|y|, 6), and hi with probability (|y| - lo) / (hi - lo). All steps are exact (power-of-two steps)."""
    a = jnp.minimum(ay, 6.0)
    step = jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0))
    lo = jnp.floor(a * (1.0 / step)) * step
    frac = (a - lo) * (1.0 / step)
    v = jnp.where(u < frac, lo + step, lo)
    return jnp.where(jnp.isnan(v), 0.0, v)  # NaN |y| -> 0, as with nearest rounding


class BlockResult(NamedTuple):
    """Output of :func:`quantize_blocks` for blocks shaped [..., R, 16]."""

    nibbles: jax.Array  # uint8 [..., R, 16]: sign<<3 | E2M1 index
    values: jax.Array  # float32 [..., R, 16]: the signed E2M1 value of each nibble (+0 where the scale is 0)
    scales: jax.Array  # float32 [...]: the chosen E4M3 block scale (a value of float8_e4m3fn, or NaN)
    map4: jax.Array  # bool [...]: block mapped its max to 4


def _candidate(xb: jax.Array, s: jax.Array, s_dec: jax.Array, u: jax.Array | None) -> jax.Array:
    """Signed E2M1 values (float32) of blocks `xb` [..., R, 16] with E4M3 block scales `s` [...]; +0 where s == 0.

    The sign is x's sign bit (inv > 0), so small negatives give -0 (code 0x8), as hardware and ml_dtypes do.
    """
    inv = jnp.minimum(1.0 / (s * s_dec), FLT_MAX)
    zero = s == 0
    inv = jnp.where(zero, 0.0, inv)[..., None, None]  # y = +-0 (NaN for Inf) -> magnitude 0 in zero-scale blocks
    sign = jnp.where(zero, jnp.uint32(0), jnp.uint32(0x80000000))[..., None, None]
    y = xb * inv
    ay = jnp.abs(y)
    if u is None:
        v = e2m1_magnitude(ay)
    else:
        v = _e2m1_stochastic(ay, u)
    bits = lax.bitcast_convert_type(v, jnp.uint32) | (lax.bitcast_convert_type(y, jnp.uint32) & sign)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _nibbles(q: jax.Array) -> jax.Array:
    """E2M1 codes (uint8, sign<<3 | idx) of signed E2M1 values `q` (exactly on the grid, so RNE is the identity)."""
    sign = (lax.bitcast_convert_type(q, jnp.uint32) >> 28) & jnp.uint32(8)
    return (sign.astype(jnp.int32) | e2m1_index(jnp.abs(q))).astype(jnp.uint8)


def _block_error(q, s, xb, amax, rule: str, denom: float) -> jax.Array:
    """Per-block error of a candidate in the original domain: x̂ = ((q*s)*amax)/denom."""
    xhat = true_divide((q * s[..., None, None]) * amax, denom)
    d = lax.optimization_barrier(xhat - xb)  # materialise: XLA:CPU's reduction fusions are slow on long chains
    if rule == "abs_max":
        return jnp.max(jnp.abs(d), axis=(-2, -1))
    t = no_contract(d * d) if rule == "mse" else jnp.abs(d)  # |d|: no multiply to contract
    return _pairwise_rows(_sequential_sum(t))


def quantize_blocks(
    xb: jax.Array, amax: jax.Array, s_enc: jax.Array, s_dec: jax.Array, *, rule: str, u: jax.Array | None = None
) -> BlockResult:
    """Quantize float32 blocks `xb` [..., R, 16] (R = 1: 1x16 blocks, R = 16: 16x16 tiles) given the tensor amax
    and the global scales from :func:`global_scales`. Exact operation order (each op one float32 rounding)::

        blk_amax = max |xb| over the block                         (NaN if any element is NaN)
        base     = (blk_amax / M) * s_enc                          (true division)
        s        = e4m3_rne_satfinite(base)                       4/6: s6 = that, s4 = e4m3(base * 1.5)
        s        = NaN where blk_amax is not finite
        inv      = min(1 / (s * s_dec), FLT_MAX)   (0 where s == 0);   y = x * inv
        |q|      = e2m1 RNE of |y| (thresholds, saturating at 6, NaN -> 0), or stochastic with uniforms `u`
                   [..., R, 16] (P(up) = fractional distance, the same draws for both 4/6 candidates)
        q        = |q| with y's sign bit (+0 where s == 0);   nibble = sign << 3 | E2M1 index of |q|
        4/6 only: x̂ = ((q * s) * amax) / (M * E) (true division); d = x̂ - x; err per block = sequential sum over
                  the 16 columns, then pairwise over rows (mse: d*d, mae: |d|) or max |d| (abs_max);
                  map4 = err4 < err6 (a NaN error keeps 6)

    The Pallas kernel (``pallas_kernels/nvfp4.py``) reproduces this order bit for bit.
    """
    m, e = rule_constants(rule)
    blk_amax = abs_max(xb, axis=(-2, -1))
    base = true_divide(blk_amax, m) * s_enc
    finite = jnp.isfinite(blk_amax)

    def e4m3(v):
        return jnp.where(finite, E4M3.round(v, saturate=True), jnp.nan)

    s6 = e4m3(base)
    if rule not in FOUR_OVER_SIX:
        q = _candidate(xb, s6, s_dec, u)
        return BlockResult(_nibbles(q), q, s6, jnp.full(s6.shape, rule == "static_4"))
    s4 = e4m3(base * 1.5)
    q6 = _candidate(xb, s6, s_dec, u)  # the same random draws for both candidates (as the CUDA kernels)
    q4 = _candidate(xb, s4, s_dec, u)
    err6 = _block_error(q6, s6, xb, amax, rule, m * e)
    err4 = _block_error(q4, s4, xb, amax, rule, m * e)
    map4 = err4 < err6
    q = jnp.where(map4[..., None, None], q4, q6)
    return BlockResult(_nibbles(q), q, jnp.where(map4, s4, s6), map4)


# ---- layout: tensors <-> blocks


def to_blocks(x: jax.Array, rows: int) -> jax.Array:
    """[..., M, K] -> [..., K/16, 1, 16] (rows = 1) or [..., M/16, K/16, 16, 16] (rows = 16, row-major tiles)."""
    k = x.shape[-1]
    if rows == 1:
        return x.reshape(*x.shape[:-1], k // BLOCK, 1, BLOCK)
    m = x.shape[-2]
    return x.reshape(*x.shape[:-2], m // BLOCK, BLOCK, k // BLOCK, BLOCK).swapaxes(-3, -2)


def from_blocks(xb: jax.Array, shape: tuple[int, ...], rows: int) -> jax.Array:
    if rows == 1:
        return xb.reshape(shape)
    return xb.swapaxes(-3, -2).reshape(shape)


def _check_x(x: Any, cfg: NVFP4Config) -> jax.Array:
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


def validate_args(x: Any, cfg: NVFP4Config, global_amax: Any, key: Any) -> tuple[jax.Array, jax.Array | None]:
    """Check `x`, the key and `global_amax` against `cfg` (clear errors); returns (x, global_amax as an array)."""
    x = _check_x(x, cfg)
    if cfg.rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG key: pass key=jax.random.key(...)")
    if cfg.rounding == "nearest" and key is not None:
        raise ValueError("key is only used with rounding='stochastic'; got rounding='nearest' and a key")
    if global_amax is not None:
        global_amax = float_input(global_amax, "global_amax")
        if global_amax.ndim != 0:
            raise ValueError(f"global_amax must be a scalar; got shape {global_amax.shape}")
    return x, global_amax


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
    out = (vb * scales.astype(jnp.float32).reshape(*vb.shape[:-2], 1, 1)) * global_scale
    return from_blocks(out, shape, rows).astype(dtype)
