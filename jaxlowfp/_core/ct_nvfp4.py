"""NVFP4 in compressed-tensors' arithmetic (vllm-project/compressed-tensors 0.20, the order llm-compressor 0.14
quantizes in and transformers / the model-free dequantizer decode in), next to ours in :mod:`nvfp4_blocks`.

compressed-tensors stores the global scale as an ENCODE scale ``g`` (a divisor) and works with the effective
per-block step ``s / g`` (``quantization/lifecycle/forward_helpers.py``: ``_quantize``, ``_dequantize``;
``quantization/utils/helpers.py``: ``calculate_qparams``, ``generate_gparam``); every step one float32 rounding::

    g      = (1 / max(amax, FLT_MIN)) * 2688    (generate_gparam's ``2688 / amax``: PyTorch evaluates a Python
                                                 scalar over a tensor as reciprocal, then multiply; NaN/Inf -> 1)
    s      = E4M3_RNE_satfinite((blk_amax / 6) * g),   0 -> 0.125 (calculate_qparams: no zero scale)
    q      = E2M1_RNE(clamp(x / (s / g), -6, 6))      (cast_to_fp4: the same ties as ours)
    x̂      = q * (s / g)

Ours is ``q = E2M1(x * (1 / (s * (1 / g))))`` and ``x̂ = (q * s) * (1 / g)``: the two decodings differ in the last
bit for about a quarter of the weights, and the two quantizers in the ties they see. Divisions here are IEEE
(`bits.ieee_div`: XLA may not turn them into reciprocal multiplies).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlowfp._core.bits import ieee_div
from jaxlowfp._core.minifloat import E2M1, E4M3

ENC = 448.0 * 6.0  # FP8_E4M3_DATA.max * FP4_E2M1_DATA.max
ZERO_SCALE = 0.125  # compressed-tensors' _get_dtype_eps(float8_e4m3fn): replaces a zero block scale
_TINY = float(np.finfo(np.float32).tiny)


def global_scale(amax: jax.Array) -> jax.Array:
    """The encode scale ``g`` (float32 scalar) of a tensor amax as compressed-tensors' ``generate_gparam`` computes
    it (called by llm-compressor's observers): ``(1 / max(amax, FLT_MIN)) * 2688``; NaN or Inf -> 1. (Ours,
    `nvfp4_blocks.global_scales`, divides: ``2688 / amax``, 1 ulp away for about a quarter of the tensors.)"""
    a = jnp.maximum(jnp.asarray(amax, jnp.float32), _TINY)
    g = ieee_div(jnp.float32(1.0), a) * jnp.float32(ENC)
    return jnp.where(jnp.isfinite(g), g, jnp.float32(1.0))


def block_scales(blk_amax: jax.Array, g: jax.Array) -> jax.Array:
    """E4M3 block scales (float32 values) ``e4m3((blk_amax / 6) * g)``, zero replaced by 0.125."""
    s = E4M3.round(ieee_div(blk_amax, jnp.float32(6.0)) * g, saturate=True)
    return jnp.where(s == 0, jnp.float32(ZERO_SCALE), s)


def step(s: jax.Array, g: jax.Array) -> jax.Array:
    """compressed-tensors' effective per-block scale ``s / g``."""
    return ieee_div(s, g)


def quantize(xb: jax.Array, s: jax.Array, g: jax.Array) -> jax.Array:
    """Signed E2M1 values of blocks `xb` [..., nb, 16] with block scales `s` [..., nb]: ``E2M1(clamp(x / (s / g),
    -6, 6))``."""
    y = ieee_div(xb.astype(jnp.float32), step(s, g)[..., None])
    return E2M1.round(jnp.clip(y, -6.0, 6.0), saturate=True)


def dequantize(q: jax.Array, s: jax.Array, g: jax.Array) -> jax.Array:
    """``q * (s / g)`` for E2M1 values `q` [..., nb, 16] and block scales `s` [..., nb]."""
    return q.astype(jnp.float32) * step(s, g)[..., None]


def quantize_tensor(x: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(E2M1 values [..., K], block scales [..., K / 16]) of `x` [..., K] (blocks of 16 along the last axis) with
    the encode scale `g`: compressed-tensors' weight quantization (and its dynamic ``local`` activations)."""
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
    s = block_scales(jnp.max(jnp.abs(xb), axis=-1), g)
    return quantize(xb, s, g).reshape(x.shape), s


def fake_quantize(x: jax.Array, g: jax.Array) -> jax.Array:
    """``dequantize(quantize(x))`` in x's dtype: what compressed-tensors computes for NVFP4 input activations
    (``dynamic: local``: block scales from the current input, the static global scale `g` from calibration)."""
    q, s = quantize_tensor(x, g)
    qb = q.reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
    return dequantize(qb, s, g).reshape(x.shape).astype(x.dtype)
