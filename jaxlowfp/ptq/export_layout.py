"""The layout of a `jaxlowfp.ptq.export` directory, shared by its writer (`jaxlowfp.ptq.checkpoint`) and reader
(`jaxlowfp.ptq.checkpoint_load`): the file names, the tensor names of each parameter and quantized layer
(compressed-tensors' ``weight_packed`` / ``weight_scale`` / ``weight_global_scale`` / ``input_global_scale``, FP8's
``weight`` / ``weight_scale`` / ``input_scale``), the formats as JSON, the SHA-256 of each tensor, and the parameters
an exporter sees (packed ones as :class:`PackedView`)."""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlowfp import packed as packing
from jaxlowfp._core.format import Format
from jaxlowfp._core.qarray import QArray
from jaxlowfp.ptq import checks, stream
from jaxlowfp.ptq.formats import Scheme

WEIGHTS_FILE = "model.safetensors"
META_FILE = "jaxlowfp_ptq.json"
_SUFFIX = {"kernel": "weight", "scale": "weight", "embedding": "weight"}


def read_safetensors(path: str | Path, *, check_finite: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file (`jaxlowfp._core.safetensors_read.read_safetensors`, float8 included:
    the header validated against the file first, every float tensor finite unless ``check_finite=False``)."""
    from jaxlowfp._core.safetensors_read import read_safetensors as read

    return read(path, check_finite=check_finite)


def tensor_digests(path: str | Path) -> dict[str, str]:
    """{tensor name: SHA-256 of its bytes} of a .safetensors file (header validated first): what `export` records
    in ``jaxlowfp_ptq.json`` and `load` verifies, so a damaged or swapped weights file is named, tensor by tensor,
    before anything is loaded."""
    import hashlib

    from jaxlowfp._core.safetensors_read import safetensors_header

    header, start = safetensors_header(path)
    out = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            a, b = info["data_offsets"]
            f.seek(start + a)
            h = hashlib.sha256()
            left = b - a
            while left:
                chunk = f.read(min(left, 1 << 24))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
            out[name] = h.hexdigest()
    return out


def expected_tensors(model_params: Mapping[str, Any], names: Mapping[str, Any], meta: Mapping[str, Any],
                      linears: Mapping[str, Any]) -> tuple[set[str], set[str]]:
    """(the tensors `load` reads for the model's parameters, those it may find besides: activation scales)."""
    need, optional = set(), set()
    layers = meta["layers"]
    for path in model_params:
        mod_path, leaf = path.rsplit("/", 1) if "/" in path else ("", path)
        name = names[path]
        info = layers.get(path) if isinstance(name, list) else (layers.get(mod_path) if leaf == "kernel" else None)
        if info is None:
            need |= set(name) if isinstance(name, list) else {name}
            continue
        kind = (info.get("weight") or {}).get("kind")
        for m in info.get("names", [info.get("name")]):
            if kind == "fp8":
                need |= {f"{m}.weight", f"{m}.weight_scale"}
                optional.add(f"{m}.input_scale")
            else:
                need |= {f"{m}.weight_packed", f"{m}.weight_scale", f"{m}.weight_global_scale"}
                optional.add(f"{m}.input_global_scale")
    return need, optional


def default_name(path: str) -> str:
    """``blocks/0/attn/q_proj/kernel`` -> ``blocks.0.attn.q_proj.weight`` (kernel, scale, embedding -> weight)."""
    parts = path.split("/")
    return ".".join(parts[:-1] + [_SUFFIX.get(parts[-1], parts[-1])])


def namer(tensor_names: Mapping[str, str] | Callable[[str], str] | None) -> Callable[[str], str]:
    if tensor_names is None:
        return default_name
    if callable(tensor_names):
        return tensor_names
    names = dict(tensor_names)
    return lambda p: names[p] if p in names else default_name(p)


def model_params(model: nnx.Module) -> dict[str, nnx.Variable]:
    return {"/".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}


class PackedView:
    """A packed parameter (`jaxlowfp.packed.PackedParam`: a `PackedLinear`'s kernel, a `PackedKernel`, a
    `PackedExperts`, after `jaxlowfp.ptq.pack_model`) seen by the exporters at its path as the float parameter of the
    unpacked model: ``shape`` is that parameter's, ``[...]`` decodes it (float32, then the dtype the float kernel was
    stored in; bit for bit the fake-quant kernel, which `pack_model` checks), and ``packed`` is the `PackedWeight`, from
    whose codes and scales the exporters write the quantized layers without decoding them."""

    def __init__(self, var: packing.PackedParam, layer: Any = None) -> None:
        self.var, self.packed = var, var.get_value()
        self.dtype = jnp.dtype(getattr(layer, "param_dtype", getattr(var, "kernel_dtype", jnp.float32)))
        self.shape = tuple(jax.eval_shape(self._decode).shape)

    def _decode(self) -> jax.Array:
        if type(self.var) is packing.PackedParam:  # a PackedLinear's kernel: W' [K, N] = the Linear's [in, out]
            return self.packed.dequantize(jnp.float32).astype(self.dtype)
        return self.var[...]  # PackedKernel / PackedExperts decode to their layer's kernel layout

    def __getitem__(self, key: Any) -> jax.Array:
        return self._decode()[key]


def export_params(model: nnx.Module) -> dict[str, Any]:
    """What the exporters write, by parameter path in graph order: every ``nnx.Param``, and every packed parameter
    as a :class:`PackedView` (so a packed model exports as the model it was packed from)."""
    from jaxlowfp.packed_layer import PackedLinear

    nodes = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(model)}
    out: dict[str, Any] = {}
    for path, v in nodes.items():
        if isinstance(v, nnx.Param):
            out[path] = v
        elif isinstance(v, packing.PackedParam):
            layer = nodes.get(path.rsplit("/", 1)[0]) if "/" in path else None
            out[path] = PackedView(v, layer if isinstance(layer, PackedLinear) else None)
    return out


def linear_layers(model: nnx.Module) -> dict[str, nnx.Module]:
    """Every ``nnx.Linear`` and `PackedLinear` (an nnx.Linear stored packed) by path, in graph order."""
    from jaxlowfp.packed_layer import PackedLinear

    return {"/".join(map(str, p)): m for p, m in nnx.iter_graph(model) if isinstance(m, (nnx.Linear, PackedLinear))}


def check_finite_param(var: Any, where: str) -> None:
    """`checks.check_finite_tensor` of a parameter; of a :class:`PackedView`'s float leaves (codes of float8 formats,
    scales) without decoding it."""
    if isinstance(var, PackedView):
        for leaf in jax.tree.leaves(var.packed):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                checks.check_finite_tensor(np.asarray(stream.fetch(leaf)).astype(np.float32), where)
        return
    checks.check_finite_tensor(var[...], where)


def same_packed_nvfp4(where: str, w: packing.PackedWeight, arr: QArray, s_enc: Any
                      ) -> tuple[QArray, Any]:
    """The packed model's NVFP4 array and encode scale, checked to be the PTQ result's ``(arr, s_enc)`` (codes,
    block scales and scales equal), without decoding either: what the exporters write for a packed layer."""
    if w.format.kind != "nvfp4":
        raise ValueError(f"{where}: the packed model holds {w.format.name} arrays; the PTQ result quantized this layer "
                         f"to NVFP4 (is this another model's result?)")
    a = w.array
    same = (tuple(a.shape) == tuple(arr.shape) and a.format.block_shape == arr.format.block_shape
            and np.array_equal(stream.fetch(a.codes), stream.fetch(arr.codes))
            and np.array_equal(np.asarray(stream.fetch(a.scales)).view(np.uint8),
                               np.asarray(stream.fetch(arr.scales)).view(np.uint8))
            and a.global_scale is not None and arr.global_scale is not None
            and float(a.global_scale) == float(arr.global_scale)
            and (w.s_enc is None or s_enc is None or float(w.s_enc) == float(s_enc)))
    if not same:
        raise ValueError(f"{where}: the packed model's NVFP4 codes and scales are not the PTQ result's (was the model "
                         f"changed after quantize and pack, or is this another model's result?)")
    return a, (s_enc if w.s_enc is None else w.s_enc)


class UniqueNames(dict):
    """The tensors of a file being assembled: a name given twice (two parameters written as one tensor: one of them
    would be missing from the file) is a ValueError naming it, before anything is written."""

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self:
            raise ValueError(f"export: two tensors would be written as {key!r} (check tensor_names); one of them would "
                             f"be missing from the file. Nothing was written")
        super().__setitem__(key, value)


def layer_tensors(m: str, kind: str, activation: bool) -> list[str]:
    """The tensors module `m` of a quantized layer is written as (module docstring)."""
    if kind == "fp8":
        return [f"{m}.weight", f"{m}.weight_scale"]
    return [f"{m}.{k}" for k in ("weight_packed", "weight_scale", "weight_global_scale")] + (
        [f"{m}.input_global_scale"] if activation else [])


def check_complete(schemes: Mapping[str, Scheme], layers: Mapping[str, Any], names: Any, what: str) -> None:
    """ValueError naming the layers if a quantized layer of the result (`schemes`) is not written: not among the
    written `layers`, or one of its tensors not among `names` (the file's tensor names)."""
    names = set(names)
    missing = [p for p in schemes if p not in layers]
    for p, info in layers.items():
        if p in schemes:
            sch = schemes[p]
            want = [t for m in info.get("names", [info["name"]])
                    for t in layer_tensors(m, sch.weight.kind, sch.activation is not None)]
            if any(t not in names for t in want):
                missing.append(p)
    if missing:
        raise ValueError(f"{what}: the quantized layers {missing[:4]}{' ...' if len(missing) > 4 else ''} of the PTQ "
                         f"result would not be in the file (their parameters are not where the result says, or are "
                         f"not nnx.Param / packed parameters of this model)")


def safetensors_names(path: Path) -> list[str]:
    """The tensor names in a .safetensors file's header (the header only is read)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def format_json(f: Format | None) -> dict | None:
    return None if f is None else {"kind": f.kind, "rule": f.rule, "block_shape": f.block_shape}


@overload
def format_from_json(d: None) -> None: ...
@overload
def format_from_json(d: dict) -> Format: ...
def format_from_json(d: dict | None) -> Format | None:
    """The `Format` a layer entry of the metadata describes (None: none, e.g. a weights-only layer's activation)."""
    if d is None:
        return None
    return Format(kind=d["kind"], rule=d["rule"],
                        block_shape=None if d["block_shape"] is None else tuple(d["block_shape"]))


def ct_quant_args(activation: bool) -> dict:
    """compressed-tensors' NVFP4 preset (``quantization/quant_scheme.py``: ``NVFP4`` / ``NVFP4A16``) as its
    ``QuantizationArgs`` serialise: E4M3 block scales (``scale_dtype``: without it compressed-tensors simulates
    activation block scales unrounded), weights static, activations ``dynamic: local`` (block scales from the
    current input, the global scale static from calibration)."""
    args = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
            "dynamic": "local" if activation else False, "scale_dtype": "torch.float8_e4m3fn",
            "zp_dtype": None, "actorder": None, "block_structure": None, "observer_kwargs": {}}
    args["observer"] = "static_minmax" if activation else "memoryless_minmax"
    return args
