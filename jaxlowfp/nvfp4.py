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

The block math lives in ``jaxlowfp._core.nvfp4_blocks`` (shared with the Pallas kernel); the 16x16 random
Hadamard transform of the training recipe in :mod:`jaxlowfp.hadamard` (re-exported here). The public functions
run under an internal ``jax.jit`` (static configuration, so no retrace); the 4/6 rules process
the tensor in row chunks (``lax.map``) so their temporaries stay in cache, which changes no bit.

>>> import jax.numpy as jnp
>>> from jaxlowfp import nvfp4
>>> x = jnp.asarray([[0.1, -0.5, 1.0, 2.5, 3.0, 4.4, 5.0, 6.0, -6.0, 0.0, 1.5, 2.0, 0.3, -0.7, 0.9, 1.1]])
>>> q = nvfp4.quantize(x, rule="mse")          # one E4M3 scale per 16 values, two E2M1 codes a byte
>>> q.codes.shape, q.scales.shape, str(q.scales.dtype)
((1, 8), (1, 1), 'float8_e4m3fn')
>>> bool(nvfp4.selected_map4(x, rule="mse")[0, 0])   # 4/6: this block maps its max to 4 (lower MSE)
True
>>> nvfp4.dequantize(q)[0, :8].tolist()
[0.0, -0.75, 0.75, 2.25, 3.0, 4.5, 4.5, 6.0]
"""
from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from jaxlowfp import dispatch
from jaxlowfp._core.checks import one_of
from jaxlowfp._core.nvfp4_blocks import (
    BLOCK,
    BLOCK_SHAPES,
    FOUR_OVER_SIX,
    ROUNDINGS,
    RULES,
    NVFP4Array,
    NVFP4Config,
    Rule,
    from_blocks,
    global_scales,
    pack_nibbles,
    quantize_blocks,
    rule_constants,
    to_blocks,
    unpack_nibbles,
    validate_args,
)
from jaxlowfp._core.reduce import abs_max
from jaxlowfp.hadamard import hadamard16, hadamard_matrix

__all__ = [
    "NVFP4Array", "NVFP4Config", "RULES", "ROUNDINGS", "BLOCK_SHAPES", "quantize", "dequantize", "fake_quantize",
    "selected_map4", "global_scales", "rule_constants", "unpack_nibbles", "hadamard16", "hadamard_matrix",
]


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
        res = quantize_blocks(to_blocks(xs, cfg.rows), amax, s_enc, s_dec, rule=cfg.rule,
                              u=None if us is None else to_blocks(us, cfg.rows))
        fake = (res.values * res.scales[..., None, None]) * s_dec
        return res.nibbles, fake, res.scales, res.map4

    k = x.shape[-1]
    x2 = xf.reshape(-1, k)  # 2D tiles stay whole: the row count of every chunk is a multiple of 16
    u2 = None if u is None else u.reshape(-1, k)
    n = x2.shape[0]
    c = _chunk_rows(n, k, cfg.rows) if cfg.rule in FOUR_OVER_SIX else n
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
        return from_blocks(fake, x.shape, cfg.rows).astype(x.dtype)
    codes = pack_nibbles(from_blocks(nib, x.shape, cfg.rows))
    return codes, scales.reshape(scale_shape).astype(jnp.float8_e4m3fn), s_dec


def _use_pallas(impl: str, kernel: str, rounding: str, backend: str, config: dict[str, Any]) -> bool:
    one_of(impl, dispatch.IMPLS, "impl")
    if rounding == "stochastic":
        if impl == "pallas":
            raise ValueError("impl='pallas': the NVFP4 kernel has no stochastic rounding; use impl='xla' or 'auto'")
        return False
    return dispatch.resolve_impl(impl, kernel=kernel, backend=backend, config=config) == "pallas"


def _config(x: Any, rule: str, block_shape: Any) -> dict[str, Any]:
    """What the verified-kernel table is keyed by (``jaxlowfp.dispatch.verified``)."""
    dtype = getattr(x, "dtype", None)
    return {"rule": rule, "block_shape": block_shape, "dtype": None if dtype is None else str(dtype)}


def quantize(
    x: Any,
    *,
    rule: Rule = "mse",
    block_shape: tuple[int, int] = (1, 16),
    global_amax: Any = None,
    rounding: Literal["nearest", "stochastic"] = "nearest",
    key: jax.Array | None = None,
    impl: Literal["auto", "xla", "pallas"] = "auto",
    backend: Literal["triton", "mosaic"] = "triton",
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
      impl: "auto" (the Pallas kernel where it is recorded as verified on this GPU, else this jnp code), "xla",
        or "pallas" (the kernel, bit-identical, or a clear error where it cannot run; no stochastic rounding).
      backend: the Pallas backend under ``impl="pallas"``/``"auto"``: "triton" (sm_80+) or "mosaic" (Mosaic GPU,
        sm_90+).
    """
    if _use_pallas(impl, "nvfp4.quantize", rounding, backend, _config(x, rule, block_shape)):
        return dispatch.kernel("nvfp4.quantize", backend)(x, rule=rule, block_shape=block_shape, global_amax=global_amax)
    cfg = NVFP4Config(rule=rule, block_shape=block_shape, rounding=rounding)
    x, global_amax = validate_args(x, cfg, global_amax, key)
    codes, scales, s_dec = _run(x, global_amax, key, cfg=cfg, out="q")
    return NVFP4Array(codes=codes, scales=scales, global_scale=s_dec, rule=cfg.rule, block_shape=cfg.block_shape,
                      dtype=x.dtype, shape=x.shape)


def dequantize(q: NVFP4Array, dtype: Any = jnp.float32) -> jax.Array:
    """``x̂ = (q_i * s_b) * global_scale`` (one float32 rounding: q * s is exact), cast to `dtype`."""
    if not isinstance(q, NVFP4Array):
        raise TypeError(f"dequantize expects an NVFP4Array; got {type(q).__name__}")
    return q.dequantize(dtype)


def fake_quantize(
    x: Any,
    *,
    rule: Rule = "mse",
    block_shape: tuple[int, int] = (1, 16),
    global_amax: Any = None,
    rounding: Literal["nearest", "stochastic"] = "nearest",
    key: jax.Array | None = None,
    impl: Literal["auto", "xla", "pallas"] = "auto",
    backend: Literal["triton", "mosaic"] = "triton",
) -> jax.Array:
    """``dequantize(quantize(x, ...), x.dtype)`` bit for bit, without packing the codes."""
    if _use_pallas(impl, "nvfp4.fake_quantize", rounding, backend, _config(x, rule, block_shape)):
        return dispatch.kernel("nvfp4.fake_quantize", backend)(x, rule=rule, block_shape=block_shape, global_amax=global_amax)
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
