"""NVFP4 quantization (all rules, 1x16 blocks and 16x16 tiles) as a Pallas kernel: twin of ``jaxlowfp.nvfp4``.

The global scales ``(S_enc, S_dec)`` come from ``global_scales`` of ``jaxlowfp._core.nvfp4_blocks`` (XLA,
scalars; the tensor amax is
one XLA reduction unless ``global_amax`` is given). Each program then quantizes a ``(bm, bn)`` tile of the
``[rows, K]`` view of `x`, with the twin's arithmetic made exact on any backend (docs/kernels.md section 4):

    blk_amax = max |x| over the block            (NaN/Inf blocks flagged explicitly: Triton's max ignores NaN)
    base     = fl(blk_amax / M) * S_enc           (/6: integer-exact ``div_by_3_pow2``; /4: * 0.25)
    s        = E4M3 RNE satfinite(base)           (4/6: s4 = E4M3(base * 1.5)); integer bit math, stored as bytes
    inv      = INV[code(s)]                       gathered from a 128-entry table
    q        = E2M1 RNE(x * inv)                  (threshold compares, no division, no round)
    4/6:       x̂ = ±ERR[code(s), |q|], d = x̂*p - x*p (p = 2^-e for a block amax in [2^e, 2^(e+1)), e < 0, else
               1: the twin's ``error_scale``), error per block summed in the twin's order (columns 0..15
               sequentially, then rows pairwise), d*d kept from FMA contraction; map-4 iff err4 < err6
    fake:      y = ±FAKE[code(s), |q|]

The tables (INV = min(1 / (s * S_dec), FLT_MAX); ERR = ((|q|*s)*amax) / (M*E); FAKE = (|q|*s) * S_dec, over all 128
scale codes and 8 E2M1 magnitudes) are computed per call by XLA with the twin's own expressions, since Triton's f32
division is approximate. Outputs: packed codes (even element in the low nibble) and E4M3 scale bytes (viewed as
``float8_e4m3fn`` outside the kernel, so no fp8 cast is needed in Triton: sm_80 works), or for ``fake_quantize``
the dequantized values in x's dtype.
Stochastic rounding is not implemented in the kernel (``rounding="stochastic"`` raises: use ``impl="xla"``).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxlowfp._core import minifloat as formats
from jaxlowfp._core import nvfp4_blocks as ref
from jaxlowfp._core.qarray import QArray, kernel_array
from jaxlowfp._core.bits import FLT_MAX, div_by_3_pow2, true_divide
from jaxlowfp._core.reduce import abs_max
from ._common import (
    MAX_BLOCK_ELEMENTS,
    check_pow2,
    compiler_params,
    resolve_interpret,
    triton_lowering,
)

__all__ = ["quantize", "fake_quantize", "KERNEL_QUANTIZE", "KERNEL_FAKE_QUANTIZE", "DEFAULT_TILE", "DEFAULT_WARPS"]

KERNEL_QUANTIZE = "nvfp4.quantize"
KERNEL_FAKE_QUANTIZE = "nvfp4.fake_quantize"
# (bm, bn) on a GPU and warps per program: a tile with no register spill on sm_80, sm_90a and sm_100a for every
# rule, block and dtype (scripts/compile_kernels.py; (16, 64) and (32, 64) left ptxas spilling 8-16 bytes in some
# 4/6 quantize configurations). Its speed is unmeasured until bench/gpu_kernels.py sweeps it on a device.
DEFAULT_TILE = (16, 32)
DEFAULT_WARPS = 8
_NAN_CODE = 0x7F  # E4M3 NaN (scale of a block holding NaN or Inf)
_ERR, _FAKE = 0, 1024  # offsets in the product table (see _tables)
_B = ref.BLOCK


# ---- per-block math inside the kernel --------------------------------------------------------------------------


def _reduce_max(v: jnp.ndarray, axes: tuple[int, ...]) -> jnp.ndarray:
    """max over `axes`, one axis at a time from the last (a multi-axis reduce fails to trace under an abstract mesh)."""
    for a in sorted(axes, reverse=True):
        v = jnp.max(v, axis=a)
    return v


def _block_amax(xb: jnp.ndarray, axes: tuple[int, ...]) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(max |x|, finite) per block; finite is False where the block holds NaN or +-Inf (the twin's NaN scale).

    NaN is handled explicitly: Triton's max ignores NaN, and so does XLA:CPU's vectorised reduce in some positions.
    """
    ax = jnp.abs(xb)
    nonfinite = (~jnp.isfinite(xb)).astype(jnp.int32)
    return _reduce_max(jnp.where(jnp.isnan(ax), 0.0, ax), axes), _reduce_max(nonfinite, axes) == 0


def _scale_code(v: jnp.ndarray, finite: jnp.ndarray) -> jnp.ndarray:
    """E4M3 code (int32, 0..0x7F) of the satfinite RNE rounding of v >= 0; NaN code where the block is not finite."""
    code = formats.E4M3.encode(v, saturate=True).astype(jnp.int32) & 0x7F  # a NaN `v` gives 0x7F too
    return jnp.where(finite, code, _NAN_CODE)


def _candidate(xb, code, bshape, inv_ref):
    """(E2M1 index, negative) per element of blocks `xb` with E4M3 scale `code` (broadcast to the blocks by bshape).

    Where the scale is 0 the twin writes the code 0 (value +0): index 0, not negative.
    """
    inv = inv_ref[code].reshape(bshape)  # gather from the 128-entry table (an input ref, not a captured constant)
    y = xb * inv
    neg = (lax.bitcast_convert_type(y, jnp.uint32) >> 31) == 1  # x's sign, also for -0.0
    zero = (code == 0).reshape(bshape)
    return jnp.where(zero, 0, formats.e2m1_index(jnp.abs(y))), neg & ~zero


def _lookup(tbl_ref, offset: int, code, bshape, idx, neg):
    """Signed table value ``±T[offset + 8 * code + idx]``: T holds |v| * s products precomputed by XLA."""
    v = tbl_ref[offset + code.reshape(bshape) * 8 + idx]
    return jnp.where(neg, -v, v)


def _columns(t: jnp.ndarray) -> list[jnp.ndarray]:
    """The entries of the last axis (a power of two long) as separate arrays, in index order.

    Built from splits of a trailing axis of size 2 (``tt.split``): static slices do not lower to Triton.
    """
    n = t.shape[-1]
    if n == 1:
        return [t.reshape(t.shape[:-1])]
    even, odd = jnp.unstack(t.reshape(*t.shape[:-1], n // 2, 2), axis=-1)
    out: list[Any] = [None] * n
    out[0::2], out[1::2] = _columns(even), _columns(odd)
    return out


def _sequential_sum(t: jnp.ndarray) -> jnp.ndarray:
    """Σ over the last axis in the order 0, 1, ..., n-1 (the twin's ``lax.scan``)."""
    cols = _columns(t)
    total = cols[0]
    for c in cols[1:]:
        total = total + c
    return total


def _pairwise(r: jnp.ndarray, axis: int) -> jnp.ndarray:
    """Σ over `axis` by halves (r[:n/2] + r[n/2:], repeated): the twin's 2D order. Each step sums an axis of 2."""
    while r.shape[axis] > 1:
        h = r.shape[axis] // 2
        r = jnp.sum(r.reshape(*r.shape[:axis], 2, h, *r.shape[axis + 1 :]), axis=axis)
    return r.reshape(*r.shape[:axis], *r.shape[axis + 1 :])


def _block_error(xhat, xb, p, opaque_zero, rule: str, tile: bool) -> jnp.ndarray:
    """The twin's per-block error of a candidate from its dequantized values x̂: mse / mae / abs_max, of
    ``x̂ * p - x * p`` with the block's exact power of two p (the twin's ``error_scale``)."""
    d = xhat * p - xb * p
    if rule == "abs_max":  # NaN cannot occur here: non-finite blocks are excluded from the choice
        return _reduce_max(jnp.abs(d), (1, 3) if tile else (2,))
    if rule == "mse":
        # OR with a runtime zero: the product is rounded on its own, never contracted into an FMA with the sum.
        t = lax.bitcast_convert_type(lax.bitcast_convert_type(d * d, jnp.uint32) | opaque_zero, jnp.float32)
    else:
        t = jnp.abs(d)
    if not tile:
        return _sequential_sum(t)
    return _pairwise(_sequential_sum(t), axis=1)  # t: (bm/16, 16 rows, bn/16, 16 cols)


def _kernel(p_ref, inv_ref, tbl_ref, x_ref, *out_refs, rule: str, tile: bool, fake: bool):
    s_enc = p_ref[0]
    opaque_zero = lax.bitcast_convert_type(p_ref[1], jnp.uint32)  # 0.0 at run time
    x = x_ref[...].astype(jnp.float32)
    bm, bn = x.shape
    if tile:
        xb = x.reshape(bm // _B, _B, bn // _B, _B)
        bshape, axes = (bm // _B, 1, bn // _B, 1), (1, 3)
    else:
        xb = x.reshape(bm, bn // _B, _B)
        bshape, axes = (bm, bn // _B, 1), (2,)
    m, _ = ref.rule_constants(rule)
    blk_amax, finite = _block_amax(xb, axes)
    base = (div_by_3_pow2(blk_amax, 1) if m == 6.0 else blk_amax * 0.25) * s_enc  # fl(blk_amax / M) * S_enc
    code = _scale_code(base, finite)
    idx, neg = _candidate(xb, code, bshape, inv_ref)
    if rule in ("abs_max", "mae", "mse"):
        code4 = _scale_code(base * 1.5, finite)
        idx4, neg4 = _candidate(xb, code4, bshape, inv_ref)
        p = ref.error_scale(blk_amax).reshape(bshape)  # 2^-e for tiny blocks: their squared errors stay normal
        err6 = _block_error(_lookup(tbl_ref, _ERR, code, bshape, idx, neg), xb, p, opaque_zero, rule, tile)
        err4 = _block_error(_lookup(tbl_ref, _ERR, code4, bshape, idx4, neg4), xb, p, opaque_zero, rule, tile)
        map4 = (err4 < err6) & finite  # twin: NaN errors (non-finite block) compare False
        sel = map4.reshape(bshape)
        idx, neg, code = jnp.where(sel, idx4, idx), jnp.where(sel, neg4, neg), jnp.where(map4, code4, code)
    if fake:
        (y_ref,) = out_refs
        y_ref[...] = _lookup(tbl_ref, _FAKE, code, bshape, idx, neg).reshape(bm, bn).astype(y_ref.dtype)
        return
    codes_ref, scales_ref = out_refs
    nib = (jnp.where(neg, 8, 0) | idx).astype(jnp.uint8)
    lo, hi = jnp.unstack(nib.reshape(bm, bn // 2, 2), axis=-1)
    codes_ref[...] = lo | (hi << 4)
    scales_ref[...] = code.astype(jnp.uint8).reshape(scales_ref.shape)


# ---- wrapper ---------------------------------------------------------------------------------------------------


def _tables(amax: jax.Array, s_dec: jax.Array, rule: str) -> tuple[jax.Array, jax.Array]:
    """Per-call tables computed by XLA with the twin's own expressions, gathered in the kernel.

    ``inv[c] = min(1 / (s_c * S_dec), FLT_MAX)`` for the 128 non-negative E4M3 codes c (Triton's f32 division is
    approximate), and for every scale code c and E2M1 index i (``8 * c + i``) the magnitudes of
    ``x̂ = ((v_i * s_c) * amax) / (M * E)`` (the 4/6 error, IEEE division via ``true_divide``) at
    ``_ERR`` and of the dequantized value ``(v_i * s_c) * S_dec`` at ``_FAKE``. A negative element's values are the
    negated magnitudes exactly (every step is a sign-symmetric IEEE operation).
    """
    s = formats.E4M3.decode(jnp.arange(128, dtype=jnp.uint8))
    inv = jnp.minimum(1.0 / (s * s_dec), FLT_MAX)
    qs = formats.E2M1.decode(jnp.arange(8, dtype=jnp.uint8))[None, :] * s[:, None]  # exact: 2 x 4 significant bits
    m, e = ref.rule_constants(rule)
    err = true_divide(qs * amax, m * e)
    return inv, jnp.concatenate([err.reshape(-1), (qs * s_dec).reshape(-1)])


@functools.partial(jax.jit, static_argnames=("rule", "tile", "fake", "interpret", "bm", "bn", "num_warps"))
def _run(x2, amax, *, rule: str, tile: bool, fake: bool, interpret: bool, bm: int, bn: int, num_warps: int):
    rows, k = x2.shape
    s_enc, s_dec = ref.global_scales(amax, rule)
    inv, tbl = _tables(amax, s_dec, rule)
    params = jnp.stack([s_enc, jnp.float32(0.0)])
    grid = (pl.cdiv(rows, bm), pl.cdiv(k, bn))
    sb = bm // _B if tile else bm
    if fake:
        out_shape = [jax.ShapeDtypeStruct((rows, k), x2.dtype)]
        out_specs = [pl.BlockSpec((bm, bn), lambda i, j: (i, j))]
    else:
        srows = rows // _B if tile else rows
        out_shape = [jax.ShapeDtypeStruct((rows, k // 2), jnp.uint8), jax.ShapeDtypeStruct((srows, k // _B), jnp.uint8)]
        out_specs = [
            pl.BlockSpec((bm, bn // 2), lambda i, j: (i, j)),
            pl.BlockSpec((sb, bn // _B), lambda i, j: (i, j)),
        ]
    outs = pl.pallas_call(
        functools.partial(_kernel, rule=rule, tile=tile, fake=fake),
        grid=grid,
        in_specs=[
            pl.BlockSpec((2,), lambda i, j: (0,)),
            pl.BlockSpec((128,), lambda i, j: (0,)),
            pl.BlockSpec((2048,), lambda i, j: (0,)),
            pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=compiler_params(interpret, num_warps),
        name=f"nvfp4_{'fake_' if fake else ''}quantize_{rule}",
    )(params, inv, tbl, x2)
    return outs, s_dec


def _prepare(x, rule, block_shape, global_amax, rounding, key, interpret, tile_shape, num_warps, kernel):
    cfg, x, ga = ref.validate_kernel_args(x, rule, block_shape, global_amax, rounding, key, f"Pallas {kernel}")
    x2 = x.reshape(-1, x.shape[-1])
    rows, k = x2.shape
    amax = abs_max(x.astype(jnp.float32)) if ga is None else ga.astype(jnp.float32)
    interpret = resolve_interpret(interpret, kernel=kernel)
    tile = cfg.rows > 1
    lo_rows = _B if tile else 1
    if tile_shape is None:
        if interpret:  # few grid steps: interpret mode costs O(steps x array size)
            bn = pl.next_power_of_2(k)
            bm = min(max(pl.next_power_of_2(rows), lo_rows), max(MAX_BLOCK_ELEMENTS // bn, lo_rows))
        else:
            bm, bn = DEFAULT_TILE
            bn = min(bn, max(pl.next_power_of_2(k), _B))
    elif isinstance(tile_shape, tuple) and len(tile_shape) == 2:
        bm, bn = tile_shape
    else:
        raise ValueError(f"tile_shape must be a pair (bm, bn) of powers of two; got {tile_shape!r}")
    check_pow2(bm, "tile rows (bm)", lo=lo_rows)
    check_pow2(bn, "tile columns (bn)", lo=_B)
    if bm * bn > MAX_BLOCK_ELEMENTS:
        raise ValueError(f"tile {bm}x{bn} has more than 2^20 elements (Triton's limit)")
    num_warps = DEFAULT_WARPS if num_warps is None else num_warps
    return cfg, x, x2, amax, dict(rule=cfg.rule, tile=tile, interpret=interpret, bm=bm, bn=bn, num_warps=num_warps)


def quantize(
    x: Any,
    *,
    rule: ref.NVFP4Rule = "static_6",
    block_shape: tuple[int, int] = (1, 16),
    global_amax: Any = None,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    interpret: bool | None = None,
    tile_shape: tuple[int, int] | None = None,
    num_warps: int | None = None,
) -> QArray:
    """``jaxlowfp.nvfp4.quantize`` as a Pallas kernel (same arguments and result, bit for bit; nearest rounding).

    Extra keyword arguments:
      interpret: True: Pallas interpret mode; False: compiled Triton; None: interpret if
        ``JAXLOWFP_PALLAS_INTERPRET=1``, else compiled on a supporting GPU, else ``PallasUnavailableError``.
      tile_shape: (bm, bn) elements per program over the ``[rows, K]`` view, powers of two, bn >= 16, bm >= 16
        for 16x16 tiles, bm * bn <= 2^20 (default DEFAULT_TILE compiled; interpret mode uses one large tile).
      num_warps: Triton warps per program (default DEFAULT_WARPS).
    """
    cfg, x, x2, amax, static = _prepare(
        x, rule, block_shape, global_amax, rounding, key, interpret, tile_shape, num_warps, KERNEL_QUANTIZE
    )
    with triton_lowering(static["interpret"]):
        (codes, scale_bytes), s_dec = _run(x2, amax, fake=False, **static)
    return kernel_array(x, cfg, codes, scale_bytes, s_dec)


def fake_quantize(
    x: Any,
    *,
    rule: ref.NVFP4Rule = "static_6",
    block_shape: tuple[int, int] = (1, 16),
    global_amax: Any = None,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    interpret: bool | None = None,
    tile_shape: tuple[int, int] | None = None,
    num_warps: int | None = None,
) -> jax.Array:
    """``jaxlowfp.nvfp4.fake_quantize`` as one fused Pallas kernel (quantize and dequantize, no packed codes)."""
    _, x, x2, amax, static = _prepare(
        x, rule, block_shape, global_amax, rounding, key, interpret, tile_shape, num_warps, KERNEL_FAKE_QUANTIZE
    )
    with triton_lowering(static["interpret"]):
        (y,), _ = _run(x2, amax, fake=True, **static)
    return y.reshape(x.shape)
