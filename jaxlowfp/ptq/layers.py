"""The layers PTQ quantizes, seen as a GEMM: ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum``.

Each weight is quantized as a matrix ``W' [K, N]``: its contracted axes first (in the order the layer contracts
them), flattened to K, then its free axes flattened to N, so block scales run along the GEMM's reduction axis K as
for a Linear kernel ``[in, out]`` (the same view as `jaxlowfp.ops`). The layer input is seen as
``x' [rows, K]`` (its contracted axes last, in the same order), which is what calibration records (Hessians
``x'^T x'``, amaxes per K channel) and what the activation quantizer blocks::

    nnx.Linear          kernel [in, out]                      W' = kernel
    nnx.LinearGeneral   kernel [*in_features, *out_features]  W' = reshape(kernel, [prod(in), prod(out)])
    nnx.Einsum          kernel of the rhs of "lhs,rhs->out"   W' = reshape(transpose(kernel, (*contracted, *free)))

Contractions with batch axes (a letter in the input, the kernel and the output, e.g. an expert axis) are not one
GEMM: PTQ refuses them with an error that names the layer.

The run-time activation quantizers (`ActQuant`, `EinsumActQuant`) are small ``nnx.Module`` s installed as the
layer's hook (`install`): a module assigned to ``layer.dot_general`` is a graph child, so the execution record it
owns (`jaxlowfp.execution.ExecutionRecord`) is state that ``nnx.split`` / ``nnx.merge``, ``nnx.jit`` and
``jax.jit`` over split state carry, while its format, scale mode, calibrated amax and path are static and equal for
identically quantized models (one trace for both). A frozen-dataclass hook would be static as a whole: it could
hold the record only as a process-unique key, which kept identical models from sharing a trace.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxlowfp import ops
from jaxlowfp._core.executed import new_record
from jaxlowfp.ops import parse_einsum
from jaxlowfp.ptq.formats import activation_spec
from jaxlowfp.qat.spec import Recipe, RecipeState
from jaxlowfp.scaling import StaticScaling

__all__ = ["LAYER_TYPES", "Layout", "layout", "quantizable_modules", "contracted_axes", "input_rows", "ActQuantBase",
           "ActQuant", "EinsumActQuant", "act_quant", "install", "hook_name", "default_hook", "is_act_quant",
           "require_linear"]

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
        return w if self.perm == tuple(range(len(self.perm))) else jnp.transpose(
            w, cast(Sequence[int], np.argsort(self.perm)))


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
    shape = tuple(int(d) for d in cast(Any, mod).kernel.shape)  # every LAYER_TYPES module has a kernel
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


class Calibration(nnx.Variable):
    """A calibrated quantity of a PTQ'd layer (state, never trained): `ActQuantBase`'s static input amax."""


class ActQuantBase(nnx.Module):
    """What every run-time activation quantizer of a PTQ'd layer holds (`ActQuant`, `EinsumActQuant`,
    `jaxlowfp.ptq.experts.RaggedActQuant`): static `fmt`, `activation_scale` and `path`, the calibrated `amax`
    (``activation_scale="static"``), the layer's activation-only `recipe` (its weight is quantized offline, in the
    kernel) and, as state, its execution record (`record`). `op_key`: deprecated, ignored.

    One calibrated amax is state (`calibration`, a :class:`Calibration` holding the spec's scale state,
    ``StaticScaling(amax=None).calibrated(amax)``), not a static attribute: blocks calibrated to different amaxes
    then have one graphdef and share one compiled program, as with per-token scales. One amax per expert (a tuple,
    `RaggedActQuant`) stays in the spec."""

    _amax_in_state = True

    def __init__(self, fmt: Any, activation_scale: str = "tensor", amax: Any = None, path: str = "",
                 op_key: str | None = None):
        self.fmt = fmt
        self.activation_scale = activation_scale
        self.path = path
        spec = activation_spec(fmt, activation_scale, amax)
        calibration = None
        if (self._amax_in_state and isinstance(spec.scaling, StaticScaling)
                and not isinstance(spec.scaling.amax, tuple)):
            scaling = dataclasses.replace(spec.scaling, amax=None)
            calibration = Calibration(scaling.calibrated(float(amax)))
            spec = dataclasses.replace(spec, scaling=scaling)
        self._static_amax = None if calibration is not None else amax
        self.calibration: Calibration | None = nnx.data(calibration)
        self.recipe = Recipe(activation=spec, name=fmt.name)
        self.record = new_record()

    @property
    def amax(self) -> Any:
        """The calibrated input amax (a float; a tuple, one per expert), None without static scaling."""
        if self.calibration is None:
            return self._static_amax
        est = self.calibration.get_value().estimate
        return est if isinstance(est, jax.core.Tracer) else float(est)

    def recipe_state(self) -> RecipeState | None:
        """The recipe state of a call: the calibrated amax, or None (a stateless call: current scaling)."""
        if self.calibration is None:
            return None
        return cast(RecipeState, self.recipe.init())._replace(activation=self.calibration.get_value())

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(fmt={self.fmt!r}, activation_scale={self.activation_scale!r}, "
                f"amax={self.amax!r}, path={self.path!r})")


class ActQuant(ActQuantBase):
    """The ``dot_general`` of a PTQ'd ``nnx.Linear`` or ``nnx.LinearGeneral``: the one op layer
    (`jaxlowfp.ops.dot_general`) with the input fake-quantized by `fmt` (blocks along the contracted axes) and the
    kernel as it is (it already holds the quantized weights).

    activation_scale: where the input's amax comes from: "tensor" (the whole input, i.e. the batch), "token"
      (each token's own: a score never depends on its batch) or "static" (`amax`, calibrated: vLLM's static input
      scale). `path` names the layer in errors and reports.

    An ``nnx.Module``, so that it can own state: `record` (a `jaxlowfp.execution.ExecutionRecord`), written by
    each call, is what `jaxlowfp.execution` reads to tell "configured" from "executed". Assigned to the layer's
    ``dot_general`` (or ``einsum_op``) with `install` (``nnx.data``: the attribute held a function), it is a graph
    child of the layer: its record is part of ``nnx.state(model)`` and leaves ``nnx.jit`` with the rest of the
    state, as is a calibrated amax, while `fmt`, `activation_scale` and `path` are static. So the graphdef holds nothing
    process-specific, and two identically quantized models share compiled code. (A frozen dataclass, as before,
    is static: it could not hold a runtime value.) `op_key`: deprecated, ignored."""

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None,
                 **kw):
        _no_extras(self.path, out_sharding, kw)
        return ops.dot_general(lhs, rhs, dimension_numbers, recipe=self.recipe, state=self.recipe_state(),
                               precision=precision,
                               preferred_element_type=preferred_element_type, where=self.path or "ActQuant",
                               record=self.record)[0]


class EinsumActQuant(ActQuant):
    """The ``einsum_op`` of a PTQ'd ``nnx.Einsum``: `ActQuant` for an einsum (the input is the first operand),
    `jaxlowfp.ops.einsum`."""

    # an einsum_op's signature, not a dot_general's: the hooks are installed on different attributes
    def __call__(  # type: ignore[override]
            self, spec, lhs, rhs, precision=None, preferred_element_type=None, out_sharding=None, **kw):
        _no_extras(self.path, out_sharding, kw)
        return ops.einsum(spec, lhs, rhs, recipe=self.recipe, state=self.recipe_state(), precision=precision,
                          preferred_element_type=preferred_element_type, where=self.path or "EinsumActQuant",
                          record=self.record)[0]


def _no_extras(where: str, out_sharding: Any, kw: dict) -> None:
    if out_sharding is not None or kw:
        raise NotImplementedError(f"{where or 'ActQuant'}: the quantized contraction takes no "
                                  f"{'out_sharding' if out_sharding is not None else sorted(kw)}; shard the inputs "
                                  f"and parameters instead")


def act_quant(mod: nnx.Module, fmt: Any, *, activation_scale: str = "tensor", amax: float | None = None,
              path: str = "") -> ActQuant:
    """The run-time activation quantizer for `mod`'s hook (not executed yet)."""
    cls = EinsumActQuant if isinstance(mod, nnx.Einsum) else ActQuant
    return cls(fmt, activation_scale, amax, path)


def install(mod: nnx.Module, hook: Any) -> None:
    """Set `mod`'s hook (``dot_general`` / ``einsum_op``) to `hook`, either way: an `ActQuant` (an ``nnx.Module``)
    with ``nnx.data`` (the attribute held a function, static: the module becomes a graph child, its record state),
    a function (``lax.dot_general``, to swap a quantizer out) with ``nnx.static`` (a plain assignment would keep the
    attribute's data status, and ``nnx.split`` would then meet a function as an array leaf)."""
    setattr(mod, hook_name(mod), nnx.data(hook) if isinstance(hook, nnx.Module) else nnx.static(hook))


def require_linear(model: nnx.Module, paths: Any, what: str) -> None:
    """A ValueError if a layer at `paths` is not an ``nnx.Linear`` (or a `jaxlowfp.ptq.PackedLinear`, one stored
    packed), or is not in `model` at all: what `what` (a file format) stores."""
    from jaxlowfp.packed_layer import PackedLinear

    mods = quantizable_modules(model)
    packed = {"/".join(map(str, p)) for p, m in nnx.iter_graph(model) if isinstance(m, PackedLinear)}
    absent = [p for p in paths if p not in mods and p not in packed]
    if absent:
        raise ValueError(f"{what}: the quantized layers {absent[:3]}{' ...' if len(absent) > 3 else ''} are not in "
                         f"this model (no nnx.Linear, LinearGeneral, Einsum or PackedLinear at those paths; is this "
                         f"the model the PTQ result came from?)")
    general = [p for p in paths if p in mods and not isinstance(mods[p], nnx.Linear)]
    if general:
        raise ValueError(f"{what} stores nnx.Linear weights ([out, in] matrices, as serving engines load them); "
                         f"{', '.join(f'{p} ({type(mods[p]).__name__})' for p in general[:3])} are not. Quantize "
                         f"them without exporting, or rewrite them as nnx.Linear")


def is_act_quant(hook: Any) -> bool:
    return isinstance(hook, (ActQuant, EinsumActQuant))
