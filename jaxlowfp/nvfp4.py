"""NVFP4: E2M1 elements, an E4M3 scale per 16-element block and an FP32 per-tensor scale; Four Over Six (4/6).

Two-level scaling (``docs/formats/nvfp4.md`` sections 0, 3.3, 4.1), every step one IEEE float32 rounding::

    S_enc  = min(M*E / amax, FLT_MAX)   (1 if amax == 0);   S_dec = 1 / S_enc  (stored as `global_scale`)
    base   = (blk_amax / M) * S_enc
    s      = E4M3_RNE_satfinite(base)             (4/6: s6 = e4m3(base), s4 = e4m3(base * 1.5))
    inv    = min(1 / (s * S_dec), FLT_MAX)
    q_i    = E2M1_RNE_satfinite(x_i * inv)        (codes 0 where s == 0)
    x̂_i    = (q_i * s) * S_dec                    (dequantize; q * s is exact)

Rules: ``static_6`` (standard NVFP4: M = 6, E = 448), ``static_4`` (M = 4, E = 448) and the 4/6 rules ``abs_max``,
``mae``, ``mse`` (M = 6, E = 256): both candidates are quantized, each block's error is measured after full
dequantization in the original domain, ``err = Σ (((q*s)*amax)/(6*E) - x)²`` (mse), ``Σ |.|`` (mae) or
``max |.|`` (abs_max), and map-to-4 is kept only if strictly better (``err4 < err6``; ties go to 6). The
differences are taken of ``x̂ * p`` and ``x * p``, p = 2^-e for a block amax in [2^e, 2^(e+1)) with e < 0 (else 1):
an exact power of two, so the ranking is IEEE float32's wherever its squares are normal, and below a tensor amax
of about 2^-57 XLA:CPU's flush of subnormal squares to 0 no longer turns a 4-better block into a tie that picks 6.
Sums run sequentially over the 16 elements of a block row (TE's order); for 16x16 tiles the 16 row sums are then added
pairwise (8+8, 4+4, 2+2, 1+1), TE's 2D order.

Bit-exactness under ``jit`` on every backend (``docs/formats/nvfp4.md`` section 8: XLA turns ``a / broadcast(c)`` into
``a * (1/c)`` and contracts ``err + d*d`` into an FMA): the divisions by M and by 6*E are IEEE divisions of per-block
arrays with the divisor behind an optimization barrier (``ieee_div``; the Pallas kernels, whose Triton ``/`` is
approximate, divide integer-exactly with ``div_by_3_pow2``), the 4/6 error's ``((q*s)*amax) / (6*E)`` is a per-block
quotient times a power of two, and the squared errors pass through an integer ``min`` (a no-op on their bits) before
the sequential sum, so no add ever sees a multiply. No full-size divisor or row chunking: one reduction reads the
tensor for the block maxima (the tensor amax is taken from those), the 4/6 rules fold its 16 columns for the
candidates' errors (a small tensor in a rolled loop over a copy with the columns in front of the blocks, both
candidates at once, quick to compile; from 2^18 elements written out, one pass per candidate, quick to run), and the
element-wise pass writes the result.

Special values: the global amax of a tensor containing NaN or Inf is not finite, and then ``global_scale`` and every
block scale are NaN, so the whole tensor dequantizes to NaN (TE would instead fall back to ``S_enc = 1`` for Inf or
``FLT_MAX`` for NaN and hide it). With a caller-supplied finite ``global_amax``, only the blocks holding NaN/Inf get
a NaN scale. Values above a supplied ``global_amax`` saturate: the block scale at 448 and the elements at +-6.
XLA:CPU flushes float32 subnormals to zero, so tensors with amax below about 1e-30 (where ``s * S_dec`` or the
values themselves become subnormal) are outside the bit-exact range.

Stochastic rounding (gradients) rounds each scaled value ``y`` to one of its two E2M1 neighbours lo < hi with
``P(hi) = (y - lo) / (hi - lo)``, so ``E[q] = y`` wherever ``y`` does not exceed 6. Two variants:

- ``rounding="stochastic"``: the scales of round-to-nearest. Biased in two ways: the E4M3 rounding of a block
  scale can push the block max above 6 (up to 6 * 17/16), where it saturates; and with a 4/6 rule both candidates
  are rounded with the same draws (as the CUDA kernels) and the one with the smaller error of *its draw* is kept,
  so the choice depends on the draw (the selection keeps draws that landed close to x).
- ``rounding="stochastic_unbiased"``: fouroversix's ``RoundStyle.stochastic_unbiased`` (after Quartet II): every
  constant carries ``a = 16/17``, ``S_enc = f32(M*E*a) / amax``, ``base = (blk_amax / f32(M*a)) * S_enc`` and the
  4/6 error's ``x̂ = ((q*s)*amax) / f32(M*E*a)``, so a block max maps to ``M*a * s_exact/s`` and, as E4M3
  rounding changes a normal scale by at most a factor 17/16, never above ``M`` (6, or 4 for the map-4 candidate):
  nothing saturates, and ``E[x̂] = x`` up to float32 rounding. One deliberate difference from fouroversix: the 4/6
  choice compares the round-to-nearest candidates (the ``rounding="nearest"`` rule with these constants), so it
  does not depend on the draw; fouroversix compares the stochastically rounded candidates (sharing the draws), which
  leaves the 4/6 selection bias in place: a numpy model of its choice, 16/17 included, is as biased as plain
  "stochastic" (|z| up to ~120 after 20000 draws of N(0,1) blocks; ``tests/test_nvfp4_stochastic.py`` shows plain
  "stochastic" biased and this variant unbiased for every rule). Blocks whose scale is subnormal or zero in E4M3
  (block max below about 2^-14 of the tensor max) are still rounded coarsely.

Per-block scale search (``rule="search"``, after llm-compressor's ``nvfp4_expanded_mse`` and ModelOpt's scale
calibration, here over the E4M3 grid itself): the 4/6 constants (E = 256), and each block takes the E4M3 scale of
minimum MSE among every E4M3 value from ``e4m3(0.81 * base)`` to ``e4m3(1.8 * base)`` (about ten codes, which include
4/6's two candidates, so its error per block is never above 4/6 ``mse``'s); ties keep the map-to-6 scale.
``selected_map4`` then says where the search left the map-to-6 scale. Round to nearest only; no Pallas kernel.

MS-EDEN (``rounding="ms_eden"``, Quartet II, arXiv 2601.22813; implemented from fouroversix's Triton kernel
``kernels/triton/quartet_ii.py``, which has no CPU path, so it is not compared with a reference run): unbiased
gradients by moving the randomness from the elements into the block scale. With ``S_dec = amax / 255.99 / 6.0721``
(6.0721 = 6 / ((17/16) * 0.93)) and ``s = e4m3((blk_amax / 6.0721) / S_dec)``, the elements are rounded to nearest
(ties away from zero, as the kernel), ``y = x / (s * S_dec)``, ``q = E2M1(y)``; then the block scale becomes
``c = s * <y, y> / <y, q>`` (EDEN's least-squares correction) and is rounded stochastically to one of its two E4M3
neighbours with ``E[s'] = c``: ``E[x̂] = q * c * S_dec``, so ``E[<x̂, x>] = <x, x>`` for every block, and with a
random rotation in front (the 16-point RHT with fresh random signs, :mod:`jaxlowfp.hadamard`) the rotated-back
estimate is nearly unbiased element-wise (EDEN is exact for a uniformly random rotation, which a signed 16-point
Hadamard is not: a relative squared bias of about 6e-6 remains), at about round-to-nearest error instead of
stochastic rounding's 2.5x larger one (``tests/test_nvfp4_search.py`` measures both; ``docs/formats/if4.md`` 3).
Rule "static_6", 1x16 blocks; one uniform per block
from `key`. The kernel applies the RHT itself and re-rotates with random signs on request
(``quartet_ii_rerotate_had``); here the rotation is the caller's (``qat`` gradients: ``QuantSpec(hadamard=True)``).

The block math lives in ``jaxlowfp._core.nvfp4_blocks`` (shared with the Pallas kernel); the 16x16 random
Hadamard transform of the training recipe in :mod:`jaxlowfp.hadamard` (re-exported here). The public functions
run under an internal ``jax.jit`` (static configuration, so no retrace). Derivatives are those of the function
itself: the E2M1 values and E4M3 scales are piecewise constant (zero derivative), so the only tangent runs through
the tensor amax into ``S_dec``; for a straight-through gradient use :func:`jaxlowfp.qat.fake_quant`.

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

from jaxlowfp._core.surface import public_dir as _public_dir

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from jaxlowfp import dispatch
from jaxlowfp._core.checks import one_of
from jaxlowfp._core.deprecation import deprecated_getattr, renamed_kwarg
from jaxlowfp._core.nvfp4_blocks import (
    BLOCK,
    BLOCK_SHAPES,
    KERNEL_RULES,
    ROUNDINGS,
    RULES,
    STOCHASTIC,
    NVFP4Config,
    NVFP4Rule,
    Rounding,
    block_amax,
    from_blocks,
    global_scales,
    pack_nibbles,
    per_element,
    quantize_blocks,
    rule_constants,
    tensor_amax,
    to_blocks,
    unpack_nibbles,
    validate_args,
)
from jaxlowfp._core.format import Format
from jaxlowfp._core.qarray import NVFP4Array as _NVFP4Array
from jaxlowfp._core.qarray import QArray
from jaxlowfp.hadamard import hadamard16, hadamard_matrix

__all__ = [
    "NVFP4Config", "NVFP4Rule", "Rounding", "RULES", "KERNEL_RULES", "ROUNDINGS", "BLOCK_SHAPES",
    "quantize", "dequantize", "fake_quantize", "selected_map4", "global_scales", "rule_constants", "unpack_nibbles",
    "hadamard16", "hadamard_matrix",
]

# old names (one release): `Rule` clashed with the class jaxlowfp.Rule; ALL_RULES is RULES now ("search" included)
_DEPRECATED = {"Rule": ("jaxlowfp.nvfp4.NVFP4Rule", lambda: NVFP4Rule),
               "ALL_RULES": ("jaxlowfp.nvfp4.RULES", lambda: RULES),
               "NVFP4Array": ("jaxlowfp.QArray", lambda: _NVFP4Array)}
__getattr__ = deprecated_getattr(__name__, _DEPRECATED)


@functools.partial(jax.jit, static_argnames=("cfg", "out"))
def _run(x: jax.Array, global_amax: jax.Array | None, key: jax.Array | None, *, cfg: NVFP4Config, out: str):
    """The whole quantizer under one jit. `out`: "q" -> (codes, scales, S_dec), "fake" -> x̂ in x.dtype,
    "map4" -> the per-block 4/6 choice.

    Passes over the tensor: one reduction (block maxima; the tensor max is taken from them), for 4/6 the error
    sums (below 2^18 elements a copy with the columns in front of the blocks and a rolled loop over its 16 columns,
    both candidates at once; from 2^18 one written-out pass per candidate), and the element-wise pass.
    """
    xb = to_blocks(x, cfg.rows)  # in x's dtype: converted to float32 inside each pass
    blk = block_amax(xb)
    amax = tensor_amax(blk) if global_amax is None else global_amax.astype(jnp.float32)
    s_enc, s_dec = global_scales(amax, cfg.rule, cfg.rounding)
    if key is None:
        u = None
    elif cfg.rounding == "ms_eden":  # one uniform per block: the scale is what is rounded stochastically
        u = jax.random.uniform(key, blk.shape, jnp.float32)
    else:
        u = to_blocks(jax.random.uniform(key, x.shape, jnp.float32), cfg.rows)
    res = quantize_blocks(xb, amax, s_enc, s_dec, rule=cfg.rule, rounding=cfg.rounding, u=u, blk_amax=blk)
    scale_shape = (*x.shape[:-1], x.shape[-1] // BLOCK) if cfg.rows == 1 else (
        *x.shape[:-2], x.shape[-2] // BLOCK, x.shape[-1] // BLOCK)
    if out == "map4":
        return res.map4.reshape(scale_shape)
    if out == "fake":
        fake = (res.values * per_element(res.scales)) * s_dec
        return from_blocks(fake, x.shape, cfg.rows).astype(x.dtype)
    codes = pack_nibbles(from_blocks(res.nibbles, x.shape, cfg.rows))
    return codes, res.scales.reshape(scale_shape).astype(jnp.float8_e4m3fn), s_dec


def _use_pallas(impl: str, kernel: str, rounding: str, backend: str, config: dict[str, Any]) -> bool:
    one_of(impl, dispatch.IMPLS, "impl")
    if config["rule"] not in KERNEL_RULES:
        if impl == "pallas":
            raise ValueError(f"impl='pallas': the NVFP4 kernel implements the rules {', '.join(KERNEL_RULES)} (got "
                             f"rule="
                             f"{config['rule']!r}); use impl='xla' or 'auto'")
        return False
    if rounding in STOCHASTIC:
        if impl == "pallas":
            raise ValueError(f"impl='pallas': the NVFP4 kernel has no stochastic rounding (got rounding={rounding!r}); "
                             f"use impl='xla' or 'auto'")
        return False
    return dispatch.resolve_impl(impl, kernel=kernel, pallas_backend=backend, config=config) == "pallas"


def _config(x: ArrayLike, rule: str, block_shape: tuple[int, int]) -> dict[str, Any]:
    """What the verified-kernel table is keyed by (``jaxlowfp.dispatch.verified``)."""
    dtype = getattr(x, "dtype", None)
    return {"rule": rule, "block_shape": block_shape, "dtype": None if dtype is None else str(dtype)}


def quantize(
    x: ArrayLike,
    *,
    rule: NVFP4Rule = "static_6",
    block_shape: tuple[int, int] = (1, 16),
    global_amax: ArrayLike | None = None,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    impl: Literal["auto", "xla", "pallas"] = "auto",
    pallas_backend: Literal["triton", "mosaic"] = "triton",
    backend: str | None = None,
) -> QArray:
    """NVFP4-quantize `x` (float32/bfloat16/float16, last axis a multiple of 16).

    Args:
      x: the tensor; blocks run along the last axis (the GEMM reduction axis).
      rule: "static_6" (standard NVFP4, the default), "static_4", the Four Over Six rules "abs_max", "mae", "mse"
        (pass one for 4/6; until 0.2 the default was "mse"), or "search" (per-block E4M3 scale search, minimum
        MSE; see the module docstring). :data:`RULES` lists them, :data:`KERNEL_RULES` those with a Pallas kernel.
      block_shape: (1, 16), or (16, 16) tiles over the last two axes (one scale and one 4/6 choice per tile).
      global_amax: a float scalar >= 0 used instead of max|x| (delayed or all-reduced amax): values above it
        saturate, and a negative or non-finite one makes every scale NaN; see the module docstring.
      rounding: "nearest" (RNE), "stochastic", "stochastic_unbiased" or "ms_eden" (reproducible from `key`; see
        the module docstring: "stochastic" is biased with 4/6 rules and at saturating block maxima; "ms_eden" needs
        rule="static_6" and 1x16 blocks).
      key: PRNG key, required for (and only for) the stochastic roundings.
      impl: "auto" (the Pallas kernel where it is recorded as verified on this GPU, else this jnp code), "xla",
        or "pallas" (the kernel, bit-identical, or a clear error where it cannot run; no stochastic rounding).
      pallas_backend: the Pallas backend under ``impl="pallas"``/``"auto"``: "triton" (sm_80+) or "mosaic" (Mosaic
        GPU, sm_90+). ``backend=`` is its deprecated name (``gemm=`` names a GEMM backend elsewhere).
    """
    backend = renamed_kwarg("nvfp4.quantize", "backend", backend, "pallas_backend", pallas_backend, "triton")
    if _use_pallas(impl, "nvfp4.quantize", rounding, backend, _config(x, rule, block_shape)):
        return dispatch.kernel("nvfp4.quantize", backend)(x, rule=rule, block_shape=block_shape,
                                                          global_amax=global_amax)
    cfg = NVFP4Config(rule=rule, block_shape=block_shape, rounding=rounding)
    x, global_amax = validate_args(x, cfg, global_amax, key)
    codes, scales, s_dec = _run(x, global_amax, key, cfg=cfg, out="q")
    return QArray(codes=codes, scales=scales, global_scale=s_dec,
                  format=Format(kind="nvfp4", rule=cfg.rule, block_shape=cfg.block_shape), dtype=x.dtype,
                  shape=x.shape)


def dequantize(q: QArray, dtype: DTypeLike = jnp.float32) -> jax.Array:
    """``x̂ = (q_i * s_b) * global_scale`` (one float32 rounding: q * s is exact), cast to `dtype`."""
    if not isinstance(q, QArray) or q.format.kind != "nvfp4":
        got = f"a QArray of {q.format!r}" if isinstance(q, QArray) else type(q).__name__
        raise TypeError(f"nvfp4.dequantize expects an NVFP4 jaxlowfp.QArray (nvfp4.quantize's result); got {got}")
    return q.dequantize(dtype)


def fake_quantize(
    x: ArrayLike,
    *,
    rule: NVFP4Rule = "static_6",
    block_shape: tuple[int, int] = (1, 16),
    global_amax: ArrayLike | None = None,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    impl: Literal["auto", "xla", "pallas"] = "auto",
    pallas_backend: Literal["triton", "mosaic"] = "triton",
    backend: str | None = None,
) -> jax.Array:
    """``dequantize(quantize(x, ...), x.dtype)`` bit for bit, without packing the codes (same arguments and
    defaults as :func:`quantize`: rule "static_6", the standard format)."""
    backend = renamed_kwarg("nvfp4.fake_quantize", "backend", backend, "pallas_backend", pallas_backend, "triton")
    if _use_pallas(impl, "nvfp4.fake_quantize", rounding, backend, _config(x, rule, block_shape)):
        return dispatch.kernel("nvfp4.fake_quantize", backend)(x, rule=rule, block_shape=block_shape,
                                                               global_amax=global_amax)
    cfg = NVFP4Config(rule=rule, block_shape=block_shape, rounding=rounding)
    x, global_amax = validate_args(x, cfg, global_amax, key)
    return _run(x, global_amax, key, cfg=cfg, out="fake")


def selected_map4(
    x: ArrayLike,
    *,
    rule: NVFP4Rule = "mse",
    block_shape: tuple[int, int] = (1, 16),
    global_amax: ArrayLike | None = None,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
) -> jax.Array:
    """bool per block (shape of the `QArray`'s scales): True where the block maps its max to 4 (telemetry), for the
    same arguments as :func:`quantize` (the choice of rounding="stochastic" depends on `key`); for rule="search",
    True where the search chose another scale than the map-to-6 one."""
    cfg = NVFP4Config(rule=rule, block_shape=block_shape, rounding=rounding)
    x, global_amax = validate_args(x, cfg, global_amax, key)
    return _run(x, global_amax, key, cfg=cfg, out="map4")


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
