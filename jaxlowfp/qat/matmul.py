"""Quantized matmuls (:func:`dot_general`, :func:`linear`): both operands fake-quantized per a :class:`Recipe`, and
optionally the output gradient in a custom backward pass (re-quantizing block-scaled operands along the axis the
backward GEMM contracts, never reusing forward block scales)."""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax import lax
from jax.lax import PrecisionLike
from jax.typing import ArrayLike, DTypeLike

from jaxlowfp._core.checks import bool_flag, dimension_numbers_of, float_input
from jaxlowfp._core.reduce import abs_max
from jaxlowfp.hadamard import hadamard16
from jaxlowfp.qat import gemm
from jaxlowfp.qat.scaled_quant import (fixed_estimate, keep_mask, need_key, nvfp4_fake_quant, quantize,
                                       reverse_mode_only, round_with,
                                     select, straight_through)
from jaxlowfp.qat.spec import QuantSpec, Recipe, RecipeState, RecipeStats, check_size, convention, two_level
from jaxlowfp.scaling import AmaxHistory, CurrentScaling, PendingAmax, record_pending

# ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)), as lax.dot_general takes it
DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def _is_linear(lhs: jax.Array, rhs: jax.Array, dn: tuple) -> bool:
    """lhs [..., K] . rhs [K, M], contracting K, no batch dims: the layout whose backward we re-quantize."""
    return rhs.ndim == 2 and dn == (((lhs.ndim - 1,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class _DotConfig:
    dn: tuple
    precision: Any
    preferred_element_type: Any
    recipe: Recipe
    observe: bool | None  # a static observe_only flag; None: traced, passed as an argument
    where: str = "qat.dot_general"  # the layer, for errors
    gemm: str = "dequant"  # the forward product's backend (jaxlowfp.qat.gemm), resolved


def _dot(cfg: _DotConfig, a: jax.Array, b: jax.Array) -> jax.Array:
    return lax.dot_general(a, b, cfg.dn, precision=cfg.precision, preferred_element_type=cfg.preferred_element_type)


def _quantize_grad(g: jax.Array, spec: QuantSpec, key: jax.Array | None, axis: int) -> jax.Array:
    """Current-scaling quantization of a backward operand (no state, no stats); NVFP4 blocks along `axis`."""
    return quantize(g, spec.init(), spec, False, key, axis).y


def _maybe_hadamard(x: jax.Array, on: bool) -> jax.Array:
    if not on:
        return x
    return hadamard16(x, axis=0).astype(x.dtype)


class _Ctx(NamedTuple):
    """What the backward pass needs besides the high-precision operands (all scalars or keys)."""

    est_l: jax.Array | None  # the forward's amax estimates: the quantized operands are recomputed from them
    est_r: jax.Array | None
    key_l: jax.Array | None  # the forward's stochastic-rounding keys
    key_r: jax.Array | None
    key_g: jax.Array | None  # the backward's
    observe: jax.Array | None  # a traced observe-only flag (None: static, in the config)
    grad_hist: AmaxHistory | None  # delayed gradient scaling: the output gradient's history
    scale_l: jax.Array | None = None  # the forward's per-tensor dequant scales (the fp8 backend's)
    scale_r: jax.Array | None = None


def _history(h: AmaxHistory | None, role: str, where: str) -> AmaxHistory:
    """The amax history of a quantized operand, or a clear error for a state built for another recipe."""
    if h is None:
        raise ValueError(f"{where}: the recipe quantizes the {role} but the state has no {role} history (None); "
                         f"build the state with recipe.init()")
    return h


def _requantize(x: jax.Array, spec: QuantSpec | None, est: jax.Array | None, key: jax.Array | None, axis: int,
                observe: bool | jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """The forward's quantized operand and masked-STE mask, recomputed from high precision (bit for bit)."""
    if spec is None:
        return x, None
    assert est is not None, "a quantized operand's forward estimate travels with it"
    r = round_with(x, spec, est, key, axis)
    keep = keep_mask(r.sat, observe, x.shape) if spec.ste == "masked" and observe is not True else None
    return select(observe, x, r.y), keep


def _on_backend(cfg: _DotConfig, observe: bool | jax.Array | None, hp: Any, real: Any) -> jax.Array:
    """The forward product on ``cfg.gemm`` (`real`), or `hp` (the fake-quant product, which is the high-precision
    one while observing) for "dequant" and a static warmup; a traced warmup flag selects with ``lax.cond``."""
    if cfg.gemm == "dequant" or observe is True:
        return hp()
    if observe is None or observe is False:
        return real()
    return lax.cond(observe, hp, real)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _qdot(cfg: _DotConfig, lhs, rhs, lhs_q, rhs_q, ctx: _Ctx, pending):
    ops = gemm.Operands(lhs, rhs, lhs_q, rhs_q, ctx.est_l, ctx.est_r, ctx.scale_l, ctx.scale_r)
    out = _on_backend(cfg, cfg.observe if cfg.observe is not None else ctx.observe,
                      lambda: _dot(cfg, lhs_q, rhs_q),
                      lambda: gemm.forward(cfg.gemm, cfg.recipe, cfg.dn, ops,
                                           jax.eval_shape(lambda: _dot(cfg, lhs_q, rhs_q)).dtype))
    return out if pending is None else (out, PendingAmax.none())


def _token_block(recipe: Recipe) -> int:
    """The multiple of tokens the backward pass needs: its weight gradient ``lhs^T . g`` contracts the token axis,
    and a block-scaled recipe blocks (NVFP4 / IF4: 16 elements) or rotates (Hadamard: 16 points) both of its operands
    along it. 1: no such requirement."""
    gs, act = recipe.grad, recipe.activation
    if gs is None:
        return 1
    sizes = [1]
    if gs.hadamard:
        sizes.append(16)
    if gs.is_nvfp4:
        sizes.append(int(two_level(gs)[1][-1]))
    if act is not None and act.is_nvfp4:
        sizes.append(int(two_level(act)[1][-1]))
    return math.lcm(*sizes)


def _check_tokens(cfg: _DotConfig, lhs: jax.Array) -> None:
    """Refuse, at trace time of the differentiated forward, a token count the backward cannot block."""
    block = _token_block(cfg.recipe)
    n = math.prod(lhs.shape[:-1])
    if n % block:
        rotates = cfg.recipe.grad is not None and cfg.recipe.grad.hadamard
        what = "blocks (NVFP4/IF4 scales per 16 elements) and rotates (16-point Hadamard)" if rotates \
            else "blocks (NVFP4/IF4 scales per 16 elements)"
        raise ValueError(
            f"{cfg.where}: recipe {cfg.recipe.name!r} {what} the weight gradient's operands along the token axis, so "
            f"the number of tokens (the product of the activation's leading axes, shape {tuple(lhs.shape)}) must be "
            f"a multiple of {block}; got {n}. Pad or pack the batch to a multiple of {block} tokens (batch x "
            f"sequence), or quantize this layer with a recipe that keeps gradients in high precision (e.g. "
            f"qat.nvfp4_w4a4) for small batches. A forward pass without gradients (evaluation, generation) takes "
            f"any number of tokens.")


def _qdot_fwd(cfg, lhs, rhs, lhs_q, rhs_q, ctx, pending):
    _check_tokens(cfg, lhs)  # traced only when differentiated: the backward's requirement, before it is traced
    # Residuals: the high-precision operands (alive anyway: the weight is a parameter, the activation usually the
    # previous layer's residual) and scalars; the quantized copies are recomputed in the backward pass.
    return _qdot(cfg, lhs, rhs, lhs_q, rhs_q, ctx, pending), (lhs, rhs, ctx)


def _qdot_bwd(cfg, res, ct):
    lhs, rhs, ctx = res
    r = cfg.recipe
    g, ct_pending = ct if r.delayed_grad else (ct, None)
    observe = cfg.observe if cfg.observe is not None else ctx.observe
    gs = r.grad
    if convention(gs) == "flax":  # Flax's fp8 dot runs its backward GEMMs at HIGHEST (TF32 matters on GPUs)
        cfg = dataclasses.replace(cfg, precision=lax.Precision.HIGHEST)
    k_d, k_w = (None, None) if ctx.key_g is None else tuple(jax.random.split(ctx.key_g))
    block_scaled = gs.is_nvfp4 or gs.hadamard or any(s is not None and s.is_nvfp4 for s in (r.weight, r.activation))
    lhs_q, keep_l = _requantize(lhs, r.activation, ctx.est_l, ctx.key_l, -1, observe)
    rhs_q, keep_r = _requantize(rhs, r.weight, ctx.est_r, ctx.key_r, 0, observe)

    # dgrad = g . rhs^T (contracts rhs's free axis M, the last axis of g and of rhs [K, M])
    pending_ct = None
    if r.delayed_grad:  # scale from the history; this gradient's amax leaves as the gradient of `pending`
        a_g = abs_max(g).astype(jnp.float32)
        g_d = round_with(g, gs, gs.scaling.amax_estimate(ctx.grad_hist, a_g), k_d, axis=-1).y
        assert ct_pending is not None  # delayed gradient scaling: the pending amax is a primal input
        pending_ct = PendingAmax(seen=jnp.ones((), jnp.float32), amax=jnp.maximum(a_g, ct_pending.amax))
    else:
        g_d = _quantize_grad(g, gs, k_d, axis=-1)
    w_d = rhs_q
    if r.weight is not None and r.weight.is_nvfp4:
        w_d = nvfp4_fake_quant(rhs, r.weight, _global_amax(r.weight, ctx.est_r), None, axis=1)
    w_d = select(observe, rhs, w_d)
    g_d = select(observe, g, g_d)
    _, vjp_l = jax.vjp(lambda a: _dot(cfg, a, w_d), lhs_q)
    (dl,) = vjp_l(g_d)

    # wgrad = lhs^T . g, contracting the token axes: flatten lhs to [N, K] and g to [N, M] for the transform and
    # the blocks (along N), then restore the layout so the GEMM itself is the one autodiff of the plain op runs.
    if block_scaled:
        x2 = lhs.reshape(-1, lhs.shape[-1])
        x_w = _maybe_hadamard(x2, gs.hadamard)
        if r.activation is not None:
            if r.activation.is_nvfp4:
                amax = None if gs.hadamard else _global_amax(r.activation, ctx.est_l)  # after the RHT: recomputed
                x_w = nvfp4_fake_quant(x_w, r.activation, amax, None, axis=0)
            elif gs.hadamard:
                current = dataclasses.replace(r.activation, scaling=CurrentScaling(
                    target_max=r.activation.scaling.target_max))
                x_w = _quantize_grad(x_w, current, None, axis=0)
            else:
                x_w = lhs_q.reshape(x2.shape)
        x_w = x_w.reshape(lhs.shape)
        g_w = _quantize_grad(_maybe_hadamard(g.reshape(-1, g.shape[-1]), gs.hadamard), gs, k_w, axis=0)
        g_w = g_w.reshape(g.shape)
    else:  # per-tensor formats: quantization commutes with the transpose; reuse the forward operand and g_d
        x_w, g_w = lhs_q, g_d
    x_w = select(observe, lhs, x_w)
    g_w = select(observe, g, g_w)
    _, vjp_r = jax.vjp(lambda b: _dot(cfg, x_w, b), rhs_q)
    (dr,) = vjp_r(g_w)

    if keep_l is not None:
        dl = jnp.where(keep_l, dl, jnp.zeros((), dl.dtype))
    if keep_r is not None:
        dr = jnp.where(keep_r, dr, jnp.zeros((), dr.dtype))
    return dl.astype(lhs.dtype), dr.astype(rhs.dtype), None, None, None, pending_ct


_qdot.defvjp(_qdot_fwd, _qdot_bwd)


def _global_amax(spec: QuantSpec, est: jax.Array) -> jax.Array | None:
    """The global amax an NVFP4 operand was quantized with in the forward (None: recomputed from the tensor)."""
    return est if fixed_estimate(spec) else None


def dot_general(
    lhs: ArrayLike,
    rhs: ArrayLike,
    dimension_numbers: DimensionNumbers,
    *,
    recipe: Recipe,
    state: RecipeState,
    observe_only: bool | jax.Array = False,
    key: jax.Array | None = None,
    precision: PrecisionLike = None,
    preferred_element_type: DTypeLike | None = None,
    where: str = "",
) -> tuple[jax.Array, RecipeState, RecipeStats]:
    """``lax.dot_general`` with `lhs` (activation) and `rhs` (weight) fake-quantized per `recipe`.

    Forward: ``dot_general(Q_a(lhs), Q_w(rhs))``; the new state records both amaxes. Backward: straight-through
    for both operands (masked per ``ste``). With ``recipe.grad`` set, the output gradient is quantized (stochastic
    rounding with a key split from `key`) before the dgrad and wgrad GEMMs, the quantized forward operands are
    recomputed from high precision (not saved), and with delayed gradient scaling the scale comes from
    ``state.grad`` while the gradient's amax leaves as the gradient w.r.t. ``state.grad_pending`` (keep it as that
    field's new value; :func:`jaxlowfp.scaling.pending_amaxes`). NVFP4 operands are
    re-quantized from high precision with blocks along the GEMM's contraction axis, and ``grad.hadamard`` rotates
    both wgrad operands along the token axis. NVFP4 and Hadamard need the linear layout ``lhs [..., K]``,
    ``rhs [K, M]``; the per-tensor 8-bit formats accept any dimension numbers. ``observe_only`` makes forward and
    backward exactly the high-precision ones. A recipe that blocks or rotates the weight gradient along the tokens
    (``nvfp4_training``, ``if4_training``) needs a multiple of 16 tokens (``prod(lhs.shape[:-1])``) when
    differentiated: refused when the gradient is traced, before the backward pass. The straight-through gradient
    is reverse mode only (``jax.jvp`` raises, naming `where`), except with a static ``observe_only=True`` and a
    recipe without delayed gradient scaling, which is plain JAX. `where` names the layer in errors.

    Returns ``(out, new_state, stats)`` with a :class:`RecipeState` and :class:`RecipeStats`.
    """
    where = where or "qat.dot_general"
    if not isinstance(recipe, Recipe):
        raise TypeError(f"{where}: recipe must be a Recipe; got {type(recipe).__name__}")
    if not isinstance(state, RecipeState):
        raise TypeError(f"{where}: state must be a RecipeState (recipe.init()); got {type(state).__name__}")
    lhs = float_input(lhs, "lhs")
    rhs = float_input(rhs, "rhs")
    dn = dimension_numbers_of(dimension_numbers)
    observe = bool_flag(observe_only)
    linear_layout = _is_linear(lhs, rhs, dn)
    needs_layout = recipe.grad is not None and recipe.grad.hadamard
    needs_layout |= any(s is not None and s.is_block_scaled for s in (recipe.weight, recipe.activation, recipe.grad))
    if needs_layout and not linear_layout:
        raise NotImplementedError(
            f"{where}: recipe {recipe.name!r} uses block scales (NVFP4, IF4, MX) or the Hadamard transform, which "
            f"need the linear layout lhs [..., K] . rhs [K, M] (dimension_numbers (((lhs.ndim-1,), (0,)), ((), "
            f"()))); got "
            f"dimension_numbers={dn}, lhs {lhs.shape}, rhs {rhs.shape}"
        )
    keys = [None, None, None] if key is None else list(jax.random.split(key, 3))
    for role, spec in (("activation", recipe.activation), ("weight", recipe.weight), ("grad", recipe.grad)):
        if spec is not None:
            need_key(spec, key, f"recipe.{role}")
    if recipe.delayed_grad and not (isinstance(state.grad, AmaxHistory)
                                    and isinstance(state.grad_pending, PendingAmax)):
        raise ValueError(f"{where}: recipe {recipe.name!r} scales the output gradient with delayed scaling, but "
                         f"the state has no gradient history (grad={type(state.grad).__name__}, grad_pending="
                         f"{type(state.grad_pending).__name__}); build the state with recipe.init()")
    st_a: AmaxHistory | None
    st_w: AmaxHistory | None
    if recipe.activation is not None:
        qa = quantize(lhs, _history(state.activation, "activation", where), recipe.activation, observe, keys[0],
                      axis=-1)
        lhs_q, keep_l, st_a, stats_a, est_l = qa
    else:
        lhs_q, keep_l, st_a, stats_a, est_l = lax.stop_gradient(lhs), None, state.activation, None, None
    if recipe.weight is not None:
        qw = quantize(rhs, _history(state.weight, "weight", where), recipe.weight, observe, keys[1],
                      axis=0)  # rhs [K, M]: blocks along K
        rhs_q, keep_r, st_w, stats_w, est_r = qw
    else:
        rhs_q, keep_r, st_w, stats_w, est_r = lax.stop_gradient(rhs), None, state.weight, None, None
    static_obs = observe if isinstance(observe, bool) else None
    backend = gemm.plan(recipe, where=where).backend
    cfg = _DotConfig(dn, precision, preferred_element_type, recipe, static_obs, where, backend)
    scale_l = None if stats_a is None else stats_a.scale
    scale_r = None if stats_w is None else stats_w.scale
    grad_hist, pending = state.grad, state.grad_pending
    what = f"recipe {recipe.name!r}"
    if static_obs is True and not recipe.delayed_grad:
        # observing: both operands are the high-precision ones bitwise and every gradient the plain one (the custom
        # backward selects the high-precision operands), so the plain op is the same function, forward mode included
        out = _dot(cfg, lhs, rhs)
    elif recipe.grad is None:
        a = reverse_mode_only(straight_through, lhs, lhs_q, keep_l, where=where, what=what)
        b = reverse_mode_only(straight_through, rhs, rhs_q, keep_r, where=where, what=what)
        ops = gemm.Operands(lax.stop_gradient(lhs), lax.stop_gradient(rhs), lhs_q, rhs_q, est_l, est_r, scale_l,
                            scale_r)
        dot = functools.partial(_dot, cfg)
        out = _on_backend(cfg, observe, lambda: dot(a, b),
                          lambda: gemm.product(backend, recipe, dn, dot, ops, a, b))
    else:
        check_size(jax.eval_shape(lambda a, b: _dot(cfg, a, b), lhs_q, rhs_q).shape, "the output gradient")
        traced_obs = None if static_obs is not None else observe
        ctx = _Ctx(est_l, est_r, keys[0], keys[1], keys[2], cast(jax.Array | None, traced_obs), None, scale_l,
                   scale_r)
        if recipe.delayed_grad:  # record the amax the last backward pass reported, then hand the history over
            grad_hist = record_pending(recipe.grad.scaling, cast(AmaxHistory, state.grad),  # checked above
                                       lax.stop_gradient(cast(PendingAmax, pending)))
            out, pending = reverse_mode_only(
                _qdot, cfg, lhs, rhs, lhs_q, rhs_q, ctx._replace(grad_hist=lax.stop_gradient(grad_hist)), pending,
                where=where, what=what)
        else:
            out = reverse_mode_only(_qdot, cfg, lhs, rhs, lhs_q, rhs_q, ctx, None, where=where, what=what)
    new_state = RecipeState(weight=st_w, activation=st_a, grad=grad_hist, grad_pending=pending)
    return out, new_state, RecipeStats(weight=stats_w, activation=stats_a)


def linear(
    x: ArrayLike,
    w: ArrayLike,
    *,
    recipe: Recipe,
    state: RecipeState,
    observe_only: bool | jax.Array = False,
    key: jax.Array | None = None,
    precision: PrecisionLike = None,
    preferred_element_type: DTypeLike | None = None,
    where: str = "",
) -> tuple[jax.Array, RecipeState, RecipeStats]:
    """``x @ w`` quantized per `recipe`: x [..., in], w [in, out] (``nnx.Linear``'s kernel layout).

    Same as :func:`dot_general` with ``dimension_numbers=(((x.ndim - 1,), (0,)), ((), ()))``. `w` must be 2-D and
    `x` at least 1-D with ``x.shape[-1] == w.shape[0]``. `where` names the layer in errors.
    """
    where = where or "qat.linear"
    x = float_input(x, "x")
    w = float_input(w, "w")
    if w.ndim != 2:
        raise ValueError(f"{where}: the weight w must be 2-D [in_features, out_features] (nnx.Linear's kernel "
                         f"layout); got shape {tuple(w.shape)}. Reshape a vector to [in, 1] (or [1, out]), or use "
                         f"qat.dot_general / jaxlowfp.qat.contract.contract for other layouts")
    if x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"{where}: x [..., in_features] and w [in_features, out_features] must agree on "
                         f"in_features; got x {tuple(x.shape)} and w {tuple(w.shape)}")
    return dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), recipe=recipe, state=state,
                       observe_only=observe_only, key=key, precision=precision,
                       preferred_element_type=preferred_element_type, where=where)


