"""Quantized general contractions: any ``lax.dot_general`` layout and two-operand ``einsum``, through the linear
layout of :func:`jaxlowfp.qat.linear`.

A contraction of an activation ``x`` with a weight ``w`` (either operand position) and no batch axes is a GEMM
after a transpose and a reshape::

    x -> x' [*x_free, K]      (free axes first, the contracted axes last, flattened: K = prod of their sizes)
    w -> w' [K, M]            (contracted axes first, in the same order, then the free axes flattened)
    y  = linear(x', w') [*x_free, M] -> reshape [*x_free, *w_free] -> the layout lax.dot_general returns

so every recipe of :mod:`jaxlowfp.qat` applies unchanged, NVFP4 and the Hadamard transform included: block scales
run along the flattened contraction axis K (the GEMM's K), the backward pass re-quantizes along the axes the
backward GEMMs contract. A contraction already in the linear layout (``x [..., K] . w [K, M]``) is passed to
:func:`~jaxlowfp.qat.linear` as it is, so it is bit for bit a ``QuantLinear``. Contractions with batch axes (a
kernel with a leading expert axis, say) go to :func:`~jaxlowfp.qat.dot_general` as they are: the per-tensor 8-bit
formats take any dimension numbers, block-scaled recipes raise an error.

Per-tensor scaling commutes with transposes and reshapes, so nothing here changes what is quantized; the reshape
only decides where NVFP4's 16-element blocks lie (along K, in the order the contracted axes are listed).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import opt_einsum

from jaxlowfp._core.checks import float_input
from jaxlowfp.qat.matmul import _normalize_dn, dot_general, linear
from jaxlowfp.qat.spec import Recipe, RecipeState, RecipeStats

__all__ = ["Einsum", "parse_einsum", "contract", "check_blocks", "needs_linear_layout", "contraction_sizes"]


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
    """Whether `recipe` blocks an operand (NVFP4) or rotates the wgrad operands (Hadamard): it then needs the
    linear layout, i.e. a contraction without batch axes."""
    specs = (recipe.weight, recipe.activation, recipe.grad)
    return any(s is not None and s.is_nvfp4 for s in specs) or (recipe.grad is not None and recipe.grad.hadamard)


def check_blocks(recipe: Recipe, k: int, m: int, where: str, *, k_name: str = "in_features",
                 m_name: str = "out_features") -> None:
    """Block-scaled formats need whole blocks: the activation [.., K] is blocked along K, the weight [K, M] along
    K and, for 2D tiles (r, c), along M by r; a quantized output gradient [.., M] along M. (The wgrad blocks run
    along the tokens: that count is checked per call.) `k_name` / `m_name` say what K and M are in the message."""
    for role in ("activation", "weight", "grad"):
        spec = getattr(recipe, role, None)
        block = getattr(spec, "block_shape", None) if spec is not None else None
        if block is None:
            continue
        block = tuple(int(b) for b in block)
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


def contract(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    *,
    recipe: Recipe,
    state: RecipeState,
    weight: int = 1,
    observe_only: bool | jax.Array = False,
    key: jax.Array | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    where: str = "",
) -> tuple[jax.Array, RecipeState, RecipeStats]:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` with the activation and the weight (``lhs`` if
    ``weight=0``, ``rhs`` if ``weight=1``) fake-quantized per `recipe`; same output layout as lax.dot_general.

    Without batch axes the contraction runs as :func:`~jaxlowfp.qat.linear` on the transposed, flattened operands
    (module docstring): any recipe. With batch axes it runs as :func:`~jaxlowfp.qat.dot_general`: per-tensor
    8-bit recipes only. Returns ``(out, new_state, stats)`` like those two. `where` names the op in errors.
    """
    if weight not in (0, 1) or isinstance(weight, bool):
        raise ValueError(f"weight must be 0 (lhs is the weight) or 1 (rhs is the weight); got {weight!r}")
    lhs = float_input(lhs, "lhs")
    rhs = float_input(rhs, "rhs")
    (lc, rc), (lb, rb) = _normalize_dn(dimension_numbers)
    lc, rc, lb, rb = (tuple(d % n for d in ax) for ax, n in ((lc, lhs.ndim), (rc, rhs.ndim), (lb, lhs.ndim),
                                                             (rb, rhs.ndim)))
    x, w = (rhs, lhs) if weight == 0 else (lhs, rhs)
    (xc, wc), (xb, wb) = ((rc, lc), (rb, lb)) if weight == 0 else ((lc, rc), (lb, rb))
    where = where or "contract"
    x_free = [i for i in range(x.ndim) if i not in xc and i not in xb]
    w_free = [i for i in range(w.ndim) if i not in wc and i not in wb]
    common = dict(recipe=recipe, state=state, observe_only=observe_only, key=key, precision=precision,
                  preferred_element_type=preferred_element_type, where=where)
    if xb:
        if needs_linear_layout(recipe):
            raise NotImplementedError(
                f"{where}: recipe {recipe.name!r} blocks an operand (NVFP4) or rotates the weight gradient "
                f"(Hadamard), which needs a contraction without batch axes; this one has batch {_axes_name(xb)} "
                f"of the activation {tuple(x.shape)} and {_axes_name(wb)} of the weight {tuple(w.shape)}. Use a "
                f"per-tensor 8-bit recipe (HiF8, E4M3/E5M2) here, or keep it in high precision")
        y, new_state, stats = dot_general(x, w, ((xc, wc), (xb, wb)), **common)
        if weight == 0:  # lax.dot_general(w, x) orders (batch, w free, x free)
            nb = len(xb)
            nx, nw = len(x_free), len(w_free)
            y = jnp.transpose(y, (*range(nb), *range(nb + nx, nb + nx + nw), *range(nb, nb + nx)))
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
    return y, new_state, stats
