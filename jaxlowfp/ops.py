"""The one op layer: every quantized contraction of jaxlowfp, from a recipe and its state.

QAT layers (`jaxlowfp.qnnx`, `jaxlowfp.qlinen`), PTQ's run-time activation quantizers (`jaxlowfp.ptq.layers`) and
the Qwix provider (`jaxlowfp.qwix_provider`) are adapters: they only carry state, and every quantized product they
compute is :func:`dot_general` or :func:`einsum` here. A format, a scaling mode or an op added here reaches every
path at once. Each call writes, on the op's own `ExecutionRecord` (``record=``), that the op executed and on which
GEMM backend, which is how the reports tell a layer that is quantized on paper from one whose quantized op really
runs (`jaxlowfp.execution`).

A contraction of an activation ``x`` with a weight ``w`` (either operand position) and no batch axes is a GEMM
after a transpose and a reshape::

    x -> x' [*x_free, K]      (free axes first, the contracted axes last, flattened: K = prod of their sizes)
    w -> w' [K, M]            (contracted axes first, in the same order, then the free axes flattened)
    y  = linear(x', w') [*x_free, M] -> reshape [*x_free, *w_free] -> the layout lax.dot_general returns

so every recipe of :mod:`jaxlowfp.qat` applies unchanged, NVFP4 and the Hadamard transform included: block scales
run along the flattened contraction axis K (the GEMM's K), the backward pass re-quantizes along the axes the
backward GEMMs contract. A contraction already in the linear layout (``x [..., K] . w [K, M]``) is passed to
:func:`jaxlowfp.qat.linear` as it is, so it is bit for bit a ``QuantLinear``. Contractions with batch axes (a
kernel with a leading expert axis, say) go to :func:`jaxlowfp.qat.matmul.dot_general` as they are: the per-tensor 8-bit
formats take any dimension numbers, block-scaled recipes raise an error.

Per-tensor scaling commutes with transposes and reshapes, so nothing here changes what is quantized; the reshape
only decides where the 16-element (NVFP4) or 32-element (MX) blocks lie (along K, in the order the contracted axes
are listed). Per-token scaling (``CurrentScaling(granularity="token")``) takes one amax per row of ``x'``.
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import opt_einsum
from jax import lax

from jaxlowfp._core.checks import dimension_numbers_of, float_input
from jaxlowfp._core.executed import ExecutionRecord, RecordSink, new_op_key
from jaxlowfp._core.executed import write as _mark
from jaxlowfp._core.reduce import group_ids, segment_amax
from jaxlowfp.qat import gemm
from jaxlowfp.qat.matmul import linear
from jaxlowfp.qat.matmul import dot_general as _batched_dot_general
from jaxlowfp.qat.spec import Recipe, RecipeState, RecipeStats

__all__ = ["Einsum", "parse_einsum", "dot_general", "einsum", "check_blocks", "needs_linear_layout",
           "contraction_sizes", "ExecutionRecord", "new_op_key", "ragged_dot", "ragged_state",
           "EXPERT_SCALES"]



class Einsum(NamedTuple):
    """A two-operand einsum as a ``lax.dot_general``: its dimension numbers and the permutation that takes the
    dot_general output (batch, lhs free, rhs free) to the einsum's output order."""

    dimension_numbers: tuple
    out_perm: tuple[int, ...]
    spec: str  # the explicit form, ellipses replaced by letters (opt_einsum's parser)


def parse_einsum(spec: str, lhs: Any, rhs: Any) -> Einsum:
    """The dot_general form of ``jnp.einsum(spec, lhs, rhs)`` (`lhs`, `rhs`: anything with a ``shape``).

    Letters in both operands and the output are batch axes, in both operands only contracted, in one operand and
    the output free. Refused with a ValueError (a quantized GEMM does not compute them): more or fewer than two
    operands, a letter repeated within an operand (a diagonal) or in the output, and a letter in one operand only
    that the output drops (a sum over it).
    """
    if not isinstance(spec, str):
        raise TypeError(f"einsum spec must be a str; got {type(spec).__name__}: {spec!r}")
    spec = spec.replace(" ", "")
    try:
        ins, out, _ = opt_einsum.parser.parse_einsum_input((spec, lhs, rhs))
    except (ValueError, TypeError, IndexError) as e:
        raise ValueError(f"einsum {spec!r} with operands of shapes {tuple(lhs.shape)} and {tuple(rhs.shape)}: "
                         f"{e}") from None
    parts = ins.split(",")
    if len(parts) != 2:
        raise ValueError(f"a quantized einsum takes exactly two operands; {spec!r} has {len(parts)}")
    a, b = parts
    for name, s in (("lhs", a), ("rhs", b), ("output", out)):
        if len(set(s)) != len(s):
            raise ValueError(f"einsum {spec!r}: the {name} repeats a letter ({s!r}); diagonals and traces are not "
                             f"a GEMM, so they are not quantized (compute them with jnp.einsum outside the rule)")
    for s, name in ((a, "lhs"), (b, "rhs")):
        summed = [c for c in s if c not in out and c not in (b if name == "lhs" else a)]
        if summed:
            raise ValueError(f"einsum {spec!r} sums the {name} axis {''.join(summed)!r} that only the {name} has; "
                             f"that is a reduction, not a GEMM, so it is not quantized (sum it first)")
    missing = [c for c in out if c not in a and c not in b]
    if missing:
        raise ValueError(f"einsum {spec!r}: output letters {''.join(missing)!r} appear in no operand")
    batch = [c for c in a if c in b and c in out]
    contracted = [c for c in a if c in b and c not in out]
    a_free = [c for c in a if c not in b]
    b_free = [c for c in b if c not in a]
    dn = ((tuple(a.index(c) for c in contracted), tuple(b.index(c) for c in contracted)),
          (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)))
    order = batch + a_free + b_free  # the axes of the dot_general output
    return Einsum(dn, tuple(order.index(c) for c in out), f"{a},{b}->{out}")


def needs_linear_layout(recipe: Recipe) -> bool:
    """Whether `recipe` blocks an operand (NVFP4, IF4, MX) or rotates the wgrad operands (Hadamard): it then needs the
    linear layout, i.e. a contraction without batch axes."""
    specs = (recipe.weight, recipe.activation, recipe.grad)
    return any(s is not None and s.is_block_scaled for s in specs) or (recipe.grad is not None and
                                                                        recipe.grad.hadamard)


def check_blocks(recipe: Recipe, k: int, m: int, where: str, *, k_name: str = "in_features",
                 m_name: str = "out_features") -> None:
    """Block-scaled formats need whole blocks: the activation [.., K] is blocked along K, the weight [K, M] along
    K and, for 2D tiles (r, c), along M by r; a quantized output gradient [.., M] along M. (The wgrad blocks run
    along the tokens: that count is checked per call.) `k_name` / `m_name` say what K and M are in the message."""
    for role in ("activation", "weight", "grad"):
        spec = getattr(recipe, role, None)
        if spec is None or spec.blocks is None:
            continue
        block = tuple(int(b) for b in spec.blocks)
        problems = []
        if role == "grad":  # dgrad quantizes dy [.., M] in blocks along M
            if m % block[-1]:
                problems.append(f"{m_name}={m} is not a multiple of the block size {block[-1]}")
        elif k % block[-1]:
            problems.append(f"{k_name}={k} is not a multiple of the block size {block[-1]}")
        if role == "weight" and block[0] > 1 and m % block[0]:
            problems.append(f"{m_name}={m} is not a multiple of the tile height {block[0]}")
        if problems:
            raise ValueError(
                f"{where}: recipe {recipe.name!r} quantizes the {role} as {spec.format} with block_shape={block}, "
                f"but {' and '.join(problems)}. Keep this layer in high precision (a Rule with recipe=None) "
                f"or use a recipe without block scaling."
            )


def contraction_sizes(w_shape: Sequence[int], w_contract: Sequence[int], w_batch: Sequence[int]) -> tuple[int, int]:
    """(K, M) of a weight of shape `w_shape`: the product of its contracted axes, and of its free axes."""
    k = math.prod(int(w_shape[i]) for i in w_contract)
    m = math.prod(int(d) for i, d in enumerate(w_shape) if i not in w_contract and i not in w_batch)
    return k, m


def _axes_name(axes: Sequence[int]) -> str:
    return "axis " + str(axes[0]) if len(axes) == 1 else "axes " + str(tuple(axes))


def dot_general(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    *,
    recipe: Recipe,
    state: RecipeState | None = None,
    weight: int = 1,
    observe_only: bool | jax.Array = False,
    key: jax.Array | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    where: str = "",
    record: RecordSink | None = None,
    op_key: str | None = None,
) -> tuple[jax.Array, RecipeState, RecipeStats]:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` with the activation and the weight (``lhs`` if
    ``weight=0``, ``rhs`` if ``weight=1``) fake-quantized per `recipe`; same output layout as lax.dot_general.

    Without batch axes the contraction runs as :func:`jaxlowfp.qat.linear` on the transposed, flattened operands
    (module docstring): any recipe. With batch axes it runs as :func:`jaxlowfp.qat.matmul.dot_general`: per-tensor
    8-bit recipes only. Returns ``(out, new_state, stats)`` like those two. `state` None: ``recipe.init()`` (a
    stateless call: current or static scaling). `where` names the op in errors; `record` (the op's
    `ExecutionRecord`) is set to "executed on <backend>" by the call. `op_key`: deprecated, ignored.
    """
    if state is None:
        state = recipe.init()
    if weight not in (0, 1) or isinstance(weight, bool):
        raise ValueError(f"weight must be 0 (lhs is the weight) or 1 (rhs is the weight); got {weight!r}")
    lhs = float_input(lhs, "lhs")
    rhs = float_input(rhs, "rhs")
    (lc, rc), (lb, rb) = dimension_numbers_of(dimension_numbers)
    lc, rc, lb, rb = (tuple(d % n for d in ax) for ax, n in ((lc, lhs.ndim), (rc, rhs.ndim), (lb, lhs.ndim),
                                                             (rb, rhs.ndim)))
    x, w = (rhs, lhs) if weight == 0 else (lhs, rhs)
    (xc, wc), (xb, wb) = ((rc, lc), (rb, lb)) if weight == 0 else ((lc, rc), (lb, rb))
    where = where or "jaxlowfp.ops.dot_general"
    x_free = [i for i in range(x.ndim) if i not in xc and i not in xb]
    w_free = [i for i in range(w.ndim) if i not in wc and i not in wb]
    common = dict(recipe=recipe, state=state, observe_only=observe_only, key=key, precision=precision,
                  preferred_element_type=preferred_element_type, where=where)
    if xb:
        if needs_linear_layout(recipe):
            raise NotImplementedError(
                f"{where}: recipe {recipe.name!r} blocks an operand (NVFP4) or rotates the weight gradient "
                f"(Hadamard), which needs the linear layout (a contraction without batch axes); this one has "
                f"batch {_axes_name(xb)} "
                f"of the activation {tuple(x.shape)} and {_axes_name(wb)} of the weight {tuple(w.shape)}. Use a "
                f"per-tensor 8-bit recipe (HiF8, E4M3/E5M2) here, or keep it in high precision")
        y, new_state, stats = _batched_dot_general(x, w, ((xc, wc), (xb, wb)), **common)
        if weight == 0:  # lax.dot_general(w, x) orders (batch, w free, x free)
            nb = len(xb)
            nx, nw = len(x_free), len(w_free)
            y = jnp.transpose(y, (*range(nb), *range(nb + nx, nb + nx + nw), *range(nb, nb + nx)))
        _mark(record, gemm.plan(recipe, where=where).backend)
        return y, new_state, stats
    k, m = contraction_sizes(w.shape, wc, ())
    check_blocks(recipe, k, m, where, k_name=f"the contraction size K (weight {_axes_name(wc)} of "
                 f"{tuple(w.shape)})", m_name=f"the weight's free size M (of {tuple(w.shape)})")
    x_perm = (*x_free, *xc)
    w_perm = (*wc, *w_free)
    xt = x if x_perm == tuple(range(x.ndim)) else jnp.transpose(x, x_perm)
    wt = w if w_perm == tuple(range(w.ndim)) else jnp.transpose(w, w_perm)
    x_free_shape = tuple(x.shape[i] for i in x_free)
    w_free_shape = tuple(w.shape[i] for i in w_free)
    if xt.ndim != len(x_free) + 1:
        xt = jnp.reshape(xt, (*x_free_shape, k))
    if wt.shape != (k, m):
        wt = jnp.reshape(wt, (k, m))
    y, new_state, stats = linear(xt, wt, **common)
    if y.shape != (*x_free_shape, *w_free_shape):
        y = jnp.reshape(y, (*x_free_shape, *w_free_shape))
    if weight == 0:
        nx, nw = len(x_free), len(w_free)
        y = jnp.transpose(y, (*range(nx, nx + nw), *range(nx)))
    _mark(record, gemm.plan(recipe, where=where).backend)
    return y, new_state, stats


def einsum(
    spec: str,
    lhs: Any,
    rhs: Any,
    *,
    recipe: Recipe,
    state: RecipeState | None = None,
    weight: int = 1,
    observe_only: bool | jax.Array = False,
    key: jax.Array | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    where: str = "",
    record: RecordSink | None = None,
    op_key: str | None = None,
) -> tuple[jax.Array, RecipeState, RecipeStats]:
    """``jnp.einsum(spec, lhs, rhs)`` quantized per `recipe`: :func:`parse_einsum`, then :func:`dot_general`,
    then the einsum's output order. Same arguments and results as :func:`dot_general`."""
    e = parse_einsum(spec, lhs, rhs)
    y, new_state, stats = dot_general(lhs, rhs, e.dimension_numbers, recipe=recipe, state=state, weight=weight,
                                      observe_only=observe_only, key=key, precision=precision,
                                      preferred_element_type=preferred_element_type, where=where, record=record)
    return (y if e.out_perm == tuple(range(y.ndim)) else jnp.transpose(y, e.out_perm)), new_state, stats


contract = dot_general  # the name of jaxlowfp <= 0.1 (jaxlowfp.qat.contract.contract)


# --- grouped GEMM (mixtures of experts) -------------------------------------------------------------------------

EXPERT_SCALES = ("per_expert", "shared")


def ragged_state(recipe: Recipe, n_groups: int, expert_scales: str = "per_expert") -> RecipeState:
    """The state of a quantized :func:`ragged_dot` over `n_groups` experts: each operand's amax history stacked
    along a leading expert axis [G] (``"per_expert"``: every expert's weight and routed activations have their
    own scale) or one history shared by all experts (``"shared"``)."""
    if expert_scales not in EXPERT_SCALES:
        raise ValueError(f"expert_scales={expert_scales!r}; allowed: {', '.join(map(repr, EXPERT_SCALES))}")
    state = recipe.init()
    if expert_scales == "shared":
        return state
    stack = lambda h: None if h is None else jax.tree.map(  # noqa: E731
        lambda leaf: jnp.broadcast_to(leaf, (int(n_groups), *leaf.shape)), h)
    return state._replace(weight=stack(state.weight), activation=stack(state.activation))


def _fixed(spec: Any) -> Any:
    """`spec` taking the estimate it is given as its scale (per tensor current scaling becomes static): the
    grouped GEMM hands each expert's own amax to the quantizer."""
    from jaxlowfp.scaling import CurrentScaling, StaticScaling

    if isinstance(spec.scaling, CurrentScaling) and spec.scaling.granularity == "tensor" and not spec.is_mx:
        return dataclasses.replace(spec, scaling=StaticScaling(amax=1.0, target_max=spec.scaling.target_max),
                                   target_max=None)
    return spec


def _ragged(a: jax.Array, b: jax.Array, group_sizes: jax.Array, *, precision: Any,
            preferred_element_type: Any) -> jax.Array:
    return lax.ragged_dot(a, b, group_sizes, precision=precision, preferred_element_type=preferred_element_type)


def ragged_dot(
    lhs: Any,
    rhs: Any,
    group_sizes: Any,
    *,
    recipe: Recipe,
    state: RecipeState | None = None,
    expert_scales: str = "per_expert",
    observe_only: bool | jax.Array = False,
    key: jax.Array | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    where: str = "",
    record: RecordSink | None = None,
    op_key: str | None = None,
) -> tuple[jax.Array, RecipeState, RecipeStats]:
    """``jax.lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])`` (rows sorted by expert, ``group_sizes[g]``
    rows for expert g) with the routed activations and every expert's weight fake-quantized per `recipe`.

    Each expert is quantized as the GEMM ``x_g [m_g, K] @ W_g [K, N]`` of :func:`dot_general` would be: blocks
    (NVFP4, IF4, MX) along K within the expert, and, with ``expert_scales="per_expert"`` (default), its own amax for
    its weight and for the rows routed to it, so an expert's quantization never depends on the others' tokens;
    ``"shared"`` takes one amax over all experts (one history). The state is :func:`ragged_state`'s. An expert that
    gets no row in a call leaves its activation history as it was (nothing is recorded, never a 0); rows past
    ``sum(group_sizes)`` are padding and enter no amax. Backward: straight-through (``recipe.grad`` must be None).
    Returns ``(out [M, N], new_state, stats)``; the stats are over all experts (max amax and scale, fractions of
    all elements).
    """
    from jaxlowfp._core.checks import bool_flag
    from jaxlowfp._core.reduce import abs_max
    from jaxlowfp.qat.scaled_quant import (keep_mask, round_with, sat_count, select, straight_through, tensor_stats,
                                         underflow_count)

    where = where or "jaxlowfp.ops.ragged_dot"
    if recipe.grad is not None:
        raise NotImplementedError(f"{where}: recipe {recipe.name!r} quantizes the output gradient; the quantized "
                                  f"grouped GEMM has a straight-through backward only (use a recipe with grad=None)")
    backend = gemm.grouped_plan(recipe, where=where).backend
    lhs, rhs = float_input(lhs, "lhs"), float_input(rhs, "rhs")
    group_sizes = jnp.asarray(group_sizes)
    if lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1] or group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"{where}: ragged_dot takes lhs [M, K], rhs [G, K, N] and group_sizes [G]; got lhs "
                         f"{tuple(lhs.shape)}, rhs {tuple(rhs.shape)}, group_sizes {tuple(group_sizes.shape)}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"{where}: group_sizes must be integers; got {group_sizes.dtype}")
    g, k, n = (int(d) for d in rhs.shape)
    check_blocks(recipe, k, n, where, k_name="the contraction size K (rhs axis 1)",
                 m_name="the experts' output size N (rhs axis 2)")
    if state is None:
        state = ragged_state(recipe, g, expert_scales)
    per_expert = expert_scales == "per_expert"
    if expert_scales not in EXPERT_SCALES:
        raise ValueError(f"{where}: expert_scales={expert_scales!r}; allowed: {', '.join(map(repr, EXPERT_SCALES))}")
    observe = bool_flag(observe_only)
    m = int(lhs.shape[0])
    gid, valid = group_ids(group_sizes.astype(jnp.int32), m)
    has_rows = group_sizes > 0
    keys = [None, None] if key is None else list(jax.random.split(key, 2))

    def stats_of(x, y, sat, amax, est, scale):  # over all experts
        return tensor_stats(x, abs_max(amax), jnp.max(est), jnp.max(scale), sat_count(sat), underflow_count(x, y))

    def estimate(spec, hist, amax, keep):
        """Per expert (vmapped) or shared estimate and new history; experts with keep False keep their history."""
        if isinstance(getattr(spec.scaling, "amax", None), tuple):  # StaticScaling with one amax per expert
            if len(spec.scaling.amax) != g:
                raise ValueError(f"{where}: StaticScaling has {len(spec.scaling.amax)} calibrated amaxes for {g} "
                                 f"experts")
            return jnp.asarray(spec.scaling.amax, jnp.float32), hist
        if per_expert:
            est = jax.vmap(spec.scaling.amax_estimate)(hist, amax)
            new = jax.vmap(spec.scaling.update)(hist, amax)
            new = jax.tree.map(lambda a, b: jnp.where(keep.reshape(keep.shape + (1,) * (a.ndim - 1)), a, b), new, hist)
            return est, new
        a = abs_max(jnp.where(keep, amax, 0.0))
        est = spec.scaling.amax_estimate(hist, a)
        new = jax.tree.map(lambda u, v: jnp.where(jnp.any(keep), u, v), spec.scaling.update(hist, a), hist)
        return jnp.broadcast_to(est, (g,)), new

    # activations: each row with its expert's estimate
    x = lax.stop_gradient(lhs)
    spec = recipe.activation
    if spec is not None:
        row_amax = abs_max(x, axis=-1).astype(jnp.float32)
        amax_g = segment_amax(row_amax, gid, valid, g)
        est_g, new_a = estimate(spec, state.activation, amax_g, has_rows)
        token = getattr(spec.scaling, "granularity", "tensor") == "token"
        est_rows = row_amax if token else est_g[gid]
        fixed = _fixed(spec)
        if keys[0] is not None and spec.rounding != "nearest":
            r = jax.vmap(lambda v, e, kk: round_with(v, fixed, e, kk, -1))(x, est_rows, jax.random.split(keys[0], m))
        else:
            r = jax.vmap(lambda v, e: round_with(v, fixed, e, None, -1))(x, est_rows)
        x_q = select(observe, x, r.y)
        keep_x = keep_mask(r.sat, observe, x.shape) if spec.ste == "masked" and observe is not True else None
        st_a = stats_of(x, r.y, None if r.sat is None else r.sat & valid[:, None], amax_g, est_g, r.scale)
        r_x = r
    else:
        x_q, keep_x, new_a, st_a = x, None, state.activation, None

    # weights: every expert with its own (or the shared) estimate, blocks along K
    w = lax.stop_gradient(rhs)
    spec = recipe.weight
    if spec is not None:
        amax_w = abs_max(w.reshape(g, -1), axis=-1).astype(jnp.float32)
        est_w, new_w = estimate(spec, state.weight, amax_w, jnp.ones((g,), bool))
        fixed = _fixed(spec)
        if keys[1] is not None and spec.rounding != "nearest":
            r = jax.vmap(lambda v, e, kk: round_with(v, fixed, e, kk, 0))(w, est_w, jax.random.split(keys[1], g))
        else:
            r = jax.vmap(lambda v, e: round_with(v, fixed, e, None, 0))(w, est_w)
        w_q = select(observe, w, r.y)
        keep_w = keep_mask(r.sat, observe, w.shape) if spec.ste == "masked" and observe is not True else None
        st_w = stats_of(w, r.y, r.sat, amax_w, est_w, r.scale)
    else:
        w_q, keep_w, new_w, st_w = w, None, state.weight, None

    a, b = straight_through(lhs, x_q, keep_x), straight_through(rhs, w_q, keep_w)
    dot = functools.partial(_ragged, precision=precision, preferred_element_type=preferred_element_type)
    if backend == "fp8" and observe is not True:  # the E4M3 codes on the grouped float8 GEMM (jaxlowfp.qat.gemm)
        ops = gemm.GroupedOperands(x_q, w_q, r_x.scale, r.scale, gid)
        real = functools.partial(gemm.grouped_product, dot, ops, a, b, group_sizes)
        out = real() if observe is False else lax.cond(observe, lambda: dot(a, b, group_sizes), real)
    else:
        out = dot(a, b, group_sizes)
    _mark(record, backend if observe is not True else "dequant")
    return out, state._replace(weight=new_w, activation=new_a), RecipeStats(weight=st_w, activation=st_a)


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
