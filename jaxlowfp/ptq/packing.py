"""`pack(model, result)`: turn a PTQ'd model into one whose quantized layers hold packed low-precision arrays.

Each quantized ``nnx.Linear`` is replaced, in place, by a :class:`PackedLinear` whose ``kernel`` is a
`jaxlowfp.packed.PackedParam` (codes and scales of ``kernel.T``, `jaxlowfp.packed`) instead of the float kernel:
the float kernel is dropped, not kept alongside, so the model's memory is the format's. Its forward is
`jaxlowfp.backends.packed_dot_general` (backend "auto" by default: the device's low-precision GEMM where there is
one, else dequantize + dot), with the activations quantized at run time exactly as the PTQ'd layer's `ActQuant`
does. Module paths and state paths stay as they were (``blocks/0/mlp/up_proj/kernel``). A quantized
``nnx.LinearGeneral`` or ``nnx.Einsum`` keeps its module and gets a :class:`PackedKernel` (its ``W'`` packed, read by
the layer's own code as the decoded kernel: the "dequant" backend). A quantized mixture-of-experts weight
(``blocks/<i>/mlp/experts/gate_proj``, [E, K, N]) becomes a :class:`PackedExperts`: every expert's ``W'_e`` packed,
stacked along a leading expert axis, decoded inside the forward for the experts module's own grouped GEMM
(``jax.lax.ragged_dot`` through its activation quantizer, as PTQ left it): the "dequant" backend too.

Where the codes come from:
  - NVFP4: ``result.packed`` (the arrays PTQ made, in its convention); nothing is requantized.
  - the other formats (MXFP4, HiF8, IF4): the PTQ'd kernel holds dequantized values, which are packed again and
    accepted only if they decode to the kernel bit for bit (the float32 scale PTQ used is not kept, so it is searched
    among the few float32 neighbours of the one the kernel implies: HiF8's ``max|w| / 15``, IF4's tensor amax);
    otherwise a clear error.
Either way every packed layer is checked: its weights dequantize to the fake-quant model's kernel bit for bit.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlowfp._core.deprecation import renamed_kwarg
from jaxlowfp import backends, packed, sharding
from jaxlowfp._core.placement import commit_state
from jaxlowfp._core.qarray import QArray
from jaxlowfp.packed_layer import PackedLinear, replace_modules
from jaxlowfp.ptq.api import PTQResult
from jaxlowfp.ptq.layers import ActQuant, layout, quantizable_modules
from jaxlowfp.rules import grouped_weights

__all__ = ["PackedLinear", "PackedKernel", "PackedExperts", "PackReport", "pack", "packed_layers", "replace_modules",
           "report_of"]


@dataclasses.dataclass(frozen=True)
class PackReport:
    """What `pack` did.

    layers: (path, format name, backend, native) per packed layer (the backend each runs on the device it was
      packed for; native: the device's own low-precision GEMM, not an emulation or a dequantize + dot)
    params: quantized parameters packed
    float_bytes: bytes of the float kernels removed
    packed_bytes: bytes of the packed arrays that replace them (codes, block scales, global scales)
    """

    layers: tuple[tuple[str, str, str, bool], ...]
    params: int
    float_bytes: int
    packed_bytes: int

    @property
    def bits_per_param(self) -> float:
        """Bits per quantized parameter in memory, every scale included."""
        return 8.0 * self.packed_bytes / self.params if self.params else 0.0


def packed_layers(model: nnx.Module) -> dict[str, PackedLinear]:
    """Every :class:`PackedLinear` of `model` by "/"-joined graph path."""
    return {"/".join(map(str, p)): m for p, m in nnx.iter_graph(model) if isinstance(m, PackedLinear)}


def _near(v: np.float32, ulps: int = 4) -> list[np.float32]:
    """`v` and the float32 values up to `ulps` steps either side, nearest first."""
    up, down, out = v, v, [v]
    for _ in range(ulps):
        up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(0))
        out += [up, down]
    return out


@functools.partial(jax.jit, static_argnames=("kind",))
def _per_tensor_try(wt: jax.Array, scale: jax.Array, kind: str) -> tuple[QArray, jax.Array]:
    """(the codes of wt with the per-tensor `scale`, whether they decode to wt everywhere)."""
    arr = packed.scaled_quantize(wt, kind, scale=scale)
    return arr, jnp.all(arr.dequantize(jnp.float32) == wt)


def _placed(w: packed.PackedWeight, kernel: jax.Array, where: str) -> packed.PackedWeight:
    """`w` (packed from `kernel`, an nnx.Linear's ``W' [K, N]`` or experts' ``[E, K, N]``) placed as `kernel` is
    on its mesh (`jaxlowfp.sharding.packed_shardings`: whole blocks with their scales on each device, a K or N axis
    that would split them dropped); as it is when `kernel` is not on a mesh."""
    sh = getattr(kernel, "sharding", None)
    if not isinstance(sh, jax.sharding.NamedSharding) or sh.mesh.size == 1:
        return w
    spec = tuple(sh.spec) + (None,) * (kernel.ndim - len(tuple(sh.spec)))
    mesh = cast(jax.sharding.Mesh, sh.mesh)
    lead, (k_ax, n_ax) = spec[:-2], spec[-2:]
    # an axis that would split a block from its scale (K / 16 scales over 2 devices with K = 16) is dropped from
    # the packed placement: that dimension is replicated instead (placement only; the values are the same)
    for cand in ((k_ax, n_ax), (None, n_ax), (k_ax, None), (None, None)):
        try:
            return jax.device_put(w, sharding.packed_shardings(w, (*lead, *cand), mesh, where=where))
        except sharding.ShardingError:
            continue
    return w


def requantized(kernel: jax.Array, fmt: Any, where: str) -> packed.PackedWeight:
    """The packed arrays that decode to a PTQ'd `kernel` [K, N] bit for bit (its values are already on the format's
    grid; what is not kept is the float32 scale they were made with, so it is searched among its float32
    neighbours: HiF8's s near ``max|w| / 15``, FP8's near ``max|w| / 448``, IF4's tensor amax near ``max|w|``;
    MX's E8M0 scales come back exactly)."""
    w = jnp.asarray(kernel, jnp.float32)
    top = np.float32(jnp.max(jnp.abs(w)))
    if not np.isfinite(top) or top == 0:
        raise ValueError(f"{where}: a {fmt.name} kernel with max |w| = {top} cannot be packed")
    if fmt.kind in packed.PER_TENSOR:  # x̂ = q s with q = target at the max: s within ulps of max|x̂| / target
        for s in _near(np.float32(top / np.float32(packed.PER_TENSOR[fmt.kind][1]))):
            arr, ok = _per_tensor_try(w.T, jnp.float32(s), fmt.kind)
            if bool(ok):
                return packed.PackedWeight(array=arr, s_enc=None, format=packed.Format(kind=fmt.kind),
                                           k=int(w.shape[0]), n=int(w.shape[1]))
    else:
        for amax in _near(top) if fmt.kind == "if4" else [None]:
            p = packed.pack(w, fmt, global_amax=amax, where=where)
            if bool(jnp.all(p.dequantize(jnp.float32) == w)):
                return p
    raise ValueError(f"{where}: no {fmt.name} arrays near this kernel's scale reproduce it bit for bit (was the "
                     f"model changed after ptq.quantize, or is this another model's result?)")


class PackedKernel(packed.PackedParam):
    """The packed kernel of an ``nnx.LinearGeneral`` or ``nnx.Einsum`` (`pack`): a `PackedParam` of the GEMM matrix
    ``W'`` (`jaxlowfp.ptq.layers.Layout`) that the layer's own code reads as its kernel: ``kernel[...]`` decodes the
    codes to float32, rounds once to ``kernel_dtype`` (the dtype the float kernel was stored in) and lays ``W'`` out
    as the kernel (``kernel_layout.from_matrix``), inside the forward. So these layers run the "dequant" backend
    with their own hooks (the PTQ activation quantizer included); only the storage is packed."""

    def __getitem__(self, key: Any) -> jax.Array:
        w = self.get_value()
        return self.kernel_layout.from_matrix(w.dequantize(jnp.float32).astype(self.kernel_dtype))[key]


class PackedExperts(packed.PackedParam):
    """The packed weight ``[E, K, N]`` of a mixture-of-experts module (`pack`): a `PackedParam` whose value is the
    E experts' `PackedWeight` of ``W'_e [K, N]`` stacked along a leading expert axis (every leaf ``[E, ...]``).
    ``weight[...]`` decodes each expert to float32 (``jax.vmap`` of `PackedWeight.dequantize`), rounds once to
    ``kernel_dtype`` and gives ``[E, K, N]``, inside the forward, so the experts module's grouped GEMM and its
    activation quantizer run as before; only the storage is packed (the "dequant" backend)."""

    def __getitem__(self, key: Any) -> jax.Array:
        return self._decode(self.get_value())[key]

    def _decode(self, w: packed.PackedWeight) -> jax.Array:
        return jax.vmap(lambda x: x.dequantize(jnp.float32))(w).astype(self.kernel_dtype)

    def decode_after(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(x, weight[...])`` with the decode made to depend on `x` (`jaxlowfp.backends.after_input`), so the
        experts' float weight exists only from their input on, not from the start of the program: what the experts'
        forward (`jaxlowfp.models.moe.Experts.grouped_matmul`) reads."""
        x, w = backends.after_input(x, self.get_value())
        return x, self._decode(w)

    @property
    def shape(self) -> tuple[int, int, int]:
        w = self.get_value()
        return (int(jax.tree.leaves(w)[0].shape[0]), w.k, w.n)

    @classmethod
    def stack(cls, weights: Sequence[packed.PackedWeight], *, kernel_dtype: Any) -> PackedExperts:
        """The experts' `PackedWeight`s (one format and shape) stacked along a leading expert axis."""
        return cls(jax.tree.map(lambda *xs: jnp.stack(xs), *weights), kernel_dtype=jnp.dtype(kernel_dtype))


def _expert_weights(path: str, kernel: jax.Array, result: PTQResult) -> list[packed.PackedWeight]:
    """The packed arrays of each expert of weight `path`, each checked to decode to the PTQ'd `kernel` [E, K, N]
    bit for bit."""
    res = result.experts[path]
    fmt = res.scheme.weight if res.scheme is not None else None
    if fmt is None:
        raise ValueError(f"{path}: the PTQ result records no scheme for this expert weight")
    out = []
    for e in range(int(kernel.shape[0])):
        where = f"{path}[expert {e}]"
        if fmt.kind == "nvfp4":
            if e >= len(res.packed):
                raise ValueError(f"{where}: the PTQ result has no packed NVFP4 arrays for this expert")
            arr, s_enc = res.packed[e]
            w = packed.from_nvfp4(arr, s_enc)  # experts are quantized in jaxlowfp's arithmetic (ptq.experts)
        else:
            w = requantized(kernel[e], fmt, where)
        if w.shape != tuple(kernel.shape[1:]) or not bool(jnp.all(w.dequantize(jnp.float32).astype(kernel.dtype)
                                                                  == kernel[e])):
            raise ValueError(f"{where}: the {w.format.name} arrays do not decode to the model's expert weight bit for "
                             f"bit (was the model changed after ptq.quantize, or is this another model's result?)")
        out.append(w)
    return out


def _weight(path: str, mod: nnx.Module, result: PTQResult) -> packed.PackedWeight:
    fmt = result.schemes[path].weight
    lay = layout(mod, path)
    kernel = lay.to_matrix(mod.kernel[...])  # type: ignore[attr-defined]
    if fmt.kind == "nvfp4":
        if path not in result.packed:
            raise ValueError(f"{path}: the PTQ result has no packed NVFP4 arrays for this layer")
        arr, s_enc = result.packed[path]
        w = packed.from_nvfp4(arr, s_enc, arithmetic=result.arithmetic)
    else:
        w = requantized(kernel, fmt, path)
    if w.shape != tuple(kernel.shape):
        raise ValueError(f"{path}: packed arrays of W' {w.shape} do not fit the kernel {tuple(kernel.shape)}")
    if not bool(jnp.all(w.dequantize(jnp.float32).astype(kernel.dtype) == kernel)):
        raise ValueError(f"{path}: the {w.format.name} arrays do not decode to the model's kernel bit for bit (was "
                         f"the model changed after ptq.quantize, or is this another model's result?); pack would "
                         f"change what the model computes")
    return w


def pack(model: nnx.Module, result: PTQResult, *, gemm: str = "auto", paths: Sequence[str] | None = None,
         device: Any = None, backend: str | None = None) -> PackReport:
    """Replace the quantized ``nnx.Linear`` layers of a PTQ'd `model` by :class:`PackedLinear` layers holding packed
    arrays, in place (module docstring).

    Args:
      model: the model `result` came from (``result = jaxlowfp.ptq.quantize_model(model, ...)``).
      result: its `PTQResult`.
      gemm: "auto", "scaled_matmul", "fp8" or "dequant" (`jaxlowfp.backends`); an explicit one is checked for
        every layer on `device` before anything changes (``backend=`` is its deprecated name).
      paths: the layers to pack (default: every layer `result` quantized, mixture-of-experts weights included).
      device: what `gemm` is checked against and the report describes (default JAX's first device).

    Returns a :class:`PackReport`. Every check runs before the model changes, so an error leaves it as it was.
    """
    backend = renamed_kwarg("ptq.pack_model", "backend", backend, "gemm", gemm, "auto")
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module; got {type(model).__name__}")
    if not isinstance(result, PTQResult):
        raise TypeError(f"result must be the PTQResult of jaxlowfp.ptq.quantize; got {type(result).__name__}")
    done = [*result.schemes, *result.experts]
    todo = list(done) if paths is None else list(paths)
    unknown = [p for p in todo if p not in done]
    if unknown:
        raise ValueError(f"paths {unknown[:4]} were not quantized by this PTQ result; it quantized "
                         f"{done[:6]}{' ...' if len(done) > 6 else ''}")
    grouped = {p: (mod, name) for p, mod, name in grouped_weights(model)}
    experts: dict[str, tuple[nnx.Module, str, PackedExperts]] = {}
    mods = quantizable_modules(model)
    new: dict[str, PackedLinear] = {}
    general: dict[str, PackedKernel] = {}
    rows = []
    float_bytes = packed_bytes = params = 0
    for path in todo:
        if path in result.experts:
            if path not in grouped or isinstance(getattr(*grouped[path]), packed.PackedParam):
                raise ValueError(f"{path}: " + ("already packed" if path in grouped else "no such expert weight in "
                                                                                       "this model"))
            if backend not in ("auto", "dequant"):
                raise ValueError(f"{path}: packed experts run the 'dequant' backend (each expert's weight decoded "
                                 f"inside the forward, then the experts' grouped GEMM; no block-scaled grouped GEMM "
                                 f"path yet); got gemm={backend!r}: use 'auto' or 'dequant' (pack the other "
                                 f"layers on {backend!r} with paths=)")
            mod, name = grouped[path]
            kernel = getattr(mod, name)[...]
            var = PackedExperts.stack(_expert_weights(path, kernel, result), kernel_dtype=kernel.dtype)
            var.set_value(_placed(var.get_value(), kernel, path))
            experts[path] = (mod, name, var)
            rows.append((path, var.get_value().format.name, "dequant", False))
            params += int(np.prod(kernel.shape))
            float_bytes += int(kernel.nbytes)
            packed_bytes += var.get_value().nbytes
            continue
        mod = mods.get(path)
        if mod is None or isinstance(getattr(mod, "kernel", None), PackedKernel):
            have = set(packed_layers(model)) | ({path} if mod is not None else set())
            raise ValueError(f"{path}: " + ("already packed" if path in have else "no such layer in this model"))
        if isinstance(mod, (nnx.LinearGeneral, nnx.Einsum)):
            if backend not in ("auto", "dequant"):
                raise ValueError(f"{path}: a packed {type(mod).__name__} runs the 'dequant' backend (its kernel is "
                                 f"decoded inside the forward and the layer's own contraction runs; no low-precision "
                                 f"GEMM path for it yet); got gemm={backend!r}: use 'auto' or 'dequant'")
            w = _weight(path, mod, result)
            kernel = mod.kernel[...]
            general[path] = PackedKernel(w, kernel_layout=layout(mod, path), kernel_dtype=jnp.dtype(kernel.dtype))
            rows.append((path, w.format.name, "dequant", False))
            params += w.k * w.n
            float_bytes += int(kernel.nbytes)
            packed_bytes += w.nbytes
            continue
        if type(mod) is not nnx.Linear:
            raise ValueError(f"{path}: pack replaces nnx.Linear, nnx.LinearGeneral and nnx.Einsum layers; this layer "
                             f"is a {type(mod).__name__} (a subclass: keep it fake-quantized, leave it out of "
                             f"`paths`)")
        w = _placed(_weight(path, mod, result), mod.kernel[...], path)
        sch = result.schemes[path]
        act = None if sch.activation is None else packed.as_format(sch.activation, f"{path} activation")
        hook = getattr(mod, "dot_general", None)
        layer = PackedLinear(w, mod.bias, activation=act, gemm=backend, dtype=mod.dtype,
                             param_dtype=mod.kernel[...].dtype, path=path,
                             act_quant=hook if isinstance(hook, ActQuant) else None)
        p = layer.plan(device)
        rows.append((path, w.format.name, p.backend, p.native))
        new[path] = layer
        params += w.k * w.n
        float_bytes += int(mod.kernel[...].nbytes)
        packed_bytes += w.nbytes
    replace_modules(model, {path: (mods[path], layer) for path, layer in new.items()})
    for path, kern in general.items():
        setattr(mods[path], "kernel", kern)  # the float kernel is dropped; the layer reads the packed one
    for path, (mod, name, var) in experts.items():
        setattr(mod, name, var)
    commit_state(model)  # the first jitted call compiles what every later one runs
    return PackReport(layers=tuple(rows), params=params, float_bytes=float_bytes, packed_bytes=packed_bytes)


def report_of(model: nnx.Module, device: Any = None) -> PackReport:
    """The :class:`PackReport` of every :class:`PackedLinear` in `model` (e.g. a packed load): the backend each
    runs on `device`, and the float bytes its kernel would take in its ``param_dtype``."""
    rows, params, float_bytes, packed_bytes = [], 0, 0, 0
    for path, mod in quantizable_modules(model).items():
        kern = getattr(mod, "kernel", None)
        if isinstance(kern, PackedKernel):
            w = kern.get_value()
            rows.append((path, w.format.name, "dequant", False))
            params += w.k * w.n
            float_bytes += w.k * w.n * kern.kernel_dtype.itemsize
            packed_bytes += w.nbytes
    for path, mod, name in grouped_weights(model):
        var = getattr(mod, name)
        if isinstance(var, PackedExperts):
            w = var.get_value()
            rows.append((path, w.format.name, "dequant", False))
            params += int(np.prod(var.shape))
            float_bytes += int(np.prod(var.shape)) * var.kernel_dtype.itemsize
            packed_bytes += w.nbytes
    for path, layer in packed_layers(model).items():
        w = layer.kernel.get_value()
        p = layer.plan(device)
        rows.append((path, w.format.name, p.backend, p.native))
        params += w.k * w.n
        float_bytes += w.k * w.n * layer.param_dtype.itemsize
        packed_bytes += w.nbytes
    return PackReport(layers=tuple(rows), params=params, float_bytes=float_bytes, packed_bytes=packed_bytes)
