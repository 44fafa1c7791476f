"""NVFP4 quantization (every rule, 1x16 blocks and 16x16 tiles, nearest rounding) as Mosaic GPU kernels (sm_90+):
same arguments and results as :mod:`pallas_kernels.nvfp4` (the Triton kernels), bit for bit; twin ``jaxlowfp.nvfp4``.

The global scales ``(S_enc, S_dec)`` come from ``global_scales`` (XLA, scalars; the tensor amax is one XLA
reduction unless ``global_amax`` is given). Each 16-element block row lives in one thread (layout
``TCGEN05_TMEM_NATIVE``), so a block's reductions run in that thread in the twin's order
(``jaxlowfp._core.nvfp4_blocks.quantize_blocks``), every step one exact float32 operation:

    blk_amax = max |x| over the block                       (NaN/Inf: the twin's NaN scale)
    base     = fl(blk_amax / M) * S_enc                     (/6: ``div_by_3_pow2``; /4: * 0.25)
    s        = E4M3 RNE satfinite(base)                     (4/6: s4 = E4M3(base * 1.5)); its code is the scale byte
    inv      = min(1 / (s * S_dec), FLT_MAX)                (``_mosaic.reciprocal``: integer, correctly rounded)
    q        = E2M1 RNE(x * inv), x's sign (+0 where s = 0)
    4/6:       x̂ = ((q * s) * amax) / 1536 (``div_by_3_pow2``, once per block for each of the 8 E2M1 magnitudes,
               picked by the same threshold compares that give q); d = x̂*p - x*p (p: the twin's
               ``error_scale`` of the block amax, an exact power of two); error = sequential sum over the 16
               columns of d^2 (kept from FMA contraction) or |d| (or their max), then by halves over the rows of
               a 16x16 tile; map-4 iff err4 < err6
    fake:      y = (q * s) * S_dec in x's dtype

1x16 blocks: the ``[rows, K]`` view is a list of blocks ``[rows*K/16, 16]``; a program takes ``blocks_per_program``
of them (one block row per thread per 128). 16x16 tiles: a program takes one tile row of 128 tiles side by side
(2048 columns) and walks the 16 rows in loops, reading each row from global memory twice (static rules: max, then
output) or three times (4/6: max, errors, output); the re-reads hit the caches, and a whole tile (256 values per
thread) would not fit in registers. Whole programs read `x` in place; the remainder (fewer than one program's
blocks, or the last ``K mod 2048`` columns of 16x16 tiles, all of them when K < 2048) runs on a zero-padded copy.
Outputs: packed codes (even element in the low nibble) and E4M3 scale bytes (viewed as ``float8_e4m3fn`` outside),
or for ``fake_quantize`` the dequantized values. Stochastic rounding is not implemented (``impl="xla"``).
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
from jaxlowfp._core.bits import FLT_MAX, SIGN, div_by_3_pow2, no_contract, u32
from jaxlowfp._core.reduce import abs_max
from . import _mosaic as mg

__all__ = ["quantize", "fake_quantize", "KERNEL_QUANTIZE", "KERNEL_FAKE_QUANTIZE", "DEFAULT_BLOCKS"]

KERNEL_QUANTIZE = "nvfp4.quantize"
KERNEL_FAKE_QUANTIZE = "nvfp4.fake_quantize"
DEFAULT_BLOCKS = 128  # 1x16 blocks per program: one per thread
_MAX_BLOCKS = 1024
_B = ref.BLOCK
_TILES = mg.THREADS  # 16x16 tiles per program (one per thread): 2048 columns
_NAN_CODE = 0x7F  # E4M3 NaN: the scale of a block holding NaN or Inf


# ---- per-block math: a block row is an array [n, 16] (row r in thread r mod 128), per-block values are [n, 1] ----

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of E2M1 index 0..7
_THRESHOLDS = formats.E2M1_THRESHOLDS  # the compares of ``e2m1_index``: idx = number of thresholds passed


def _load(x_ref, dtype) -> jnp.ndarray:
    """The [n, 16] block rows in `x_ref` (global memory) as float32, one column per register (slices are free)."""
    x = mg.load(x_ref, mg.rows_layout(mg.vector_length(dtype))).astype(jnp.float32)
    return mg.require().layout_cast(x, mg.rows_layout(1))


def _cols(x: jnp.ndarray) -> list[jnp.ndarray]:
    return [x[:, j : j + 1] for j in range(x.shape[1])]


def _wide(v: jnp.ndarray) -> jnp.ndarray:
    """A per-block value [n, 1] repeated over the block's 16 columns."""
    return jnp.concatenate([v] * _B, axis=1)


def _with_sign(v, sign_bit):
    return lax.bitcast_convert_type(lax.bitcast_convert_type(v, jnp.uint32) | sign_bit, jnp.float32)


class _Scale:
    """One candidate block scale s (E4M3 value and code) and the per-block values derived from it."""

    def __init__(self, base, finite, s_dec, amax=None):
        self.s = jnp.where(finite, formats.E4M3.round(base, saturate=True), jnp.nan)
        self.code = jnp.where(finite, formats.E4M3.encode(base, saturate=True).astype(jnp.int32) & 0x7F, _NAN_CODE)
        zero = self.s == 0
        self.inv = jnp.where(zero, 0.0, jnp.minimum(mg.reciprocal(self.s * s_dec), FLT_MAX))
        self.sign = jnp.where(zero, u32(0), u32(SIGN))  # +0 codes where the scale is 0
        self.xhat = None
        if amax is not None:  # 4/6: |x̂| of each E2M1 magnitude v, x̂ = ((v * s) * amax) / (6 * 256), one division
            t = jnp.concatenate([v * self.s for v in _E2M1], axis=1) * amax
            self.xhat = _cols(div_by_3_pow2(t, 9))

    def select(self, other: "_Scale", take_other) -> "_Scale":
        out = object.__new__(_Scale)
        out.xhat = None
        for k in ("s", "code", "inv", "sign"):
            setattr(out, k, jnp.where(take_other, getattr(other, k), getattr(self, k)))
        return out

    def round(self, x, *, value: str | None = None):
        """E2M1 index (int32) and sign bit (uint32) of ``x * inv`` for block rows `x` [n, 16], and where asked
        the signed E2M1 value q ("q") or x̂ ("xhat") from the same threshold compares."""
        y = x * _wide(self.inv)
        ay = jnp.abs(y)
        idx = jnp.zeros(ay.shape, jnp.int32)
        table = {"q": [jnp.float32(v) for v in _E2M1], "xhat": [_wide(v) for v in self.xhat or ()]}.get(value)
        picked = None if table is None else jnp.broadcast_to(table[0], ay.shape)
        for k, (t, inclusive) in enumerate(_THRESHOLDS, start=1):
            hit = (ay >= t) if inclusive else (ay > t)
            idx = idx + hit.astype(jnp.int32)
            if table is not None:
                picked = jnp.where(hit, table[k], picked)
        sign_bit = lax.bitcast_convert_type(y, jnp.uint32) & _wide(self.sign)
        return idx, sign_bit, (None if table is None else _with_sign(picked, sign_bit))


def _row_error(x, scale: _Scale, rule: str, p):
    """The twin's error of one block row: sequential sum over the 16 columns (mse, mae) or their max (abs_max) of
    ``x̂ * p - x * p``, p [n, 1] the block's exact power of two (the twin's ``error_scale``)."""
    _, _, xhat = scale.round(x, value="xhat")
    d = xhat * _wide(p) - x * _wide(p)
    t = no_contract(d * d) if rule == "mse" else jnp.abs(d)  # no FMA: the twin rounds d*d on its own
    acc = None
    for c in _cols(t):
        acc = c if acc is None else (jnp.maximum(acc, c) if rule == "abs_max" else acc + c)
    return acc


def _block_max(x, acc=None):
    for c in _cols(jnp.abs(x)):  # NaN-propagating like the twin's (Mosaic max.NaN, XLA max)
        acc = c if acc is None else jnp.maximum(acc, c)
    return acc


def _scales(blk, p_ref, rule: str):
    """(s6, s4 or None, finite) for block maxima `blk` [n, 1]."""
    s_enc, s_dec, amax = p_ref[0], p_ref[1], p_ref[2]
    m, _ = ref.rule_constants(rule)
    base = (div_by_3_pow2(blk, 1) if m == 6.0 else blk * 0.25) * s_enc  # fl(blk / M) * S_enc
    finite = mg.is_finite(blk)
    four_six = rule in ref.FOUR_OVER_SIX
    s6 = _Scale(base, finite, s_dec, amax if four_six else None)
    return s6, (_Scale(base * 1.5, finite, s_dec, amax) if four_six else None), finite


def _store_row(x, scale: _Scale, s_dec, out_ref, *, fake: bool) -> None:
    """Row outputs: packed codes [n, 8] (uint8) or dequantized values [n, 16] in out_ref's dtype."""
    plgpu = mg.require()
    if fake:
        _, _, q = scale.round(x, value="q")
        out = ((q * _wide(scale.s)) * s_dec).astype(out_ref.dtype)
        mg.store(out_ref, plgpu.layout_cast(out, mg.rows_layout(mg.vector_length(out_ref.dtype))))
        return
    idx, sign_bit, _ = scale.round(x)
    nib = _cols((sign_bit >> u32(28)).astype(jnp.int32) | idx)
    packed = jnp.concatenate([nib[2 * j] | (nib[2 * j + 1] << 4) for j in range(_B // 2)], axis=1)
    mg.store(out_ref, plgpu.layout_cast(packed.astype(jnp.uint8), mg.rows_layout(_B // 2)))


def _kernel_1x16(p_ref, x_ref, *out_refs, rule: str, blocks: int, fake: bool):
    """`blocks` 1x16 blocks, one row per thread (and per 128 blocks)."""
    i = lax.axis_index("i")
    rows = pl.ds(i * blocks, blocks)
    x = _load(x_ref.at[rows, :], x_ref.dtype)
    blk = _block_max(x)
    s6, s4, finite = _scales(blk, p_ref, rule)
    scale = s6
    if s4 is not None:
        p = ref.error_scale(blk)
        map4 = (_row_error(x, s4, rule, p) < _row_error(x, s6, rule, p)) & finite  # NaN error: keep 6 (twin)
        scale = s6.select(s4, map4)
    _store_row(x, scale, p_ref[1], out_refs[0].at[rows, :], fake=fake)
    if not fake:
        mg.store(out_refs[1].at[rows, :], scale.code.astype(jnp.uint8))


def _kernel_16x16(p_ref, x_ref, *out_refs, rule: str, fake: bool):
    """128 16x16 tiles side by side (one per thread), walking their 16 rows: max, (4/6) errors, outputs."""
    i, j = lax.axis_index("i"), lax.axis_index("j")
    tiles = pl.ds(j * _TILES, _TILES)

    def row(r):
        return _load(x_ref.at[i * _B + r, tiles, :], x_ref.dtype)

    first = row(0)
    blk = lax.fori_loop(1, _B, lambda r, acc: _block_max(row(r), acc), _block_max(first))
    s6, s4, finite = _scales(blk, p_ref, rule)
    scale = s6
    if s4 is not None:
        p = ref.error_scale(blk)

        # The twin sums a tile's row errors by halves: a_k = e_k + e_{k+8}, then (a_k + a_{k+4}), ...
        def halves(k, slots):
            x_lo, x_hi, out = row(k), row(k + _B // 2), []
            for s in (s6, s4):
                lo, hi = _row_error(x_lo, s, rule, p), _row_error(x_hi, s, rule, p)
                out.append(jnp.maximum(lo, hi) if rule == "abs_max" else lo + hi)
            return tuple(tuple(jnp.where(k == m, a, slot) for m, slot in enumerate(sl)) for a, sl in zip(out, slots))

        zero = mg.require().layout_cast(jnp.zeros(blk.shape, jnp.float32), mg.rows_layout(1))  # the carry's layout
        e6, e4 = lax.fori_loop(0, _B // 2, halves, ((zero,) * (_B // 2),) * 2)
        map4 = (_over_rows(list(e4), rule) < _over_rows(list(e6), rule)) & finite
        scale = s6.select(s4, map4)

    def emit(r, carry):
        _store_row(row(r), scale, p_ref[1], out_refs[0].at[i * _B + r, tiles, :], fake=fake)
        return carry

    lax.fori_loop(0, _B, emit, 0)
    if not fake:
        mg.store(out_refs[1].at[i, tiles, :], scale.code.astype(jnp.uint8))


def _over_rows(errs: list, rule: str):
    """Combine per-row errors by halves (the twin's 2D order) or by max."""
    op = jnp.maximum if rule == "abs_max" else jnp.add
    while len(errs) > 1:
        h = len(errs) // 2
        errs = [op(errs[k], errs[k + h]) for k in range(h)]
    return errs[0]


# ---- wrapper -----------------------------------------------------------------------------------------------------


def _call(params, xb, programs: int, *, rule: str, tile: bool, fake: bool, blocks: int, interpret, rest=False):
    """The kernel over the first `programs` programs of `xb` ([nb, 16] block rows for 1x16, [rows, K/16, 16] for
    16x16); outputs cover all of `xb` (what lies beyond those programs is left unwritten)."""
    plgpu = mg.require()
    u8 = jnp.uint8
    if tile:
        rows, nbc, _ = xb.shape
        grid, names = (rows // _B, programs), ("i", "j")
        out = [jax.ShapeDtypeStruct(xb.shape, xb.dtype)] if fake else [
            jax.ShapeDtypeStruct((rows, nbc, _B // 2), u8), jax.ShapeDtypeStruct((rows // _B, nbc, 1), u8)]
        body = functools.partial(_kernel_16x16, rule=rule, fake=fake)
    else:
        nb = xb.shape[0]
        grid, names = (programs,), ("i",)
        out = [jax.ShapeDtypeStruct(xb.shape, xb.dtype)] if fake else [
            jax.ShapeDtypeStruct((nb, _B // 2), u8), jax.ShapeDtypeStruct((nb, 1), u8)]
        body = functools.partial(_kernel_1x16, rule=rule, blocks=blocks, fake=fake)
    return plgpu.kernel(
        body, out_type=tuple(out), grid=grid, grid_names=names, compiler_params=mg.compiler_params(),
        interpret=interpret,
        kernel_name=(f"nvfp4_{'fake_' if fake else ''}quantize_{rule}{'_16x16' if tile else ''}"
                     f"{'_rest' if rest else ''}"),
    )(params, xb)


def _padded_call(params, xb, axis: int, per_program: int, **kw):
    """`_call` over `xb` whose `axis` need not be a multiple of `per_program`: the whole programs read `xb` in
    place; the remainder runs on a zero-padded copy (less than one program's width) and is written into the
    outputs with dynamic_update_slice (in place in XLA)."""
    n = xb.shape[axis]
    programs = n // per_program
    body = programs * per_program
    outs = _call(params, xb, programs, **kw) if programs else None
    if n > body:
        width = mg.round_up(n - body, mg.THREADS)
        pad = [(0, 0)] * xb.ndim
        pad[axis] = (0, width - (n - body))
        rest = jnp.pad(lax.slice_in_dim(xb, body, n, axis=axis), pad)
        tail = _call(params, rest, 1, rest=True, **(kw if kw["tile"] else dict(kw, blocks=width)))
        tail = [lax.slice_in_dim(t, 0, n - body, axis=axis) for t in tail]
        outs = tail if outs is None else [
            lax.dynamic_update_slice_in_dim(o, t, body, axis=axis) for o, t in zip(outs, tail)]
    return outs


@functools.partial(jax.jit, static_argnames=("rule", "tile", "fake", "interpret", "blocks"))
def _run(x, amax, *, rule: str, tile: bool, fake: bool, interpret, blocks: int):
    s_enc, s_dec = ref.global_scales(amax, rule)
    params = jnp.stack([s_enc, s_dec, amax])
    k = x.shape[-1]
    if tile:
        xb = x.reshape(-1, k // _B, _B)  # [rows, tiles across, 16]
        outs = _padded_call(params, xb, 1, _TILES, rule=rule, tile=True, fake=fake, blocks=_TILES,
                            interpret=interpret)
    else:
        xb = x.reshape(-1, _B)  # [blocks, 16]
        outs = _padded_call(params, xb, 0, blocks, rule=rule, tile=False, fake=fake, blocks=blocks,
                            interpret=interpret)
    return outs, s_dec


def _prepare(x, rule, block_shape, global_amax, rounding, key, interpret, tile_shape, num_warps, blocks, kernel):
    cfg, x, ga = ref.validate_kernel_args(x, rule, block_shape, global_amax, rounding, key, f"Mosaic GPU {kernel}")
    if tile_shape is not None:
        raise ValueError(
            f"tile_shape={tile_shape!r}: the Mosaic GPU kernel has fixed tiles (one block row per thread: "
            f"blocks_per_program 1x16 blocks, or 128 16x16 tiles side by side); pass tile_shape=None"
        )
    if num_warps not in (None, 4):
        raise ValueError(f"num_warps={num_warps!r}: a Mosaic GPU program is one warpgroup (4 warps); pass None or 4")
    blocks = DEFAULT_BLOCKS if blocks is None else blocks
    mg.check_pow2(blocks, "blocks_per_program", lo=mg.THREADS, hi=_MAX_BLOCKS)
    if cfg.rows > 1 and blocks != DEFAULT_BLOCKS:
        raise ValueError(f"blocks_per_program={blocks} applies to 1x16 blocks; 16x16 tiles use {_TILES} per program")
    amax = abs_max(x.astype(jnp.float32)) if ga is None else ga.astype(jnp.float32)
    interpret = mg.resolve_interpret(interpret, kernel=kernel)
    return cfg, x, amax, dict(rule=cfg.rule, tile=cfg.rows > 1, interpret=interpret, blocks=blocks)


def quantize(
    x: Any,
    *,
    rule: ref.NVFP4Rule = "static_6",
    block_shape: tuple[int, int] = (1, 16),
    global_amax: Any = None,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    interpret: Any = None,
    tile_shape: tuple[int, int] | None = None,
    num_warps: int | None = None,
    blocks_per_program: int | None = None,
) -> QArray:
    """``jaxlowfp.nvfp4.quantize`` as a Mosaic GPU kernel (same arguments and result, bit for bit; nearest rounding).

    Extra keyword arguments (those of :func:`pallas_kernels.nvfp4.quantize`, where they apply):
      interpret: True: the Mosaic GPU interpreter; a ``plgpu.InterpretGPUParams``: the interpreter with those
        parameters (e.g. ``detect_races=True``); False: compiled for the GPU; None: the interpreter if
        ``JAXLOWFP_PALLAS_INTERPRET=1``, else compiled on an sm_90+ GPU, else ``PallasUnavailableError``.
      tile_shape: None only (the Triton kernel's tile; the Mosaic kernel's tiles are fixed).
      num_warps: None or 4 (one warpgroup).
      blocks_per_program: 1x16 blocks per program, a power of two in [128, 1024] (default 128).
    """
    cfg, x, amax, static = _prepare(x, rule, block_shape, global_amax, rounding, key, interpret, tile_shape,
                                    num_warps, blocks_per_program, KERNEL_QUANTIZE)
    (codes, scale_bytes), s_dec = _run(x, amax, fake=False, **static)
    return kernel_array(x, cfg, codes, scale_bytes, s_dec)


def fake_quantize(
    x: Any,
    *,
    rule: ref.NVFP4Rule = "static_6",
    block_shape: tuple[int, int] = (1, 16),
    global_amax: Any = None,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    interpret: Any = None,
    tile_shape: tuple[int, int] | None = None,
    num_warps: int | None = None,
    blocks_per_program: int | None = None,
) -> jax.Array:
    """``jaxlowfp.nvfp4.fake_quantize`` as one fused Mosaic GPU kernel (quantize and dequantize, no packed codes)."""
    _, x, amax, static = _prepare(x, rule, block_shape, global_amax, rounding, key, interpret, tile_shape,
                                  num_warps, blocks_per_program, KERNEL_FAKE_QUANTIZE)
    (y,), _ = _run(x, amax, fake=True, **static)
    return y.reshape(x.shape)
