"""NVFP4: E2M1 elements, an E4M3 scale per 16-element block and an FP32 per-tensor scale; Four Over Six (4/6).

Two-level scaling (``specs/nvfp4.md`` sections 0, 3.3, 4.1), every step one IEEE float32 rounding::

    S_enc  = min(M*E / amax, FLT_MAX)   (1 if amax == 0);   S_dec = 1 / S_enc  (stored as `global_scale`)
    base   = (blk_amax / M) * S_enc
    s      = E4M3_RNE_satfinite(base)             (4/6: s6 = e4m3(base), s4 = e4m3(base * 1.5))
    inv    = min(1 / (s * S_dec), FLT_MAX)
    q_i    = E2M1_RNE_satfinite(x_i * inv)        (codes 0 where s == 0)
    x̂_i    = (q_i * s) * S_dec                    (dequantize; q * s is exact)

Rules: ``static_6`` (standard NVFP4: M = 6, E = 448), ``static_4`` (M = 4, E = 448) and the 4/6 rules ``abs_max``,
``mae``, ``mse`` (M = 6, E = 256): both candidates are quantized, each block's error is measured after full
dequantization in the original domain, ``err = Σ (((q*s)*amax)/(6*E) - x)²`` (mse), ``Σ |.|`` (mae) or
``max |.|`` (abs_max), and map-to-4 is kept only if strictly better (``err4 < err6``; ties go to 6). Sums run
sequentially over the 16 elements of a block row (TE's order); for 16x16 tiles the 16 row sums are then added
pairwise (8+8, 4+4, 2+2, 1+1), TE's 2D order.

Bit-exactness under ``jit`` (``specs/nvfp4.md`` section 8): XLA turns ``a / broadcast(c)`` into ``a * (1/c)`` and
contracts ``err + d*d`` into an FMA; the divisions by M and by 6*E therefore divide by an
``optimization_barrier``-ed full-size operand, and the squared errors pass through an integer ``min`` (a no-op on
their bits) before the unrolled sequential sum, so no add ever sees a multiply.

Special values: the global amax of a tensor containing NaN or Inf is not finite, and then ``global_scale`` and every
block scale are NaN, so the whole tensor dequantizes to NaN (TE would instead fall back to ``S_enc = 1`` for Inf or
``FLT_MAX`` for NaN and hide it). With a caller-supplied finite ``global_amax``, only the blocks holding NaN/Inf get
a NaN scale. Values above a supplied ``global_amax`` saturate: the block scale at 448 and the elements at +-6.
XLA:CPU flushes float32 subnormals to zero, so tensors with amax below about 1e-30 (where ``s * S_dec`` or the
values themselves become subnormal) are outside the bit-exact range.

Stochastic rounding (gradients) rounds each scaled value to one of its two E2M1 neighbours with P(up) = fractional
distance, so it is unbiased wherever the value does not saturate; with a 4/6 rule both candidates use the same
draws (as the CUDA kernels do), and the per-block choice then depends on the draw.

The public functions run under an internal ``jax.jit`` (static configuration, so no retrace); the 4/6 rules process
the tensor in row chunks (``lax.map``) so their temporaries stay in cache, which changes no bit.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlowfp import dispatch, formats
from jaxlowfp._checks import float_input, one_of
from jaxlowfp._reduce import abs_max

__all__ = [
    "NVFP4Array", "NVFP4Config", "RULES", "ROUNDINGS", "BLOCK_SHAPES", "quantize", "dequantize", "fake_quantize",
    "selected_map4", "hadamard16", "hadamard_matrix", "global_scales", "quantize_blocks", "BlockResult",
    "true_divide", "pack_nibbles", "unpack_nibbles",
]

Rule = Literal["static_6", "static_4", "abs_max", "mae", "mse"]
RULES = ("static_6", "static_4", "abs_max", "mae", "mse")
ROUNDINGS = ("nearest", "stochastic")
BLOCK_SHAPES = ((1, 16), (16, 16))
BLOCK = 16
FLT_MAX = float(np.finfo(np.float32).max)
_FOUR_OVER_SIX = ("abs_max", "mae", "mse")


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


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["codes", "scales", "global_scale"],
    meta_fields=["rule", "block_shape", "dtype", "shape"],
)
@dataclasses.dataclass(frozen=True)
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
        return dequantize(self, self.dtype if dtype is None else dtype)


# ---------------------------------------------------------------------------------------------------------------
# The per-block math (shared with the Pallas kernel, which must match it bit for bit)


def true_divide(a: jax.Array, c: float) -> jax.Array:
    """IEEE ``a / c``: the divisor is a full-size array hidden behind a barrier, so XLA cannot turn the division
    into a reciprocal multiply (which differs in the last bit). Division by a power of two needs no guard."""
    if float(c) == 2.0 ** round(np.log2(c)):
        return a * (1.0 / c)  # exact either way
    return a / lax.optimization_barrier(jnp.full(a.shape, c, jnp.float32))


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


def _no_contract(t: jax.Array) -> jax.Array:
    """`t` (float32 >= 0 or NaN) unchanged, through an integer ``min`` with 0x7FFFFFFF: the adds that consume it
    then never see an ``fmul`` operand, so LLVM cannot fuse ``err + d*d`` into an FMA (specs/nvfp4.md 8.2).
    The compiler cannot drop the ``min``: a NaN product may carry a sign bit."""
    bits = lax.bitcast_convert_type(t, jnp.uint32)
    return lax.bitcast_convert_type(jnp.minimum(bits, jnp.uint32(0x7FFFFFFF)), jnp.float32)


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
        v = formats.e2m1_magnitude(ay)
    else:
        v = _e2m1_stochastic(ay, u)
    bits = lax.bitcast_convert_type(v, jnp.uint32) | (lax.bitcast_convert_type(y, jnp.uint32) & sign)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _nibbles(q: jax.Array) -> jax.Array:
    """E2M1 codes (uint8, sign<<3 | idx) of signed E2M1 values `q` (exactly on the grid, so RNE is the identity)."""
    sign = (lax.bitcast_convert_type(q, jnp.uint32) >> 28) & jnp.uint32(8)
    return (sign.astype(jnp.int32) | formats.e2m1_index(jnp.abs(q))).astype(jnp.uint8)


def _block_error(q, s, xb, amax, rule: str, denom: float) -> jax.Array:
    """Per-block error of a candidate in the original domain: x̂ = ((q*s)*amax)/denom."""
    xhat = true_divide((q * s[..., None, None]) * amax, denom)
    d = lax.optimization_barrier(xhat - xb)  # materialise: XLA:CPU's reduction fusions are slow on long chains
    if rule == "abs_max":
        return jnp.max(jnp.abs(d), axis=(-2, -1))
    t = _no_contract(d * d) if rule == "mse" else jnp.abs(d)  # |d|: no multiply to contract
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
        return jnp.where(finite, formats.E4M3.round(v, saturate=True), jnp.nan)

    s6 = e4m3(base)
    if rule not in _FOUR_OVER_SIX:
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


# ---------------------------------------------------------------------------------------------------------------
# Layout: tensors <-> blocks


def _to_blocks(x: jax.Array, rows: int) -> jax.Array:
    """[..., M, K] -> [..., K/16, 1, 16] (rows = 1) or [..., M/16, K/16, 16, 16] (rows = 16, row-major tiles)."""
    k = x.shape[-1]
    if rows == 1:
        return x.reshape(*x.shape[:-1], k // BLOCK, 1, BLOCK)
    m = x.shape[-2]
    return x.reshape(*x.shape[:-2], m // BLOCK, BLOCK, k // BLOCK, BLOCK).swapaxes(-3, -2)


def _from_blocks(xb: jax.Array, shape: tuple[int, ...], rows: int) -> jax.Array:
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


_CHUNK_ELEMENTS = 1 << 18  # 4/6 runs over row chunks of about this size, so its temporaries stay in cache


def _chunk_rows(n_rows: int, row_elems: int, rows: int) -> int:
    """Rows per chunk: the largest power-of-two multiple of `rows` dividing n_rows within the element budget."""
    c = rows
    while n_rows % (2 * c) == 0 and 2 * c * row_elems <= _CHUNK_ELEMENTS:
        c *= 2
    return c


@functools.partial(jax.jit, static_argnames=("cfg", "out"))
def _run(x: jax.Array, global_amax: jax.Array | None, key: jax.Array | None, *, cfg: NVFP4Config, out: str):
    """The whole quantizer under one jit. `out`: "q" -> (codes, scales, S_dec), "fake" -> x̂ in x.dtype,
    "map4" -> the per-block 4/6 choice."""
    xf = x.astype(jnp.float32)
    if x.dtype != jnp.float32:
        xf = lax.optimization_barrier(xf)  # convert once: XLA:CPU would otherwise redo the cast in every fusion
    amax = abs_max(xf) if global_amax is None else global_amax.astype(jnp.float32)
    s_enc, s_dec = global_scales(amax, cfg.rule)
    u = None if key is None else jax.random.uniform(key, x.shape, jnp.float32)

    def blocks(xs, us):  # [rows, K] slab -> (nibbles, x̂, scales, map4) in block layout
        res = quantize_blocks(_to_blocks(xs, cfg.rows), amax, s_enc, s_dec, rule=cfg.rule,
                              u=None if us is None else _to_blocks(us, cfg.rows))
        fake = (res.values * res.scales[..., None, None]) * s_dec
        return res.nibbles, fake, res.scales, res.map4

    k = x.shape[-1]
    x2 = xf.reshape(-1, k)  # 2D tiles stay whole: the row count of every chunk is a multiple of 16
    u2 = None if u is None else u.reshape(-1, k)
    n = x2.shape[0]
    c = _chunk_rows(n, k, cfg.rows) if cfg.rule in _FOUR_OVER_SIX else n
    if c == n:
        nib, fake, scales, map4 = blocks(x2, u2)
    else:  # the per-block math is independent across blocks, so chunking changes no bit
        xs = x2.reshape(n // c, c, k)
        us = None if u2 is None else u2.reshape(n // c, c, k)
        outs = lax.map(lambda a: blocks(*a), (xs, us))
        nib, fake, scales, map4 = (o.reshape(-1, *o.shape[2:]) for o in outs)  # merge chunk and block-row axes
    scale_shape = (*x.shape[:-1], k // BLOCK) if cfg.rows == 1 else (*x.shape[:-2], x.shape[-2] // BLOCK, k // BLOCK)
    if out == "map4":
        return map4.reshape(scale_shape)
    if out == "fake":
        return _from_blocks(fake, x.shape, cfg.rows).astype(x.dtype)
    codes = pack_nibbles(_from_blocks(nib, x.shape, cfg.rows))
    return codes, scales.reshape(scale_shape).astype(jnp.float8_e4m3fn), s_dec


def pack_nibbles(nib: jax.Array) -> jax.Array:
    """uint8 4-bit codes [..., K] -> bytes [..., K // 2], element 2j in the low nibble, 2j + 1 in the high one."""
    lo, hi = jnp.unstack(nib.reshape(*nib.shape[:-1], nib.shape[-1] // 2, 2), axis=-1)  # no slices: lowers in Triton
    return lo | (hi << 4)


def unpack_nibbles(codes: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_nibbles`."""
    nib = jnp.stack([codes & 0xF, codes >> 4], axis=-1)
    return nib.reshape(*codes.shape[:-1], codes.shape[-1] * 2)


# ---------------------------------------------------------------------------------------------------------------
# Public API


def _use_pallas(impl: str, kernel: str, rounding: str) -> bool:
    one_of(impl, dispatch.IMPLS, "impl")
    if rounding == "stochastic":
        if impl == "pallas":
            raise ValueError("impl='pallas': the NVFP4 kernel has no stochastic rounding; use impl='xla' or 'auto'")
        return False
    return dispatch.resolve_impl(impl, kernel=kernel) == "pallas"


def quantize(
    x: Any,
    *,
    rule: Rule = "mse",
    block_shape: tuple[int, int] = (1, 16),
    global_amax: Any = None,
    rounding: Literal["nearest", "stochastic"] = "nearest",
    key: jax.Array | None = None,
    impl: Literal["auto", "xla", "pallas"] = "auto",
) -> NVFP4Array:
    """NVFP4-quantize `x` (float32/bfloat16/float16, last axis a multiple of 16).

    Args:
      x: the tensor; blocks run along the last axis (the GEMM reduction axis).
      rule: "static_6" (standard NVFP4), "static_4", or the Four Over Six rules "abs_max", "mae", "mse".
      block_shape: (1, 16), or (16, 16) tiles over the last two axes (one scale and one 4/6 choice per tile).
      global_amax: a float scalar >= 0 used instead of max|x| (delayed or all-reduced amax): values above it
        saturate, and a negative or non-finite one makes every scale NaN; see the module docstring.
      rounding: "nearest" (RNE) or "stochastic" (unbiased, reproducible from `key`).
      key: PRNG key, required for (and only for) stochastic rounding.
      impl: "auto" (the Pallas kernel on a GPU that supports it, else this jnp code), "xla", or "pallas" (the
        kernel, bit-identical, or a clear error where it cannot run; it has no stochastic rounding).
    """
    if _use_pallas(impl, "nvfp4.quantize", rounding):
        from pallas_kernels import nvfp4 as kernel

        return kernel.quantize(x, rule=rule, block_shape=block_shape, global_amax=global_amax)
    cfg = NVFP4Config(rule=rule, block_shape=block_shape, rounding=rounding)
    x, global_amax = validate_args(x, cfg, global_amax, key)
    codes, scales, s_dec = _run(x, global_amax, key, cfg=cfg, out="q")
    return NVFP4Array(codes=codes, scales=scales, global_scale=s_dec, rule=cfg.rule, block_shape=cfg.block_shape,
                      dtype=x.dtype, shape=x.shape)


@functools.partial(jax.jit, static_argnames=("rows", "shape", "dtype"))
def _dequantize(codes, scales, global_scale, *, rows: int, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    vb = _to_blocks(formats.E2M1.decode(unpack_nibbles(codes)), rows)
    out = (vb * scales.astype(jnp.float32).reshape(*vb.shape[:-2], 1, 1)) * global_scale
    return _from_blocks(out, shape, rows).astype(dtype)


def dequantize(q: NVFP4Array, dtype: Any = jnp.float32) -> jax.Array:
    """``x̂ = (q_i * s_b) * global_scale`` (one float32 rounding: q * s is exact), cast to `dtype`."""
    if not isinstance(q, NVFP4Array):
        raise TypeError(f"dequantize expects an NVFP4Array; got {type(q).__name__}")
    dtype = formats._check_dtype(dtype)
    return _dequantize(q.codes, q.scales, q.global_scale, rows=q.block_shape[0], shape=q.shape, dtype=dtype)


def fake_quantize(
    x: Any,
    *,
    rule: Rule = "mse",
    block_shape: tuple[int, int] = (1, 16),
    global_amax: Any = None,
    rounding: Literal["nearest", "stochastic"] = "nearest",
    key: jax.Array | None = None,
    impl: Literal["auto", "xla", "pallas"] = "auto",
) -> jax.Array:
    """``dequantize(quantize(x, ...), x.dtype)`` bit for bit, without packing the codes."""
    if _use_pallas(impl, "nvfp4.fake_quantize", rounding):
        from pallas_kernels import nvfp4 as kernel

        return kernel.fake_quantize(x, rule=rule, block_shape=block_shape, global_amax=global_amax)
    cfg = NVFP4Config(rule=rule, block_shape=block_shape, rounding=rounding)
    x, global_amax = validate_args(x, cfg, global_amax, key)
    return _run(x, global_amax, key, cfg=cfg, out="fake")


def selected_map4(
    x: Any, *, rule: Rule = "mse", block_shape: tuple[int, int] = (1, 16), global_amax: Any = None
) -> jax.Array:
    """bool per block (shape of `NVFP4Array.scales`): True where the block maps its max to 4 (telemetry)."""
    cfg = NVFP4Config(rule=rule, block_shape=block_shape)
    x, global_amax = validate_args(x, cfg, global_amax, None)
    return _run(x, global_amax, None, cfg=cfg, out="map4")


# ---------------------------------------------------------------------------------------------------------------
# 16x16 random Hadamard transform (NVFP4 training recipe, specs/nvfp4.md 5.2)

_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def hadamard_matrix() -> np.ndarray:
    """``H = (1/4) diag(s) H16`` (float32, orthogonal): H16 the Sylvester matrix, s the recipe's fixed signs."""
    h = np.ones((1, 1), np.float32)
    for _ in range(4):
        h = np.block([[h, h], [h, -h]])
    return (0.25 * np.asarray(_RHT_SIGNS, np.float32)[:, None] * h).astype(np.float32)


def hadamard16(x: Any, axis: int = -1) -> jax.Array:
    """``x.reshape(..., 16) @ H`` along `axis` (size a multiple of 16), in float32, returned in x's dtype.

    H is orthogonal, so ``hadamard16(y) @ H.T`` undoes it; apply it to both GEMM operands along the reduction axis.
    """
    x = float_input(x, "x")
    if x.ndim == 0:
        raise ValueError("hadamard16 needs an array with at least one axis")
    axis = axis % x.ndim if -x.ndim <= axis < x.ndim else None
    if axis is None:
        raise ValueError(f"axis out of range for x of shape {x.shape}")
    if x.shape[axis] % BLOCK:
        raise ValueError(f"hadamard16 needs axis {axis} of x (shape {x.shape}) to be a multiple of 16")
    xm = jnp.moveaxis(x, axis, -1).astype(jnp.float32)
    xb = xm.reshape(*xm.shape[:-1], xm.shape[-1] // BLOCK, BLOCK)
    y = jnp.matmul(xb, jnp.asarray(hadamard_matrix()), precision=lax.Precision.HIGHEST)
    return jnp.moveaxis(y.reshape(xm.shape), -1, axis).astype(x.dtype)
