"""The forward GEMM of a quantized product on an execution backend: ``Recipe(gemm=...)``.

QAT fake-quantizes both operands and multiplies the dequantized values in high precision (``gemm="dequant"``, the
default). With ``gemm="fp8"`` or ``"scaled_matmul"`` the forward product runs on the quantizers' own codes and
scales through :mod:`jaxlowfp.backends`, the GEMM the hardware has::

    fp8            E4M3 x E4M3 per-tensor (fp8_delayed, any convention): q = x̂ / s cast to float8_e4m3fn (exact:
                   x̂ = q s to within one float32 / bfloat16 rounding, far inside E4M3's spacing), then
                   dot_general(q_x, q_w) * (s_x s_w); cuBLASLt's FP8 GEMM on sm_89+
    scaled_matmul  NVFP4 (1x16 activation blocks; 1x16 or 16x16 weight tiles) and MXFP8 / MXFP4: the codes and block
                   scales of `jaxlowfp.nvfp4.quantize` / `jaxlowfp.mx.quantize` with the forward's own rule and
                   global amax (so they decode to the fake-quant operands bit for bit), then jax.nn.scaled_matmul;
                   cuDNN's block-scaled GEMM on sm_100+ (NVFP4, MXFP8)
    auto           the hardware GEMM where the device has it natively, else dequant; logged once

Only the forward product changes. The backward pass is the fake-quant path's: a ``jax.custom_vjp`` whose
backward is the VJP of the high-precision product of the fake-quantized operands, so gradients (straight-through,
masked, quantized output gradients) are those of ``gemm="dequant"``. The two forward results agree within float32
rounding of the summation order and of the factored-out scales (``tests/test_qat_gemm.py``).

Per-token FP8 activations (``CurrentScaling(granularity="token")``) take the fp8 backend with each row's scale
applied to the output; per-token NVFP4 activations take scaled_matmul the same way (each row quantized with its own
global scale, `jaxlowfp.backends.block_scaled_rows`). Not on a low-precision GEMM (refused when asked for explicitly,
dequant under "auto"): HiF8, E5M2 and IF4 operands (no hardware GEMM), a high-precision operand, per-token scaling of
a weight or of MX activations, and stochastic rounding of a forward operand.
"""
from __future__ import annotations

import functools
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxlowfp import backends, mx, nvfp4
from jaxlowfp._core.reduce import abs_max
from jaxlowfp._core.format import Format
from jaxlowfp.qat.scaled_quant import fixed_estimate, per_token
from jaxlowfp.qat.spec import GEMMS, MX_ELEMENTS, QuantSpec, Recipe, two_level

__all__ = ["GEMMS", "plan", "check", "Operands", "forward", "product", "grouped_plan", "GroupedOperands",
           "grouped_product"]



def _format(spec: QuantSpec | None) -> Format | None:
    """The packed format a forward operand is quantized to (None: no low-precision GEMM takes it)."""
    if spec is None:
        return None
    if spec.format == "nvfp4":
        rule, block = two_level(spec)
        return Format(kind="nvfp4", rule=rule, block_shape=block)
    if spec.format in MX_ELEMENTS:
        return Format(kind=spec.format)
    if spec.format == "e4m3":
        return Format(kind="fp8")
    return Format(kind=spec.format) if spec.format in ("hif8", "if4") else None


def _recipe_problem(recipe: Recipe) -> str | None:
    """Why no low-precision GEMM computes this recipe's forward product (None: one may)."""
    if recipe.weight is None or recipe.activation is None:
        return ("one operand stays in high precision (weight or activation None), so the product is a dot in high "
                "precision")
    for role in ("activation", "weight"):
        spec = getattr(recipe, role)
        if per_token(spec) and not (role == "activation" and spec.format in ("e4m3", "nvfp4")):
            return (f"the {role} uses per-token scaling, which only FP8 E4M3 and NVFP4 activations take on a GEMM "
                    f"backend (each row's scale applied to the output)")
        if spec.rounding != "nearest":
            return f"the {role} uses rounding={spec.rounding!r}; the GEMM backends re-encode round-to-nearest codes"
        if _format(spec) is None:
            return f"the {role} is {spec.format}, which no GEMM multiplies (E5M2 forward operands are dequantized)"
    return None


def plan(recipe: Recipe, *, device: Any = None, where: str = "") -> backends.Plan:
    """The backend the forward product of `recipe` runs on `device` (default JAX's first device), at trace time: an
    explicit ``recipe.gemm`` that cannot run raises (``ValueError`` for the recipe, :class:`jaxlowfp.backends.
    BackendUnavailableError` for the device); "auto" logs its choice once."""
    gemm, where = recipe.gemm, where or "qat"
    if gemm == "dequant":
        return backends.Plan(backend="dequant", native=False, reason="the fake-quant product (dequantized operands)")
    problem = _recipe_problem(recipe)
    if problem is not None:
        if gemm != "auto":
            raise ValueError(f"{where}: recipe {recipe.name!r} with gemm={gemm!r}: {problem}; use gemm='dequant' "
                             f"or 'auto'")
        return backends.plan(Format(kind="fp8"), None, "dequant", device=device, where=where)
    return backends.plan(_format(recipe.weight), _format(recipe.activation), gemm, device=device,  # type: ignore[arg-type]
                         where=where)


# What `check` hands `backends.plan` as the device: no real one. Its platform ("cpu") puts no requirement on the
# GEMM, so only the recipe and the formats are checked; the device is asked at the first call (`plan`, at trace time).
_NO_DEVICE = types.SimpleNamespace(platform="cpu", device_kind="no device (checked at the first call)")


def check(recipe: Recipe, *, where: str = "", grouped: bool = False) -> None:
    """Refuse a ``recipe.gemm`` that no GEMM can compute for this recipe's formats (``ValueError`` naming `where`),
    without tracing and without asking JAX for a device: what configuring a layer checks. Whether the device has
    that GEMM is decided at the first call (`plan` / `grouped_plan` at trace time). `grouped`: the experts' grouped
    GEMM (`grouped_plan`'s rules). "dequant" and "auto" always pass."""
    if recipe.gemm in ("dequant", "auto"):
        return
    (grouped_plan if grouped else plan)(recipe, device=_NO_DEVICE, where=where)


class Operands(NamedTuple):
    """What a backend's forward needs: the high-precision operands ``lhs [..., K]`` / ``rhs`` (stop-gradient'ed),
    their fake-quantized values, the amax estimates and the per-tensor dequant scales of the forward."""

    lhs: jax.Array
    rhs: jax.Array
    lhs_q: jax.Array
    rhs_q: jax.Array
    est_l: jax.Array | None
    est_r: jax.Array | None
    scale_l: jax.Array | None
    scale_r: jax.Array | None


def _codes_fp8(y: jax.Array, scale: jax.Array) -> jax.Array:
    # y = q * scale rounded once (float32 or bfloat16); y / scale is q to a relative 2^-8 at worst, which rounds
    # back to q in E4M3 (relative spacing 2^-3)
    return (y.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn)


def _block_quantize(x: jax.Array, spec: QuantSpec, est: jax.Array | None) -> Any:
    """The codes of ``x [R, K]`` (blocks along K) that `round_with` fake-quantized it to."""
    if spec.is_mx:
        return mx.quantize(x, format=MX_ELEMENTS[spec.format])  # type: ignore[arg-type]
    rule, block = two_level(spec)
    return nvfp4.quantize(x, rule=rule, block_shape=block,
                          global_amax=est if fixed_estimate(spec) else None, impl=spec.impl,
                          pallas_backend=spec.pallas_backend)


def forward(backend: str, recipe: Recipe, dn: tuple, ops: Operands, out_dtype: Any) -> jax.Array:
    """The forward product on `backend` ("fp8" or "scaled_matmul"), in `out_dtype`. scaled_matmul needs the linear
    layout ``lhs [..., K] . rhs [K, M]`` (every block-scaled recipe has it)."""
    if backend == "fp8":
        sx = ops.scale_l
        if per_token(recipe.activation):  # type: ignore[arg-type]  # each row's scale, as _quantize_per_token made it
            if dn != (((ops.lhs.ndim - 1,), (0,)), ((), ())):
                raise ValueError(f"per-token FP8 activations on the fp8 backend need the linear layout lhs [..., K] . "
                                 f"rhs [K, M]; got dimension_numbers {dn}")
            rows = ops.lhs.reshape(-1, ops.lhs.shape[-1])
            amax = abs_max(rows, axis=-1).astype(jnp.float32)
            sx = jax.vmap(recipe.activation.scaling.scale)(amax).reshape(*ops.lhs.shape[:-1], 1)  # type: ignore[union-attr]
        out = backends.fp8_product(_codes_fp8(ops.lhs_q, sx), sx,  # type: ignore[arg-type]
                                   _codes_fp8(ops.rhs_q, ops.scale_r), ops.scale_r, dn)  # type: ignore[arg-type]
        return out.astype(out_dtype)
    x2 = ops.lhs.reshape(-1, ops.lhs.shape[-1])
    wa = _block_quantize(ops.rhs.T, recipe.weight, ops.est_r)  # type: ignore[arg-type]  # W'^T [M, K]
    if per_token(recipe.activation):  # type: ignore[arg-type]  # each row with its own amax, as _quantize_per_token
        act_rule = two_level(recipe.activation)[0]  # type: ignore[arg-type]
        out = backends.block_scaled_rows(x2, wa, act_rule, abs_max(x2, axis=-1).astype(jnp.float32))
    else:
        out = backends.block_scaled_product(_block_quantize(x2, recipe.activation, ops.est_l), wa)  # type: ignore[arg-type]
    return out.reshape(*ops.lhs.shape[:-1], ops.rhs.shape[-1]).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _product(backend: str, recipe: Recipe, dn: tuple, dot: Any, out_dtype: Any, ops: Operands, a: jax.Array,
             b: jax.Array) -> jax.Array:
    return forward(backend, recipe, dn, ops, out_dtype)


def _product_fwd(backend, recipe, dn, dot, out_dtype, ops, a, b):
    return forward(backend, recipe, dn, ops, out_dtype), (ops, a, b)


def _product_bwd(backend, recipe, dn, dot, out_dtype, res, g):
    ops, a, b = res
    _, vjp = jax.vjp(dot, a, b)  # the fake-quant product's own backward
    da, db = vjp(g)
    return jax.tree.map(jnp.zeros_like, ops), da, db


_product.defvjp(_product_fwd, _product_bwd)


def product(backend: str, recipe: Recipe, dn: tuple, dot: Any, ops: Operands, a: jax.Array,
            b: jax.Array) -> jax.Array:
    """``dot(a, b)`` (the fake-quant product: `a` = x̂ and `b` = ŵ with their straight-through gradients) with its
    forward value computed on `backend` from `ops`; the backward is ``dot``'s. `dot` must be hashable (static)."""
    out_dtype = jax.eval_shape(dot, a, b).dtype
    return _product(backend, recipe, dn, dot, out_dtype, ops, a, b)


# ---- the experts' grouped GEMM (jaxlowfp.ops.ragged_dot): FP8 on lax.ragged_dot

def grouped_plan(recipe: Recipe, *, device: Any = None, where: str = "") -> backends.Plan:
    """The backend the experts' grouped product of `recipe` runs (`jaxlowfp.ops.ragged_dot`): "fp8" (``lax.ragged_dot``
    on E4M3 codes, per-row and per-expert scales on the output; XLA makes it a float8 GEMM on sm_89+) or "dequant".
    There is no grouped block-scaled GEMM: an explicit "scaled_matmul" is refused, "auto" takes dequant for it."""
    p = plan(recipe, device=device, where=where)
    if p.backend != "scaled_matmul":
        return p
    if recipe.gemm == "scaled_matmul":
        raise ValueError(f"{where or 'ragged_dot'}: recipe {recipe.name!r} asks for gemm='scaled_matmul'; the experts' "
                         f"grouped GEMM has no block-scaled form (jax.nn.scaled_matmul is not grouped): use "
                         f"gemm='dequant' or 'auto' for the experts")
    return backends.plan(Format(kind="fp8"), None, "dequant", device=device, where=where)


class GroupedOperands(NamedTuple):
    """The fake-quantized routed rows ``x̂ [M, K]`` and expert weights ``ŵ [G, K, N]`` with their dequant scales (one
    per row, one per expert), and ``gid [M]``, each row's expert."""

    x_q: jax.Array
    w_q: jax.Array
    scale_x: jax.Array
    scale_w: jax.Array
    gid: jax.Array


def _grouped_forward(ops: GroupedOperands, group_sizes: jax.Array, out_dtype: Any) -> jax.Array:
    qx = _codes_fp8(ops.x_q, ops.scale_x[:, None])
    qw = _codes_fp8(ops.w_q, ops.scale_w[:, None, None])
    out = lax.ragged_dot(qx, qw, group_sizes, preferred_element_type=jnp.float32)
    return (out * (ops.scale_x * ops.scale_w[ops.gid])[:, None]).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _grouped(dot: Any, out_dtype: Any, ops: GroupedOperands, a: jax.Array, b: jax.Array,
             group_sizes: jax.Array) -> jax.Array:
    return _grouped_forward(ops, group_sizes, out_dtype)


def _grouped_fwd(dot, out_dtype, ops, a, b, group_sizes):
    return _grouped_forward(ops, group_sizes, out_dtype), (ops, a, b, group_sizes)


def _grouped_bwd(dot, out_dtype, res, g):
    ops, a, b, group_sizes = res
    _, vjp = jax.vjp(lambda u, v: dot(u, v, group_sizes), a, b)  # the fake-quant grouped product's own backward
    da, db = vjp(g)
    return jax.tree.map(jnp.zeros_like, ops), da, db, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_product(dot: Any, ops: GroupedOperands, a: jax.Array, b: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``dot(a, b, group_sizes)`` (the fake-quant grouped product, ``a`` = x̂ and ``b`` = ŵ with their
    straight-through gradients) with its forward value on FP8 codes; the backward is ``dot``'s. `dot` hashable."""
    out_dtype = jax.eval_shape(dot, a, b, group_sizes).dtype
    return _grouped(dot, out_dtype, ops, a, b, group_sizes)
