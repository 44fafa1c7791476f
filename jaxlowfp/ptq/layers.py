"""The layers PTQ quantizes, seen as a GEMM: ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum``.

Each weight is quantized as a matrix ``W' [K, N]``: its contracted axes first (in the order the layer contracts
them), flattened to K, then its free axes flattened to N, so block scales run along the GEMM's reduction axis K as
for a Linear kernel ``[in, out]`` (the same view as `jaxlowfp.qat.contract`). The layer input is seen as
``x' [rows, K]`` (its contracted axes last, in the same order), which is what calibration records (Hessians
``x'^T x'``, amaxes per K channel) and what the activation quantizer blocks::

    nnx.Linear          kernel [in, out]                      W' = kernel
    nnx.LinearGeneral   kernel [*in_features, *out_features]  W' = reshape(kernel, [prod(in), prod(out)])
    nnx.Einsum          kernel of the rhs of "lhs,rhs->out"   W' = reshape(transpose(kernel, (*contracted, *free)))

Contractions with batch axes (a letter in the input, the kernel and the output, e.g. an expert axis) are not one
GEMM: PTQ refuses them with an error that names the layer.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxlowfp.qat.contract import parse_einsum

__all__ = ["LAYER_TYPES", "Layout", "layout", "quantizable_modules", "contracted_axes", "input_rows", "ActQuant",
           "EinsumActQuant", "act_quant", "hook_name", "default_hook", "is_act_quant", "require_linear"]

LAYER_TYPES = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)


class Layout(NamedTuple):
    """A weight as the GEMM matrix ``W' [k, n]``: ``perm`` takes the kernel's axes to (contracted..., free...)."""

    k: int
    n: int
    perm: tuple[int, ...]
    shape: tuple[int, ...]  # the kernel's shape

    def to_matrix(self, kernel: jax.Array) -> jax.Array:
        w = kernel if self.perm == tuple(range(kernel.ndim)) else jnp.transpose(kernel, self.perm)
        return w if w.shape == (self.k, self.n) else jnp.reshape(w, (self.k, self.n))

    def from_matrix(self, w: jax.Array) -> jax.Array:
        permuted = tuple(self.shape[i] for i in self.perm)
        w = w if w.shape == permuted else jnp.reshape(w, permuted)
        return w if self.perm == tuple(range(len(self.perm))) else jnp.transpose(w, np.argsort(self.perm))


class _Shape(NamedTuple):  # an operand for parse_einsum, which reads only shapes
    shape: tuple[int, ...]


def quantizable_modules(model: nnx.Module) -> dict[str, nnx.Module]:
    """Every ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` (subclasses included) by "/"-joined graph
    path, in graph order."""
    return {"/".join(map(str, p)): m for p, m in nnx.iter_graph(model) if isinstance(m, LAYER_TYPES)}


def _einsum_spec(mod: nnx.Einsum, where: str) -> str:
    spec = getattr(mod, "einsum_str", None)
    if not isinstance(spec, str):
        raise ValueError(f"{where}: this nnx.Einsum takes its equation at call time (einsum_str=None); PTQ needs it "
                         f"fixed at construction to know the kernel's contraction axes")
    return spec.replace(" ", "")


def layout(mod: nnx.Module, where: str) -> Layout:
    """The GEMM view of `mod`'s kernel (module docstring); a ValueError for a contraction PTQ cannot quantize."""
    shape = tuple(int(d) for d in mod.kernel.shape)
    if isinstance(mod, nnx.Linear):
        return Layout(shape[0], shape[1], (0, 1), shape)
    if isinstance(mod, nnx.LinearGeneral):
        if mod.batch_axis:
            raise ValueError(f"{where}: an nnx.LinearGeneral with batch_axis={dict(mod.batch_axis)} is a batched "
                             f"contraction, not one GEMM; PTQ cannot quantize it (keep it with scheme=None)")
        n_in = len(mod.in_features)
        return Layout(math.prod(shape[:n_in]), math.prod(shape[n_in:]), tuple(range(len(shape))), shape)
    if isinstance(mod, nnx.Einsum):
        spec = _einsum_spec(mod, where)
        lhs_spec, rest = spec.split(",", 1)
        rhs_spec = rest.split("->", 1)[0]
        if "." in rhs_spec:
            raise ValueError(f"{where}: the kernel's part of the einsum {spec!r} has an ellipsis; PTQ needs its axes")
        lhs_ndim = len(lhs_spec.replace("...", "")) + (1 if "..." in lhs_spec else 0)
        e = parse_einsum(spec, _Shape((1,) * lhs_ndim), _Shape(shape))
        (_, rc), (_, rb) = e.dimension_numbers
        if rb:
            raise ValueError(f"{where}: the einsum {spec!r} has batch axes (letters in the input, the kernel and "
                             f"the output); that is not one GEMM, so PTQ cannot quantize it (keep it with "
                             f"scheme=None)")
        free = tuple(i for i in range(len(shape)) if i not in rc)
        return Layout(math.prod(shape[i] for i in rc), math.prod(shape[i] for i in free), (*rc, *free), shape)
    raise TypeError(f"{where}: a {type(mod).__name__} is not a layer PTQ quantizes (nnx.Linear, nnx.LinearGeneral, "
                    f"nnx.Einsum)")


def hook_name(mod: nnx.Module) -> str:
    """The attribute through which `mod` computes its contraction (``dot_general``, or ``einsum_op``)."""
    return "einsum_op" if isinstance(mod, nnx.Einsum) else "dot_general"


def default_hook(mod: nnx.Module) -> Any:
    """The hook of an unquantized `mod` (an ``nnx.LinearGeneral`` may also hold None, which means the same)."""
    return jnp.einsum if isinstance(mod, nnx.Einsum) else lax.dot_general


def contracted_axes(lhs: Any, dimension_numbers: Any = None, *, spec: str | None = None, rhs: Any = None
                    ) -> tuple[int, ...]:
    """The axes of `lhs` a contraction sums over, from its dimension numbers or from an einsum `spec` with the
    kernel `rhs` (in the order that pairs them with the kernel's axes of `Layout`)."""
    if spec is not None:
        dimension_numbers = parse_einsum(spec, lhs, rhs).dimension_numbers
    (lc, _), _ = dimension_numbers
    return tuple(int(a) % len(lhs.shape) for a in lc)


def input_rows(lhs: jax.Array, contracted: tuple[int, ...]) -> jax.Array:
    """The layer input as ``x' [rows, K]``: the `contracted` axes last, in that order (the view that matches
    `Layout.to_matrix`), the others flattened into rows."""
    x, _ = _contracted_last(lhs, contracted)
    return x.reshape(-1, math.prod(lhs.shape[i] for i in contracted))


def _contracted_last(lhs: jax.Array, contracted: tuple[int, ...]) -> tuple[jax.Array, tuple[int, ...]]:
    """(`lhs` with the `contracted` axes moved last, in that order; the permutation applied)."""
    perm = (*(i for i in range(lhs.ndim) if i not in contracted), *contracted)
    return (lhs if perm == tuple(range(lhs.ndim)) else jnp.transpose(lhs, perm)), perm


def _quantize_input(fmt: Any, lhs: jax.Array, contracted: tuple[int, ...]) -> jax.Array:
    """Fake-quantize `lhs` with its blocks along the flattened contracted axes (per-tensor formats ignore the
    layout; a Linear's input [..., K] is quantized as it is)."""
    if contracted == (lhs.ndim - 1,):
        return fmt.fake_quantize(lhs)
    xt, perm = _contracted_last(lhs, contracted)
    n_free = lhs.ndim - len(contracted)
    q = fmt.fake_quantize(xt.reshape(*xt.shape[:n_free], -1)).reshape(xt.shape)
    return jnp.transpose(q, np.argsort(perm))


@dataclasses.dataclass(frozen=True)
class ActQuant:
    """The ``dot_general`` of a PTQ'd ``nnx.Linear`` or ``nnx.LinearGeneral``: fake-quantizes the input with its
    current per-tensor amax (blocks along the contracted axes), then the plain ``lax.dot_general`` (the kernel
    already holds the quantized weights). Hashable, so models with the same formats share compiled code."""

    fmt: Any

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
        return lax.dot_general(_quantize_input(self.fmt, lhs, contracted_axes(lhs, dimension_numbers)), rhs,
                               dimension_numbers,
                               precision=precision, preferred_element_type=preferred_element_type, **kw)


@dataclasses.dataclass(frozen=True)
class EinsumActQuant:
    """The ``einsum_op`` of a PTQ'd ``nnx.Einsum``: `ActQuant` for an einsum (the input is the first operand)."""

    fmt: Any

    def __call__(self, spec, lhs, rhs, **kw):
        return jnp.einsum(spec, _quantize_input(self.fmt, lhs, contracted_axes(lhs, spec=spec, rhs=rhs)), rhs, **kw)


def act_quant(mod: nnx.Module, fmt: Any) -> ActQuant | EinsumActQuant:
    """The run-time activation quantizer for `mod`'s hook."""
    return EinsumActQuant(fmt) if isinstance(mod, nnx.Einsum) else ActQuant(fmt)


def require_linear(model: nnx.Module, paths: Any, what: str) -> None:
    """A ValueError if a layer at `paths` is not an ``nnx.Linear``: what `what` (a file format) stores."""
    mods = quantizable_modules(model)
    general = [p for p in paths if p in mods and not isinstance(mods[p], nnx.Linear)]
    if general:
        raise ValueError(f"{what} stores nnx.Linear weights ([out, in] matrices, as serving engines load them); "
                         f"{', '.join(f'{p} ({type(mods[p]).__name__})' for p in general[:3])} are not. Quantize "
                         f"them without exporting, or rewrite them as nnx.Linear")


def is_act_quant(hook: Any) -> bool:
    return isinstance(hook, (ActQuant, EinsumActQuant))
