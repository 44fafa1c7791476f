"""Calibration: statistics of the inputs of chosen layers (``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``),
from a few batches of real data.

Each batch runs the whole model once under ``jax.jit``; inside the trace every target layer's ``dot_general`` (an
Einsum's ``einsum_op``) is swapped for a recorder that hands its input, as ``x' [rows, K]`` (`jaxlowfp.ptq.layers`),
to a reduction, so what leaves the forward pass is per-layer statistics, never the activations themselves::

    hessian   Σ x x^T over tokens                 [in, in]   (GPTQ: H = 2/n Σ x x^T)
    amax      max |x_j| over tokens                [in]       (SmoothQuant; the exported activation global scale)
    abs_sum   Σ |x_j| over tokens                  [in]       (AWQ: mean |x_j|)
    samples   evenly spaced token rows of x        [k, in]    (AWQ's scale search)
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxlowfp._core.placement import commit_tree
from jaxlowfp._core.progress import progress_bar
from jaxlowfp.sharding import to_host
from jaxlowfp.ptq.layers import contracted_axes, hook_name, input_rows, quantizable_modules

_HI = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """Input statistics of one layer (numpy, float32 sums; see the module docstring). `tokens`: rows seen."""

    tokens: int
    amax: np.ndarray
    abs_sum: np.ndarray
    hessian: np.ndarray | None = None
    samples: np.ndarray | None = None

    @property
    def abs_mean(self) -> np.ndarray:
        return self.abs_sum / max(self.tokens, 1)

    def gptq_hessian(self) -> np.ndarray:
        """H = 2/n Σ x x^T."""
        if self.hessian is None:
            raise ValueError("these statistics were collected without the Hessian")
        return self.hessian * np.float32(2.0 / max(self.tokens, 1))


@dataclasses.dataclass(frozen=True, eq=False)
class _Recorder:
    """A `dot_general` that records its lhs (the layer input) and its contracted axes into `sink` while tracing."""

    path: str
    sink: dict

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
        self.sink[self.path] = (lhs, contracted_axes(lhs, dimension_numbers))
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kw)


@dataclasses.dataclass(frozen=True, eq=False)
class _EinsumRecorder:
    """The `_Recorder` of an ``nnx.Einsum`` (its ``einsum_op``)."""

    path: str
    sink: dict

    def __call__(self, spec, lhs, rhs, **kw):
        self.sink[self.path] = (lhs, contracted_axes(lhs, spec=spec, rhs=rhs))
        return jnp.einsum(spec, lhs, rhs, **kw)


def linear_modules(model: nnx.Module) -> dict[str, nnx.Linear]:
    """Every ``nnx.Linear`` (subclasses included) by "/"-joined graph path, in graph order."""
    return {"/".join(map(str, p)): m for p, m in nnx.iter_graph(model) if isinstance(m, nnx.Linear)}


def default_forward(model: nnx.Module, batch: jax.Array) -> Any:
    return model(batch)


def collect(model: nnx.Module, paths: Sequence[str], batches: Iterable[Any], *,
            forward: Callable[[nnx.Module, Any], Any] = default_forward, hessian: bool = False,
            samples_per_batch: int = 0, progress: bool = False) -> dict[str, LayerStats]:
    """`LayerStats` of the inputs of the Linear layers at `paths`, over `batches` (each passed to `forward`).

    The jitted step is keyed by the module's graph definition, `paths` and `forward`, so the identical blocks of a
    model (`jaxlowfp.ptq.sequential`) share one compilation."""
    paths = tuple(paths)
    graphdef, state = nnx.split(model)
    total: dict[str, dict[str, Any]] = {}
    bar = progress_bar(batches, desc="calibrate", enabled=progress)
    for batch in bar:
        # committed where the model is (`placement.commit_tree`), so every block of a structure and every batch
        # run one compiled step, whichever of their arrays came uncommitted
        state, batch = commit_tree((state, batch))
        # the statistics, reduced on the devices (a sharded batch: by XLA's collectives), to the host; on a mesh
        # spanning processes every process takes the whole reduced value (`sharding.to_host`, a collective)
        res = jax.tree.map(to_host, _step(graphdef, state, batch, paths, forward, hessian, samples_per_batch))
        for p, st in res.items():
            acc = total.setdefault(p, {"tokens": 0, "amax": None, "abs_sum": None, "hessian": None, "samples": []})
            acc["tokens"] += int(st["tokens"])
            acc["amax"] = st["amax"] if acc["amax"] is None else np.maximum(acc["amax"], st["amax"])
            acc["abs_sum"] = st["abs_sum"] if acc["abs_sum"] is None else acc["abs_sum"] + st["abs_sum"]
            if hessian:
                acc["hessian"] = st["hessian"] if acc["hessian"] is None else acc["hessian"] + st["hessian"]
            if samples_per_batch:
                acc["samples"].append(st["samples"])
            del st
        del res
    if not total:
        raise ValueError("calibration: no batches were given")
    return {p: LayerStats(tokens=a["tokens"], amax=np.asarray(a["amax"]), abs_sum=np.asarray(a["abs_sum"]),
                          hessian=a["hessian"],
                          samples=np.concatenate(a["samples"]) if a["samples"] else None)
            for p, a in total.items()}


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5, 6))
def _step(graphdef, state, batch, paths: tuple[str, ...], forward, hessian: bool, samples_per_batch: int):
    """One calibration batch: the statistics of every layer at `paths` (numpy-ready dicts)."""
    m = nnx.merge(graphdef, state)
    sink: dict[str, tuple[jax.Array, tuple[int, ...]]] = {}  # path -> (layer input, contracted axes)
    mods = quantizable_modules(m)
    for p in paths:
        if p not in mods:
            raise ValueError(f"calibration: no nnx.Linear, nnx.LinearGeneral or nnx.Einsum at {p!r}")
        recorder = _EinsumRecorder if hook_name(mods[p]) == "einsum_op" else _Recorder
        setattr(mods[p], hook_name(mods[p]), recorder(p, sink))
    forward(m, batch)
    out: dict[str, Any] = {}
    done: dict[tuple[int, Any], Any] = {}
    for p in paths:
        if p not in sink:
            raise ValueError(f"calibration: layer {p!r} was not called by the forward pass")
        lhs, axes = sink[p]
        key = (id(lhs), axes)
        if key in done:  # layers fed the very same array (q/k/v, gate/up): reduce it once
            out[p] = done[key]
            continue
        x = input_rows(lhs, axes).astype(jnp.float32)
        a = jnp.abs(x)
        # NaN kept: XLA:CPU's max reduction drops a NaN operand, so a NaN input would leave a finite amax
        amax = jnp.where(jnp.any(jnp.isnan(x), axis=0), jnp.nan, jnp.max(a, axis=0))
        st = {"amax": amax, "abs_sum": jnp.sum(a, axis=0), "tokens": jnp.int32(x.shape[0])}
        if hessian:
            st["hessian"] = jnp.matmul(x.T, x, precision=_HI)
        if samples_per_batch:
            k = min(samples_per_batch, x.shape[0])
            st["samples"] = x[np.linspace(0, x.shape[0] - 1, k).round().astype(np.int32)]
        out[p] = done[key] = st
    return out
