"""IF4 / IF6 / IF3: adaptive block-scaled formats (arXiv 2603.28765): each block of 16 picks an FP or an INT grid.

The block scale is NVFP4's standard one (block max -> the FP grid's max M, tensor amax -> M * 448, an FP32 tensor
scale and an E4M3 scale per block); each block is then rounded onto the FP grid and onto a signed integer grid
stretched to the same max, and keeps the one with the smaller error (``rule``: ``"mse"``, ``"mae"`` or
``"abs_max"``, in the original domain, as Four Over Six measures it). The sign bit of the E4M3 scale (always positive
otherwise) flags an INT block, so the format costs no extra bit (``docs/formats/if4.md``)::

    S_enc = min(M*448 / amax, FLT_MAX);   s = E4M3_RNE_satfinite((blk_amax / M) * S_enc)
    y     = x * min(1/(s*S_dec), FLT_MAX)
    FP:  q = FP_RNE(y)                          x̂ = (q * s) * S_dec
    INT: q = round_half_even(clamp(y * rcp, N))  x̂ = ((q * s) * step) * S_dec          step = M / N (6/7 for IF4)

``format``: ``"if4"`` (E2M1 or INT4, M = 6: the paper's format), ``"if6_e2m3"`` / ``"if6_e3m2"`` (an FP6 grid or INT6,
one 6-bit code a byte) and ``"if3"`` (E2M0 {0, 1, 2, 4} or INT3, one 3-bit code a byte). IF4 and IF6 reproduce
fouroversix's PyTorch reference (PyPI 1.0.5 for IF4, its GitHub HEAD for IF6) bit for bit, codes and scales
(``tests/test_if4.py`` against fixtures written by ``scripts/make_fouroversix_fixtures.py``); IF3 exists only in
fouroversix's Triton kernels and is implemented from their source (no reference run: they need a Blackwell GPU).
The error sums run in TE's sequential order, as :mod:`jaxlowfp.nvfp4`'s; the reference's ``torch.sum`` may order
them differently, which can flip a near-tie (none in the fixtures).

Roundings (IF4): ``"nearest"``; ``"stochastic"`` and ``"stochastic_unbiased"`` as in :mod:`jaxlowfp.nvfp4` (the
unbiased one: 16/17 headroom, the grid chosen on the round-to-nearest candidates, then P(up) = the fractional part
on the chosen grid, so ``E[x̂] = x``); ``"ms_eden"`` (Quartet II's MS-EDEN with the grid choice of fouroversix's
Triton kernel: see :func:`jaxlowfp._core.if4_blocks.if_ms_eden_blocks`). Special values, the supplied
``global_amax`` and jit behave as in :mod:`jaxlowfp.nvfp4`. No Pallas kernel: this is jnp code on every backend.

>>> import jax.numpy as jnp
>>> from jaxlowfp import if4
>>> x = jnp.asarray([[0.1, -0.5, 1.0, 2.5, 3.0, 4.4, 5.0, 6.0, -6.0, 0.0, 1.5, 2.0, 0.3, -0.7, 0.9, 1.1]])
>>> q = if4.quantize(x)                       # one flagged E4M3 scale per 16 values, two 4-bit codes a byte
>>> q.codes.shape, q.scales.shape, str(q.scales.dtype)
((1, 8), (1, 1), 'float8_e4m3fn')
>>> bool(q.is_int[0, 0])                      # this block is closer on the INT4 grid (spacing 6/7)
True
>>> [round(v, 4) for v in if4.dequantize(q)[0, :4].tolist()]   # multiples of 6/7 * s * S_dec
[0.0, -0.8571, 0.8571, 2.5714]
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import functools
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from jaxlowfp._core.deprecation import deprecated_getattr
from jaxlowfp._core.if4_blocks import (
    FORMATS,
    GRIDS,
    RULES,
    IFConfig,
    IFFormat,
    IFRule,
    global_scales,
    if_blocks,
)
from jaxlowfp._core.format import Format as _Format
from jaxlowfp._core.qarray import IFArray as _IFArray
from jaxlowfp._core.qarray import QArray
from jaxlowfp._core.nvfp4_blocks import (
    BLOCK,
    BLOCK_SHAPES,
    ROUNDINGS,
    Rounding,
    block_amax,
    from_blocks,
    pack_nibbles,
    per_element,
    tensor_amax,
    to_blocks,
    validate_args,
)

__all__ = ["IFConfig", "IFFormat", "IFRule", "Rounding", "FORMATS", "RULES", "ROUNDINGS", "BLOCK_SHAPES",
           "GRIDS", "quantize", "dequantize", "fake_quantize", "selected_int", "global_scales"]

# old names (one release): `Rule` clashed with the class jaxlowfp.Rule, `Format` with jaxlowfp.Format
_DEPRECATED = {"Rule": ("jaxlowfp.if4.IFRule", lambda: IFRule), "Format": ("jaxlowfp.if4.IFFormat", lambda: IFFormat),
               "IFArray": ("jaxlowfp.QArray", lambda: _IFArray)}
__getattr__ = deprecated_getattr(__name__, _DEPRECATED)


@functools.partial(jax.jit, static_argnames=("cfg", "out"))
def _run(x: jax.Array, global_amax: jax.Array | None, key: jax.Array | None, *, cfg: IFConfig, out: str):
    """The whole quantizer under one jit. `out`: "q" -> (codes, flagged scales, S_dec), "fake" -> x̂ in x.dtype,
    "int" -> the per-block INT choice."""
    xb = to_blocks(x, cfg.rows)
    blk = block_amax(xb)
    amax = tensor_amax(blk) if global_amax is None else global_amax.astype(jnp.float32)
    s_enc, s_dec = global_scales(amax, cfg.format, cfg.rounding)
    if key is None:
        u = None
    elif cfg.rounding == "ms_eden":
        u = jax.random.uniform(key, blk.shape, jnp.float32)
    else:
        u = to_blocks(jax.random.uniform(key, x.shape, jnp.float32), cfg.rows)
    res = if_blocks(xb, amax, s_enc, s_dec, fmt=cfg.format, rule=cfg.rule, rounding=cfg.rounding, u=u, blk_amax=blk)
    scale_shape = (*x.shape[:-1], x.shape[-1] // BLOCK) if cfg.rows == 1 else (
        *x.shape[:-2], x.shape[-2] // BLOCK, x.shape[-1] // BLOCK)
    if out == "int":
        return res.is_int.reshape(scale_shape)
    if out == "fake":
        s = per_element(res.scales)
        step = np.float32(GRIDS[cfg.format].step)
        fake = jnp.where(per_element(res.is_int), ((res.values * s) * step) * s_dec, (res.values * s) * s_dec)
        return from_blocks(fake, x.shape, cfg.rows).astype(x.dtype)
    codes = from_blocks(res.codes, x.shape, cfg.rows)
    if cfg.format == "if4":
        codes = pack_nibbles(codes)
    sbytes = jax.lax.bitcast_convert_type(res.scales.astype(jnp.float8_e4m3fn), jnp.uint8)
    sbytes = sbytes | jnp.where(res.is_int, jnp.uint8(0x80), jnp.uint8(0))
    scales = jax.lax.bitcast_convert_type(sbytes.reshape(scale_shape), jnp.float8_e4m3fn)
    return codes, scales, s_dec


def _prepare(x: ArrayLike, fmt: IFFormat, rule: IFRule, block_shape: tuple[int, int], rounding: Rounding,
             global_amax: ArrayLike | None, key: jax.Array | None) -> tuple[IFConfig, jax.Array, jax.Array | None]:
    cfg = IFConfig(format=fmt, rule=rule, block_shape=block_shape, rounding=rounding)
    x, global_amax = validate_args(x, cfg, global_amax, key)
    return cfg, x, global_amax


def quantize(
    x: ArrayLike,
    *,
    format: IFFormat = "if4",  # noqa: A002 (the format's name, as QuantSpec.format)
    rule: IFRule = "mse",
    block_shape: tuple[int, int] = (1, 16),
    global_amax: ArrayLike | None = None,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
) -> QArray:
    """IF-quantize `x` (float32/bfloat16/float16, last axis a multiple of 16).

    Args:
      x: the tensor; blocks run along the last axis (the GEMM reduction axis).
      format: "if4" (default), "if6_e2m3", "if6_e3m2" or "if3".
      rule: the per-block grid choice, "mse" (default, fouroversix's), "mae" or "abs_max".
      block_shape: (1, 16), or (16, 16) tiles over the last two axes (one scale and one choice per tile).
      global_amax: a float scalar >= 0 used instead of max|x| (delayed or all-reduced amax), as in
        :func:`jaxlowfp.nvfp4.quantize`.
      rounding: "nearest"; for IF4 also "stochastic", "stochastic_unbiased" or "ms_eden" (need `key`).
      key: PRNG key, required for (and only for) the stochastic roundings.
    """
    cfg, x, global_amax = _prepare(x, format, rule, block_shape, rounding, global_amax, key)
    codes, scales, s_dec = _run(x, global_amax, key, cfg=cfg, out="q")
    return QArray(codes=codes, scales=scales, global_scale=s_dec,
                  format=_Format(kind=cfg.format, rule=cfg.rule, block_shape=cfg.block_shape), dtype=x.dtype,
                  shape=x.shape)


def dequantize(q: QArray, dtype: DTypeLike = jnp.float32) -> jax.Array:
    """``x̂`` of an IF `jaxlowfp.QArray` in `dtype`: ``(q * |s|) * S_dec`` (FP blocks), ``((q * |s|) * step) *
    S_dec`` (INT blocks)."""
    if not isinstance(q, QArray) or q.format.kind not in FORMATS:
        got = f"a QArray of {q.format!r}" if isinstance(q, QArray) else type(q).__name__
        raise TypeError(f"if4.dequantize expects an IF jaxlowfp.QArray (if4.quantize's result); got {got}")
    return q.dequantize(dtype)


def fake_quantize(
    x: ArrayLike,
    *,
    format: IFFormat = "if4",  # noqa: A002
    rule: IFRule = "mse",
    block_shape: tuple[int, int] = (1, 16),
    global_amax: ArrayLike | None = None,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
) -> jax.Array:
    """``dequantize(quantize(x, ...), x.dtype)`` bit for bit, without packing the codes."""
    cfg, x, global_amax = _prepare(x, format, rule, block_shape, rounding, global_amax, key)
    return _run(x, global_amax, key, cfg=cfg, out="fake")


def selected_int(
    x: ArrayLike,
    *,
    format: IFFormat = "if4",  # noqa: A002
    rule: IFRule = "mse",
    block_shape: tuple[int, int] = (1, 16),
    global_amax: ArrayLike | None = None,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
) -> jax.Array:
    """bool per block (the shape of the `QArray`'s scales): True where the block uses the INT grid, for the same
    arguments as :func:`quantize` (telemetry: ``selected_int(x).mean()`` is the INT share)."""
    cfg, x, global_amax = _prepare(x, format, rule, block_shape, rounding, global_amax, key)
    return _run(x, global_amax, key, cfg=cfg, out="int")


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
