"""`PackedLinear`: an ``nnx.Linear`` whose kernel is a `jaxlowfp.packed.PackedParam`, and `replace_modules`, which
puts such layers where float ones were (`jaxlowfp.ptq.pack_model`, and the packed loads of `jaxlowfp.ptq.load` and
`jaxlowfp.models.load`). The forward is `jaxlowfp.backends.packed_dot_general` (or `backends.scaled_matmul_rows`
for per-token / static NVFP4 activations on "scaled_matmul"), with the input quantized first as the fake-quant layer
quantizes it."""
from __future__ import annotations

from jaxlowfp._core.deprecation import renamed_kwarg
from jaxlowfp._core.surface import public_dir as _public_dir

import functools
from collections.abc import Mapping, MutableMapping, MutableSequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlowfp import backends, packed, qat

__all__ = ["PackedLinear", "replace_modules"]


class PackedLinear(nnx.Module):
    """An ``nnx.Linear`` whose kernel is a `jaxlowfp.packed.PackedParam` (``kernel.get_value()`` is the
    `PackedWeight` of ``W' = kernel [in, out]``): ``y = packed_dot_general(x, W') + bias`` on `backend`, with the
    input quantized to `activation` at run time (None: weights only). The compute dtype is the Linear's (`dtype`;
    None: the input's); "dequant" rounds the float32 dequantized weight to `param_dtype` first, as the float kernel
    was stored."""

    def __init__(self, kernel: packed.PackedWeight, bias: nnx.Param | None, *, activation: packed.Format | None,
                 gemm: str = "auto", dtype: Any = None, param_dtype: Any = jnp.float32, path: str = "",
                 act_quant: Any = None, act_fn: Any = None, backend: str | None = None) -> None:
        backend = renamed_kwarg("PackedLinear", "backend", backend, "gemm", gemm, "auto")
        # act_fn: a hashable callable x -> fake-quantized x, a foreign checkpoint's activation quantizer
        # (`jaxlowfp.models.quantized.NVFP4Act.quantize`: compressed-tensors' NVFP4 with the static input global
        # scale); like act_quant it runs before the product, which then takes the weights-only path
        if act_fn is not None:
            if act_quant is not None or activation is not None:
                raise ValueError(f"{path}: give one activation quantizer (act_fn, act_quant or activation)")
            if backend not in ("auto", "dequant"):
                raise ValueError(f"{path}: gemm={backend!r} quantizes the activations with our NVFP4 quantizer; "
                                 f"this layer's activations are the checkpoint's (static input global scale, "
                                 f"compressed-tensors arithmetic): use gemm='dequant' or 'auto'")
        self.act_fn = act_fn
        # act_quant: the PTQ'd layer's run-time activation quantizer (`jaxlowfp.ptq.ActQuant`); with per-token or
        # static scales the input is quantized by it (the one op layer's quantizer, as the fake-quant model does)
        # and the product runs on the weights-only path, since scaled_matmul's operands carry one tensor scale
        # per-token / static activations on the low-precision GEMM, each row's scale applied to the output: NVFP4 on
        # scaled_matmul, FP8 on the fp8 backend
        self.rows_gemm = False
        if act_quant is not None and act_quant.activation_scale != "tensor":
            fmt = act_quant.fmt
            scalar = not isinstance(act_quant.amax, (tuple, list))
            nv_rows = (backend == "scaled_matmul" and kernel.format.kind == "nvfp4"
                       and kernel.format.arithmetic == "jaxlowfp" and fmt.kind == "nvfp4"
                       and tuple(fmt.block_shape) == (1, 16))
            fp8_rows = backend == "fp8" and kernel.format.kind == "fp8" and fmt.kind == "fp8"
            if scalar and (nv_rows or fp8_rows):
                backends.plan(kernel, packed.as_format(fmt), backend, where=path)  # the device's own refusals
                self.rows_gemm = True
            elif backend not in ("auto", "dequant"):
                backends.plan(kernel, activation, backend, where=path)  # the format's and device's own refusals
                raise ValueError(f"{path}: gemm={backend!r} quantizes the activations with one tensor scale; this "
                                 f"layer's activations have {act_quant.activation_scale!r} scales (jaxlowfp.ptq."
                                 f"quantize_model activation_scale=): use gemm='dequant' or 'auto', or quantize "
                                 f"with activation_scale='tensor'")
            self.act_quant = act_quant
            activation = packed.as_format(fmt) if self.rows_gemm else None
        else:
            self.act_quant = None
        self.kernel = packed.PackedParam(kernel)
        self.bias = bias
        self.in_features, self.out_features = kernel.k, kernel.n
        self.activation = activation
        self.backend = backend
        self.dtype = dtype
        self.param_dtype = jnp.dtype(param_dtype)
        self.path = path

    def plan(self, device: Any = None) -> backends.Plan:
        """The backend this layer runs on `device` (default JAX's first device)."""
        return backends.plan(self.kernel.get_value(), self.activation, self.backend, device=device, where=self.path)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        dtype = inputs.dtype if self.dtype is None else jnp.dtype(self.dtype)
        x = inputs.astype(dtype)
        if self.rows_gemm:  # NVFP4 rows quantized by our quantizer with their own (or the static) amax
            aq = self.act_quant
            x2 = x.reshape(-1, x.shape[-1])
            amax = (jnp.float32(aq.amax) if aq.activation_scale == "static"
                    else jnp.max(jnp.abs(x2.astype(jnp.float32)), axis=-1))
            w = self.kernel.get_value()
            if w.format.kind == "fp8":
                out = backends.fp8_rows(x2, w, aq.recipe.activation.scaling, amax)
            else:
                out = backends.scaled_matmul_rows(x2, w, aq.fmt.rule, amax)
            out = out.reshape(*x.shape[:-1], -1).astype(dtype)
            if self.bias is not None:
                out = out + jnp.reshape(self.bias[...].astype(dtype), (1,) * (out.ndim - 1) + (-1,))  # type: ignore[operator, union-attr]
            return out
        if self.act_quant is not None:  # per-token / static activation scales: the op layer's quantizer
            spec = self.act_quant.recipe.activation
            st = self.act_quant.recipe_state()  # a calibrated amax is the quantizer's state
            # one program per spec and shape for all layers on a CPU (backends.shared_quantizer)
            x = backends.shared_quantizer(_spec_quantizer(spec), x, spec.init() if st is None else st.activation)
        elif self.act_fn is not None:
            x = self.act_fn(x)
        y = backends.packed_dot_general(x, self.kernel.get_value(), (((x.ndim - 1,), (0,)), ((), ())),
                                        gemm=self.backend, activation=self.activation,
                                        weight_dtype=self.param_dtype, where=self.path)
        if self.bias is not None:
            y = y + jnp.reshape(self.bias[...].astype(dtype), (1,) * (y.ndim - 1) + (-1,))  # type: ignore[operator, union-attr]
        return y  # type: ignore[return-value]




def _quantize_with(spec: Any, x: jax.Array, state: Any) -> jax.Array:
    return qat.fake_quant(x, state, spec)[0]


@functools.lru_cache(maxsize=None)
def _spec_quantizer(spec: Any) -> Any:
    """One function object per activation QuantSpec (so that `backends.shared_quantizer` shares its program)."""
    return functools.partial(_quantize_with, spec)


def _parents(model: nnx.Module) -> dict[int, tuple[Any, Any]]:
    """id(child module) -> (parent, key) for every module reachable by attribute or list index."""
    out: dict[int, tuple[Any, Any]] = {}
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) or isinstance(node, (MutableSequence, MutableMapping)):
            items = (enumerate(node) if isinstance(node, MutableSequence) else node.items()
                     if isinstance(node, MutableMapping) else vars(node).items())
            for key, child in items:
                if isinstance(child, nnx.Module):
                    out.setdefault(id(child), (node, key))
    return out


def replace_modules(model: nnx.Module, layers: Mapping[str, tuple[nnx.Module, nnx.Module]]) -> None:
    """Put each new module where its old one was (``{path: (old, new)}``), by attribute or list index, in place."""
    parents = _parents(model)
    for path, (old, layer) in layers.items():
        if id(old) not in parents:
            raise ValueError(f"{path}: the module is not reachable by attribute or list index; cannot replace it")
        parent, key = parents[id(old)]
        if isinstance(parent, (MutableSequence, MutableMapping)):
            parent[key] = layer
        else:
            setattr(parent, key, layer)


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
