"""Export of a PTQ'd model's NVFP4 weights as a compressed-tensors ``nvfp4-pack-quantized`` checkpoint, and load.

Layout (compressed-tensors, vllm-project/compressed-tensors: ``compressors/nvfp4/base.py`` names the tensors,
``compressors/nvfp4/helpers.py`` packs them, ``quantization/utils/helpers.py: generate_gparam`` defines the global
scale, ``quantization/lifecycle/forward_helpers.py`` dequantizes with ``scale / global_scale``; vLLM's
``compressed_tensors_w4a4_nvfp4`` scheme loads it). For a Linear ``<m>`` (PyTorch orientation ``weight [out, in]``;
an NNX kernel is ``[in, out]``, so everything is written for ``kernel.T``)::

    <m>.weight_packed        uint8          [out, in / 2]   two E2M1 codes a byte, element 2j in the low nibble,
                                                             code = sign << 3 | magnitude index
                                                             (0, .5, 1, 1.5, 2, 3, 4, 6)
    <m>.weight_scale         float8_e4m3fn  [out, in / 16]  one E4M3 block scale per 16 inputs (16x16 tiles: repeated
                                                             over the tile's 16 rows, since the format has 1x16 groups)
    <m>.weight_global_scale  float32        [1]             the ENCODE scale S_enc = M*E / amax (compressed-tensors
                                                             convention; ModelOpt's ``weight_scale_2`` is its
                                                             reciprocal, the decode scale)
    <m>.input_global_scale   float32        [1]             W4A4 only: S_enc of the calibration activation amax

    w = E2M1(code) * weight_scale / weight_global_scale

and ``config.json`` gains ``quantization_config``: compressed-tensors' own NVFP4 / NVFP4A16 preset as it serialises
(``quant_method: compressed-tensors``, ``format: nvfp4-pack-quantized``, 4-bit float, ``strategy: tensor_group``,
``group_size: 16``, ``scale_dtype: torch.float8_e4m3fn``; W4A4 layers' input activations ``dynamic: local`` with
``observer: static_minmax``), one config group per activation scheme with the exported modules as targets, and an
``ignore`` list of everything kept in high precision (embeddings, lm_head, Linear layers no rule quantized).

What a serving engine applies, and what `export` guarantees for it:

- **Fused groups share one global scale.** vLLM fuses q/k/v and gate/up and decodes the group with its largest
  ``weight_global_scale`` (`jaxlowfp.ptq.serving`); `quantize` (``fused="auto"``) quantizes every member under
  the group's amax, and `export` refuses groups whose global scales differ.
- **Weights** decode exactly: the stored codes and scales are what we evaluated. Decoding order: compressed-tensors
  computes ``q * (s / g)``, ours ``(q * s) * (1 / g)`` (1 ulp apart in about a quarter of the weights), unless the
  model was quantized with ``arithmetic="compressed-tensors"`` (llm-compressor's arithmetic; then ``load`` decodes
  in that order too). Four Over Six changes no storage: it chooses each block's E4M3 scale (x1.5 where the block
  maps its max to 4, and E = 256 in S_enc).
- **Activations** are the engine's: vLLM and compressed-tensors quantize W4A4 inputs with static_6 block scales
  from the current input and the static ``input_global_scale`` (written with the static_6 constant from the
  calibration amax), not our 4/6 / current-amax path; ``jaxlowfp_ptq.json`` records ours, which `load` rebuilds
  bit for bit.
- Refused: non-finite block scales, a non-finite or non-positive global scale, and W4A4 layers whose calibration
  input amax is zero or not finite (their ``input_global_scale`` would be meaningless: the prompt-dependent NaNs of
  served MoE models).

Mixtures of experts: a grouped expert weight ``[E, in, out]`` is written as one ``[out, in]`` module per expert under
the names the model says (``ExportTensor.expert``; Qwen3-MoE ``model.layers.N.mlp.experts.E.gate_proj``, Mixtral
``...block_sparse_moe.experts.E.w1``), each with the four tensors above from `jaxlowfp.ptq.experts.ExpertResult`
(``packed``; W4A4: ``input_global_scale`` from ``calib_amax``, one for an expert's gate and up, which read the same
rows); an expert's gate and up must share their ``weight_global_scale`` (vLLM merges them). `load` stacks them back.

`export` returns an `ExportReport` (bits per parameter of the whole checkpoint and of the NVFP4 layers).
Tensors that are not quantized are written as ``dtype`` (by default the dtype the model was quantized and evaluated
in, `PTQResult.dtype`: float32 unless `jaxlowfp.ptq.quantize_model` was given another),
1-D ones (norm scales, biases) in float32; the report counts the values the rounding changed. The model says its
tensor names and ``config.json`` (`jaxlowfp.ptq.protocol`, ``export_tensors("hf")`` / ``export_config("hf")``);
other models get `default_name` and no config unless given. Before anything is written, every tensor is checked
finite (the high-precision ones too) and every NVFP4 layer for finite, positive scales and a weight not all zero.

A packed model (`jaxlowfp.ptq.pack_model`) exports as the model it was packed from, byte for byte: its quantized
layers are written from their own codes and scales (checked equal to the result's, never decoded), its other
parameters as they are. Every export checks that each quantized layer of the result is in the file (before writing,
and in the written file's header) and that no two parameters are written under one name; otherwise it raises,
naming them, and writes nothing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax import lax

from jaxlowfp._core.deprecation import deprecated_getattr, renamed_kwarg
from jaxlowfp import nvfp4
from jaxlowfp import packed as packing
from jaxlowfp._core import ct_nvfp4
from jaxlowfp.ptq import checks, known_gaps, serving, stream
from jaxlowfp.ptq.protocol import Exportable, require_exportable
from jaxlowfp.ptq.api import PTQResult
from jaxlowfp.ptq.layers import act_quant, require_linear
from jaxlowfp.ptq.calibrate import linear_modules
from jaxlowfp._core.format import Format
from jaxlowfp._core.qarray import QArray
from jaxlowfp.ptq.formats import Scheme
from jaxlowfp.scaling import CurrentScaling

WEIGHTS_FILE = "model.safetensors"
_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
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


def _expected_tensors(model_params: Mapping[str, Any], names: Mapping[str, Any], meta: Mapping[str, Any],
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


def _namer(tensor_names: Mapping[str, str] | Callable[[str], str] | None) -> Callable[[str], str]:
    if tensor_names is None:
        return default_name
    if callable(tensor_names):
        return tensor_names
    names = dict(tensor_names)
    return lambda p: names[p] if p in names else default_name(p)


def _params(model: nnx.Module) -> dict[str, nnx.Variable]:
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


def _linears(model: nnx.Module) -> dict[str, nnx.Module]:
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
            and float(a.global_scale) == float(arr.global_scale)
            and (w.s_enc is None or s_enc is None or float(w.s_enc) == float(s_enc)))
    if not same:
        raise ValueError(f"{where}: the packed model's NVFP4 codes and scales are not the PTQ result's (was the model "
                         f"changed after quantize and pack, or is this another model's result?)")
    return a, (s_enc if w.s_enc is None else w.s_enc)


class _Once(dict):
    """The tensors of a file being assembled: a name given twice (two parameters written as one tensor: one of them
    would be missing from the file) is a ValueError naming it, before anything is written."""

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self:
            raise ValueError(f"export: two tensors would be written as {key!r} (check tensor_names); one of them would "
                             f"be missing from the file. Nothing was written")
        super().__setitem__(key, value)


def _layer_tensors(m: str, kind: str, activation: bool) -> list[str]:
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
                    for t in _layer_tensors(m, sch.weight.kind, sch.activation is not None)]
            if any(t not in names for t in want):
                missing.append(p)
    if missing:
        raise ValueError(f"{what}: the quantized layers {missing[:4]}{' ...' if len(missing) > 4 else ''} of the PTQ "
                         f"result would not be in the file (their parameters are not where the result says, or are "
                         f"not nnx.Param / packed parameters of this model)")


def _safetensors_names(path: Path) -> list[str]:
    """The tensor names in a .safetensors file's header (the header only is read)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def _fmt_json(f: Format | None) -> dict | None:
    return None if f is None else {"kind": f.kind, "rule": f.rule, "block_shape": f.block_shape}


def _fmt_from(d: dict | None) -> Format | None:
    if d is None:
        return None
    return Format(kind=d["kind"], rule=d["rule"],
                        block_shape=None if d["block_shape"] is None else tuple(d["block_shape"]))


def _quant_args(activation: bool) -> dict:
    """compressed-tensors' NVFP4 preset (``quantization/quant_scheme.py``: ``NVFP4`` / ``NVFP4A16``) as its
    ``QuantizationArgs`` serialise: E4M3 block scales (``scale_dtype``: without it compressed-tensors simulates
    activation block scales unrounded), weights static, activations ``dynamic: local`` (block scales from the
    current input, the global scale static from calibration)."""
    args = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
            "dynamic": "local" if activation else False, "scale_dtype": "torch.float8_e4m3fn",
            "zp_dtype": None, "actorder": None, "block_structure": None, "observer_kwargs": {}}
    args["observer"] = "static_minmax" if activation else "memoryless_minmax"
    return args


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """What `export` wrote.

    directory:          the checkpoint directory
    bits_per_parameter: stored bits (every tensor of the safetensors file) / parameters of the model
    quantized_bits:     stored bits per weight of the NVFP4 layers (codes, block scales, global scales; 4.5 + 64/n)
    quantized_fraction: the fraction of the model's parameters stored as NVFP4
    fused:              groups sharing one global scale (what vLLM fuses)
    partial:            vLLM-fused groups of which only some members are quantized (vLLM refuses to load those)
    arithmetic:         the NVFP4 arithmetic of the weights ("jaxlowfp" or "compressed-tensors")
    dtype:              the dtype of the high-precision tensors of 2 or more dimensions (1-D ones are float32)
    rounded:            high-precision values that rounding to `dtype` changed, and how many were written
    notes:              known gaps of consumers that the checkpoint hits (`jaxlowfp.ptq.known_gaps`; warned)
    """

    directory: Path
    bits_per_parameter: float
    quantized_bits: float
    quantized_fraction: float
    fused: tuple[tuple[str, ...], ...]
    partial: tuple[tuple[str, ...], ...]
    arithmetic: str
    dtype: str = "float32"
    rounded: tuple[int, int] = (0, 0)
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        lines = [f"exported to {self.directory}: {self.bits_per_parameter:.3f} bits per parameter "
                 f"({100 * self.quantized_fraction:.1f} % of the parameters in NVFP4 at {self.quantized_bits:.3f} "
                 f"bits per weight), {len(self.fused)} fused groups sharing a global scale, {self.arithmetic} "
                 f"arithmetic; high precision in {self.dtype} ({self.rounded[0]} of {self.rounded[1]} values "
                 f"rounded)"]
        lines += [f"note: {n}" for n in self.notes]
        if self.partial:
            lines.append(f"note: only some members of the fused groups {list(self.partial)[:3]} are quantized; vLLM "
                         f"loads a fused layer only if all its shards have the same scheme")
        return "\n".join(lines)


def _check_scales(m: str, scales: np.ndarray, s_enc: float) -> None:
    """Refuse what would make a served model NaN or garbage: non-finite block scales, a non-finite or
    non-positive global scale (uncalibrated MoE experts are the known source)."""
    f = scales.astype(np.float32)
    if not np.isfinite(f).all():
        raise ValueError(f"{m}: {int((~np.isfinite(f)).sum())} weight block scales are NaN/Inf (the weight has "
                         f"non-finite values); refusing to export")
    if not (np.isfinite(s_enc) and s_enc > 0):
        raise ValueError(f"{m}: weight_global_scale is {s_enc}; it must be finite and > 0; refusing to export")


WRITTEN_KINDS = ("nvfp4", "fp8")


def _fp8_quant_args(activation: str | None) -> dict:
    """compressed-tensors' FP8 preset (``quantization/quant_scheme.py``: ``FP8``; ``FP8_DYNAMIC``'s per-token
    activations) as its ``QuantizationArgs`` serialise: E4M3 weights with one static scale per tensor;
    activations (`activation`: our activation_scale) static per tensor (the calibrated ``input_scale``), dynamic
    per token, or dynamic per tensor (the batch's amax); None: the weights' args."""
    args: dict[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                            "strategy": "tensor", "dynamic": False}
    if activation is None:
        return args
    if activation == "static":
        return {**args, "observer": "static_minmax"}
    return {**args, "strategy": "token" if activation == "token" else "tensor", "dynamic": True, "observer": None}


def _fp8_input_scale(m: str, amax: float) -> np.ndarray:
    """``input_scale`` of a static FP8 layer: the calibrated amax / 448, the scale our static quantizer uses."""
    if not (np.isfinite(amax) and amax > 0):
        raise ValueError(f"{m}: the calibration amax of this layer's input is {amax}; refusing to export an FP8 "
                         f"layer a served model would run with a meaningless input_scale")
    return np.asarray(CurrentScaling(target_max=448.0).scale(jnp.float32(amax)), np.float32).reshape(1)


def _input_global_scale(m: str, amax: float, convention: str) -> np.ndarray:
    """The encode scale of the calibration amax of a layer's input, as the serving engine applies it (static_6
    activations: vLLM and compressed-tensors have no 4/6 on activations)."""
    if not (np.isfinite(amax) and amax > 0):
        raise ValueError(f"{m}: the calibration amax of this layer's input is {amax} (the layer saw no or non-finite "
                         f"calibration input), so input_global_scale would be {'1' if amax == 0 else 'NaN'}; "
                         f"refusing to export a W4A4 layer a served model would run with a meaningless scale")
    a = jnp.float32(amax)
    g = ct_nvfp4.global_scale(a) if convention == "compressed-tensors" else nvfp4.global_scales(a, "static_6")[0]
    return np.asarray(g, np.float32).reshape(1)


def check_export_inputs(params: Mapping[str, Any], result: PTQResult, name_of: Callable[[str], str]) -> None:
    """Before anything is written: every parameter finite (the high-precision ones too: norms, embeddings), and
    every packed NVFP4 layer with finite block scales, a finite positive global scale and a weight not all zero
    (an all-zero tensor has no meaningful global scale)."""
    for path, var in params.items():
        check_finite_param(var, f"{name_of(path)} (parameter {path})")
    for mod_path in result.schemes:
        if mod_path not in result.packed:
            continue
        checks.check_packed_nvfp4(mod_path, *result.packed[mod_path])


def _hf_names(model: nnx.Module) -> dict[str, str] | None:
    """The model's Hugging Face tensor names if it says them (`jaxlowfp.ptq.protocol`), else None."""
    if not isinstance(model, Exportable):
        return None
    tensors, _ = require_exportable(model, "hf", "export", with_config=False)
    return {t.path: t.name for t in tensors if t.path is not None}


def _expert_names(model: nnx.Module) -> dict[str, list[str]]:
    """{expert weight path: the per-expert checkpoint names, expert 0 first} as the model says them
    (`jaxlowfp.ptq.protocol`, ``ExportTensor.expert``); empty for a model without grouped expert weights."""
    if not isinstance(model, Exportable):
        return {}
    tensors, _ = require_exportable(model, "hf", "export", with_config=False)
    out: dict[str, dict[int, str]] = {}
    for t in tensors:
        if t.expert is not None:
            out.setdefault(t.path, {})[t.expert] = t.name
    bad = [p for p, d in out.items() if sorted(d) != list(range(len(d)))]
    if bad:
        raise ValueError(f"export: {type(model).__name__}.export_tensors('hf') does not name experts 0..E-1 of "
                         f"{bad[0]}")
    return {p: [d[e] for e in range(len(d))] for p, d in out.items()}


def _write_experts(path: str, var: Any, names: list[str], result: PTQResult, tensors: dict, layers: dict,
                   dtype: str, spool: stream.Spool) -> tuple[int, int, int, int]:
    """One ``[out, in]`` tensor per expert of the grouped weight `path` [E, in, out]: NVFP4 (packed codes, block
    scales, the expert's global scale, W4A4: its input_global_scale) if PTQ quantized it, else `dtype`. Returns
    (quantized values, their bits, rounded values, high-precision values). A packed weight (:class:`PackedView`) is
    written from its codes and scales, checked to be the result's, without decoding it."""
    res = result.experts.get(path)
    view = var if isinstance(var, PackedView) and res is not None and res.scheme is not None else None
    w = None if view is not None else np.asarray(stream.fetch(var[...]), np.float32)
    n_exp, size = int(var.shape[0]), int(np.prod(var.shape))
    if len(names) != n_exp:
        raise ValueError(f"{path}: {n_exp} experts, and the model names {len(names)} per-expert tensors")
    if res is None or res.scheme is None:  # kept in high precision
        assert w is not None
        rounded = 0
        for e, name in enumerate(names):
            value = np.ascontiguousarray(w[e].T)
            if dtype != "float32":
                low = value.astype(_DTYPES[dtype])
                checks.check_finite_tensor(low.astype(np.float32), f"{name} ({path}[{e}]) rounded to {dtype}",
                                           action="refusing to export (its values overflow it: use dtype='float32')")
                rounded += int(np.sum(low.astype(np.float32) != value))
                value = low
            tensors[name] = spool.put(value)
        return 0, 0, rounded, size
    sch, conv = res.scheme, result.arithmetic
    if len(res.packed) != n_exp:
        raise ValueError(f"{path}: the result holds {len(res.packed)} packed experts for {n_exp}")
    pair = {"gate_proj": "up_proj", "up_proj": "gate_proj"}.get(path.rsplit("/", 1)[1])
    other = result.experts.get(path.rsplit("/", 1)[0] + "/" + pair) if pair else None
    bits, mods = 0, []
    for e, name in enumerate(names):
        arr, s_enc = res.packed[e]
        where = f"{path}[expert {e}]"
        checks.check_packed_nvfp4(where, arr, s_enc)
        if view is not None:
            arr, s_enc = same_packed_nvfp4(where, jax.tree.map(lambda x, e=e: x[e], view.packed), arr, s_enc)
        elif not np.array_equal(np.asarray(serving.decode(arr, s_enc, conv)).T, w[e]):
            raise ValueError(f"{where}: the model's weight is not the packed NVFP4 weight (was the model changed "
                             f"after quantize?)")
        if other is not None and other.packed and float(other.packed[e][1]) != float(s_enc):
            raise ValueError(f"{where}: its weight_global_scale {float(s_enc)} differs from its {pair}'s "
                             f"{float(other.packed[e][1])}; vLLM merges an expert's gate and up (w1/w3) into one "
                             f"GEMM with one global scale")
        if not name.endswith(".weight"):
            raise ValueError(f"{where}: the checkpoint name {name!r} of a quantized expert must end in '.weight'")
        m = name[: -len(".weight")]
        scales = stream.fetch(arr.scales)
        if sch.weight.rows > 1:
            scales = np.repeat(scales, sch.weight.rows, axis=0)
        _check_scales(m, scales, float(s_enc))
        tensors[f"{m}.weight_packed"] = spool.put(stream.fetch(arr.codes))
        tensors[f"{m}.weight_scale"] = spool.put(scales)
        tensors[f"{m}.weight_global_scale"] = spool.put(np.asarray(s_enc, np.float32).reshape(1))
        if sch.activation is not None:
            amaxes = [r.calib_amax for r in (res, other) if r is not None]
            if any(a is None for a in amaxes):
                raise ValueError(f"{where}: W4A4 export needs the calibration input amax of every expert; run "
                                 f"jaxlowfp.ptq.quantize with calibration data")
            # gate and up read the same routed rows: one input_global_scale for the merged w13 GEMM
            tensors[f"{m}.input_global_scale"] = spool.put(_input_global_scale(m, max(a[e] for a in amaxes), conv))
        bits += sum(tensors[f"{m}.{k}"].nbytes * 8 for k in ("weight_packed", "weight_scale", "weight_global_scale"))
        mods.append(m)
    layers[path] = {"name": mods[0], "names": mods, "weight": _fmt_json(sch.weight),
                    "activation": _fmt_json(sch.activation), "experts": len(mods)}
    if sch.activation is not None:
        layers[path]["activation_scale"] = result.activation_scale
        if res.input_amax is not None:
            layers[path]["input_amax"] = list(res.input_amax)
    return size, bits, 0, 0


def export(model: nnx.Module, result: PTQResult, directory: str | Path, *,
           tensor_names: Mapping[str, str] | Callable[[str], str] | None = None,
           model_config: Mapping[str, Any] | None = None, tokenizer: Any = None,
           dtype: str | None = None, overwrite: bool = False) -> ExportReport:
    """Write `model` (after `jaxlowfp.ptq.quantize` with NVFP4 weights) to `directory` (module docstring).

    `tensor_names` maps an NNX parameter path (``blocks/0/attn/q_proj/kernel``) to its checkpoint name
    (``model.layers.0.self_attn.q_proj.weight``; a Linear kernel's name must end in ``.weight``), default the
    Hugging Face names for a `jaxlowfp.models.Llama`, else `default_name`. `model_config` is written as
    ``config.json`` with ``quantization_config`` added (default for a Llama: `models.export.hf_config`); `tokenizer` (a
    `jaxlowfp.models.Tokenizer`) is saved as ``tokenizer.json``. `dtype`: "float16", "bfloat16" or "float32" for
    the high-precision tensors of 2 or more dimensions; default (None) the dtype the model was quantized and
    evaluated in (`PTQResult.dtype`, chosen at `jaxlowfp.ptq.quantize_model`), so the file is the evaluated model and
    reloads bit for bit; another dtype warns (the file is then not the evaluated model: the warning counts the
    values the rounding changed). Refuses non-finite or zero scales, fused
    groups (q/k/v, gate/up) whose global scales differ, and returns an `ExportReport` (bits per parameter).

    Atomic (`write_atomically`): the checkpoint is written into a temporary sibling directory, then renamed to
    `directory`, so `directory` holds a whole export or is as it was; a `directory` that exists and is not empty
    is refused (`TargetExistsError`) unless ``overwrite=True`` (then it is replaced whole, never written into).
    """
    target_check(directory, overwrite)
    if not isinstance(result, PTQResult):
        raise TypeError(f"result must be the PTQResult of jaxlowfp.ptq.quantize; got {type(result).__name__}")
    schemes = {**result.schemes, **{p: r.scheme for p, r in result.experts.items() if r.scheme is not None}}
    bad = [p for p, s in schemes.items() if s.weight.kind not in WRITTEN_KINDS]
    if bad:
        raise ValueError(f"export writes NVFP4 and FP8 E4M3 weights; layers {bad[:4]} use "
                         f"{sorted({schemes[p].weight.name for p in bad})}")
    kinds = {s.weight.kind for s in schemes.values()}
    if len(kinds) > 1:
        raise ValueError(f"export writes one format per checkpoint (compressed-tensors' nvfp4-pack-quantized or "
                         f"float-quantized); this result mixes {sorted(kinds)}")
    fp8_experts = [p for p in result.experts if p in schemes and schemes[p].weight.kind == "fp8"]
    if fp8_experts:
        raise NotImplementedError(f"export: FP8 mixture-of-experts weights ({fp8_experts[:3]}) are not written yet; "
                                  f"NVFP4 experts are")
    fp8_acts = [p for p, s in schemes.items() if s.weight.kind == "fp8" and s.activation is not None
                and s.activation.kind != "fp8"]
    if fp8_acts:
        raise ValueError(f"export: FP8 weights take FP8 activations or none (W8A8, W8A16); layers {fp8_acts[:3]}")
    require_linear(model, {p: s for p, s in result.schemes.items() if p not in result.experts},
                   "export (compressed-tensors)")
    evaluated = getattr(result, "dtype", "float32")
    if dtype is None:
        dtype = evaluated
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(map(repr, _DTYPES))} or None (the "
                         f"dtype the model was quantized in, {evaluated!r})")
    said = _hf_names(model)  # the model's own names and config (jaxlowfp.ptq.protocol)
    per_expert = _expert_names(model)  # {expert weight path: [name of expert 0, 1, ...]}
    missing = sorted(set(result.experts) - set(per_expert))
    if missing:
        raise ValueError(f"export: the result quantized the expert weights {missing[:3]}, and "
                         f"{type(model).__name__}.export_tensors('hf') names no per-expert tensor for them "
                         f"(ExportTensor.expert); compressed-tensors stores one [out, in] matrix per expert")
    if tensor_names is None:
        tensor_names = said
    if model_config is None and said is not None:
        model_config = require_exportable(model, "hf", "export")[1]
    name_of = _namer(tensor_names)
    params = export_params(model)  # a packed model's packed parameters too (PackedView)
    linears = _linears(model)
    check_export_inputs(params, result, name_of)
    # (FP8 needs no equal scales: vLLM requantizes a fused group's weights to its largest scale, and the group's
    # layers read one input, so their calibrated input amax is one value)
    unfused = serving.vllm_fused_error(serving.name_groups([p for p in result.schemes if p not in result.experts
                                                            and p in result.packed]),
                                       {p: float(result.packed[p][1]) for p in result.schemes if p in result.packed})
    if unfused:
        raise ValueError("vLLM fuses these layers and decodes each group with its largest global scale, so their "
                         "global scales must be equal (quantize with fused='auto'): " + "; ".join(unfused[:3]))
    with write_atomically(directory, overwrite) as tmp:
        with stream.Spool(near=tmp) as spool:  # tensor by tensor: one on the host at a time (ptq/stream.py)
            report = _write(model, result, tmp, spool, params=params, linears=linears, name_of=name_of,
                            model_config=model_config, tokenizer=tokenizer, dtype=dtype, schemes=schemes,
                            per_expert=per_expert)
        _record_digests(tmp)
    _warn_not_evaluated(report, dtype, evaluated)
    return dataclasses.replace(report, directory=Path(directory))


def _warn_not_evaluated(report: ExportReport, dtype: str, evaluated: str) -> None:
    """Warn when the file's high-precision tensors are not the evaluated model's values."""
    import warnings

    changed, total = report.rounded
    if dtype != evaluated:
        warnings.warn(f"export: dtype={dtype!r} but the model was quantized and evaluated in {evaluated!r} "
                      f"(PTQResult.dtype): the file is not the evaluated model ({changed} of {total} high-precision "
                      f"values changed by the rounding; its scores differ). Export with dtype=None, or quantize with "
                      f"dtype={dtype!r} and evaluate that", UserWarning, stacklevel=3)
    elif changed:
        warnings.warn(f"export: {changed} of {total} high-precision values are not representable in {dtype!r}, the "
                      f"dtype the model was quantized in: the model was changed after jaxlowfp.ptq.quantize_model, "
                      f"so the file is not the evaluated model", UserWarning, stacklevel=3)


class TargetExistsError(FileExistsError, ValueError):
    """An export's target exists and is not empty (pass ``overwrite=True`` to replace it)."""


def target_check(target: str | Path, overwrite: bool, what: str = "export") -> None:
    """Refuse a `target` that exists and is not empty (a directory with files, or a file) unless `overwrite`:
    exporting into an older export would mix the two."""
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool; got {type(overwrite).__name__}")
    t = Path(target)
    if overwrite or not t.exists():
        return
    if t.is_dir():
        held = sorted(p.name for p in t.iterdir())
        if held:
            raise TargetExistsError(f"{what}: {t} is not empty ({', '.join(held[:4])}{' ...' if len(held) > 4 else ''}"
                                    f"); refusing to write into it. Pass overwrite=True to replace it, or choose "
                                    f"an empty or new directory")
    else:
        raise TargetExistsError(f"{what}: {t} exists; refusing to overwrite it. Pass overwrite=True to replace it")


@contextlib.contextmanager
def write_atomically(target: str | Path, overwrite: bool = False, *, directory: bool = True):
    """Yield a temporary sibling path of `target` (a new empty directory if `directory`, else a file path not yet
    made) to write into; on success it is renamed to `target` (an existing `target`, allowed by `overwrite`, is
    moved aside first and deleted after), on any error it is deleted: `target` is never seen half written."""
    target = Path(target)
    target_check(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = target.with_name(f".{target.name}.tmp-{tag}")
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        old = None
        if target.exists():
            target_check(target, overwrite)  # nothing appeared there meanwhile
            old = target.with_name(f".{target.name}.old-{tag}")
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
        raise


def _record_digests(directory: Path) -> None:
    """Add each written tensor's SHA-256 (`tensor_digests`) to ``jaxlowfp_ptq.json``: `load` verifies them."""
    meta_path = directory / META_FILE
    meta = json.loads(meta_path.read_text())
    meta["sha256"] = tensor_digests(directory / WEIGHTS_FILE)
    meta_path.write_text(json.dumps(meta, indent=1))


def _write(model: nnx.Module, result: PTQResult, directory: Path, spool: stream.Spool, *, params: dict,
           linears: dict, name_of: Callable[[str], str], model_config: Mapping[str, Any] | None, tokenizer: Any,
           dtype: str, schemes: Mapping[str, Scheme], per_expert: Mapping[str, list[str]]) -> ExportReport:
    conv = result.arithmetic
    tensors: dict[str, stream.SpoolEntry] = _Once()  # a name given twice raises: no layer silently overwritten
    layers: dict[str, Any] = {}
    n_quant = 0
    quant_bits = 0
    rounded = written_hp = 0
    for path, var in params.items():
        mod_path, leaf = path.rsplit("/", 1) if "/" in path else ("", path)
        if path in per_expert:
            n_q, b_q, r_hp, n_hp = _write_experts(path, var, per_expert[path], result, tensors, layers, dtype,
                                                  spool)
            n_quant, quant_bits = n_quant + n_q, quant_bits + b_q
            rounded, written_hp = rounded + r_hp, written_hp + n_hp
            continue
        name = name_of(path)
        if mod_path in result.schemes and leaf == "kernel" and result.schemes[mod_path].weight.kind == "fp8":
            if not name.endswith(".weight"):
                raise ValueError(f"{path}: the checkpoint name {name!r} of a quantized kernel must end in '.weight'")
            from jaxlowfp.ptq.packing import requantized

            m = name[: -len(".weight")]
            sch = result.schemes[mod_path]
            if isinstance(var, PackedView):  # a packed model: its own E4M3 codes [out, in] and scale
                if var.packed.format.kind != "fp8":
                    raise ValueError(f"{mod_path}: the packed model holds {var.packed.format.name} arrays; the PTQ "
                                     f"result quantized this layer to FP8 (is this another model's result?)")
                arr = var.packed.array
            else:
                arr = requantized(var[...], packing.as_format(sch.weight), mod_path).array  # E4M3 codes [out, in]
            if not (np.isfinite(float(arr.scale)) and float(arr.scale) > 0):
                raise ValueError(f"{m}: weight_scale is {float(arr.scale)}; refusing to export")
            tensors[f"{m}.weight"] = spool.put(np.asarray(stream.fetch(arr.codes)))
            tensors[f"{m}.weight_scale"] = spool.put(np.asarray(arr.scale, np.float32).reshape(1))
            layers[mod_path] = {"name": m, "weight": _fmt_json(sch.weight), "activation": _fmt_json(sch.activation)}
            if sch.activation is not None:
                layers[mod_path]["activation_scale"] = result.activation_scale
                if result.activation_scale == "static":
                    if mod_path not in result.act_amax:
                        raise ValueError(f"{mod_path}: a static FP8 W8A8 export needs the calibration activation "
                                         f"amax; run jaxlowfp.ptq.quantize with calibration data")
                    layers[mod_path]["input_amax"] = float(result.act_amax[mod_path])
                    tensors[f"{m}.input_scale"] = spool.put(_fp8_input_scale(m, result.act_amax[mod_path]))
            n_quant += int(np.prod(var.shape))
            quant_bits += sum(tensors[f"{m}.{k}"].nbytes * 8 for k in ("weight", "weight_scale"))
            continue
        if mod_path in result.schemes and leaf == "kernel":
            if mod_path not in result.packed:
                raise ValueError(f"{mod_path}: no packed NVFP4 weights in the result")
            if not name.endswith(".weight"):
                raise ValueError(f"{path}: the checkpoint name {name!r} of a quantized kernel must end in '.weight'")
            arr, s_enc = result.packed[mod_path]
            if isinstance(var, PackedView):  # a packed model: its own codes and scales, checked to be the result's
                arr, s_enc = same_packed_nvfp4(mod_path, var.packed, arr, s_enc)
            elif not bool(jnp.all(serving.decode(arr, s_enc, conv).T == var[...])):
                raise ValueError(f"{mod_path}: the model's kernel is not the packed NVFP4 weight (was the model "
                                 f"changed after quantize?)")
            m = name[: -len(".weight")]
            sch = result.schemes[mod_path]
            scales = stream.fetch(arr.scales)
            if sch.weight.rows > 1:  # 16x16 tiles -> one (equal) scale per row and 16 inputs
                scales = np.repeat(scales, sch.weight.rows, axis=0)
            _check_scales(m, scales, float(s_enc))
            tensors[f"{m}.weight_packed"] = spool.put(stream.fetch(arr.codes))
            tensors[f"{m}.weight_scale"] = spool.put(scales)
            tensors[f"{m}.weight_global_scale"] = spool.put(np.asarray(s_enc, np.float32).reshape(1))
            if sch.activation is not None:
                if mod_path not in result.act_amax:
                    raise ValueError(f"{mod_path}: W4A4 export needs the calibration activation amax for "
                                     f"input_global_scale; run jaxlowfp.ptq.quantize with calibration data")
                tensors[f"{m}.input_global_scale"] = spool.put(
                    _input_global_scale(m, result.act_amax[mod_path], conv))
            n_quant += int(np.prod(var.shape))
            quant_bits += sum(tensors[f"{m}.{k}"].nbytes * 8 for k in ("weight_packed", "weight_scale",
                                                                         "weight_global_scale"))
            layers[mod_path] = {"name": m, "weight": _fmt_json(sch.weight), "activation": _fmt_json(sch.activation)}
            if sch.activation is not None:  # how our run-time quantizer scaled it (load rebuilds it bit for bit)
                layers[mod_path]["activation_scale"] = result.activation_scale
                if result.activation_scale == "static":
                    layers[mod_path]["input_amax"] = float(result.act_amax[mod_path])
            continue
        value = np.asarray(stream.fetch(var[...]), np.float32)
        if leaf == "kernel" and mod_path in linears:
            value = value.T  # PyTorch [out, in]
        if value.ndim >= 2 and dtype != "float32":
            low = value.astype(_DTYPES[dtype])
            back = low.astype(np.float32)
            checks.check_finite_tensor(back, f"{name} ({path}) rounded to {dtype}",
                                       action="refusing to export (its values overflow it: use dtype='float32')")
            rounded += int(np.sum(back != value))
            written_hp += value.size
            value = low
        tensors[name] = spool.put(value)
        del value

    notes = known_gaps.check("hf", "", {}, {p: schemes[p].activation is not None for p in layers
                                            if schemes[p].weight.kind == "nvfp4"},
                             allow_known_gaps=True, caller="export")
    check_complete(schemes, layers, tensors, "export")  # every quantized layer of the result, before writing
    directory.mkdir(parents=True, exist_ok=True)
    stream.write_safetensors(directory / WEIGHTS_FILE, spool, tensors, metadata={"format": "pt"})
    # and in the file as written (its header read back; on an error write_atomically deletes the directory)
    check_complete(schemes, layers, _safetensors_names(directory / WEIGHTS_FILE), "export")
    groups: dict[str, dict[str, Any]] = {}
    fp8 = any(schemes[p].weight.kind == "fp8" for p in layers)
    fmt = "float-quantized" if fp8 else "nvfp4-pack-quantized"
    for act in (True, False):
        targets = sorted(n for p, v in layers.items() if (schemes[p].activation is not None) == act
                         for n in v.get("names", [v["name"]]))
        if targets:
            w_args = _fp8_quant_args(None) if fp8 else _quant_args(False)
            a_args = (_fp8_quant_args(result.activation_scale) if fp8 else _quant_args(True)) if act else None
            groups[f"group_{len(groups)}"] = {
                "targets": targets, "weights": w_args, "input_activations": a_args, "output_activations": None,
                "format": fmt}
    kept = {name_of(p)[: -len(".weight")] for p in params
            if p.rsplit("/", 1)[0] in linears and p.endswith("/kernel") and p.rsplit("/", 1)[0] not in result.schemes}
    kept |= {name_of(p)[: -len(".weight")] for p in params if p.endswith("/embedding")}  # embeddings
    kept.add("lm_head")  # a tied head is a module in Hugging Face models too
    kept |= {n[: -len(".weight")] for p, ns in per_expert.items() if p not in result.experts for n in ns}
    qcfg = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": groups, "kv_cache_scheme": None, "global_compression_ratio": None,
            "ignore": sorted(kept)}
    config = dict(model_config or {})
    config["quantization_config"] = qcfg
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer is not None:
        tokenizer.tokenizer.save(str(directory / "tokenizer.json"))
    partial = tuple(g for g in serving.name_groups(list(linears))
                    if 0 < sum(p in result.schemes for p in g) < len(g))
    meta = {"format": "jaxlowfp-ptq/2", "method": result.method, "layers": layers, "convention": conv,
            "fused": [list(g) for g in result.fused],
            "activation_scaling": f"ours: {result.activation_scale} (layers[].activation_scale; static: the "
                                  f"calibration amax); input_global_scale (static_6, what a serving engine "
                                  f"applies) is the calibration amax",
            "tensor_names": {p: (per_expert[p] if p in per_expert else name_of(p)) for p in params}}
    (directory / META_FILE).write_text(json.dumps(meta, indent=1))
    n_params = sum(int(np.prod(v.shape)) for v in params.values())
    total_bits = sum(t.nbytes * 8 for t in tensors.values())
    return ExportReport(directory=directory, bits_per_parameter=total_bits / n_params,
                        quantized_bits=quant_bits / max(n_quant, 1), quantized_fraction=n_quant / n_params,
                        fused=tuple(result.fused), partial=partial, arithmetic=conv, dtype=dtype,
                        rounded=(rounded, written_hp), notes=tuple(notes))


def _fp8_weight(m: str, tensors: Mapping[str, np.ndarray]) -> Any:
    """The `PackedWeight` of FP8 module `m` as written: E4M3 codes ``{m}.weight`` [out, in] and the per-tensor
    ``{m}.weight_scale``; it decodes as compressed-tensors does, ``f32(q) * s``."""
    codes, scale = tensors[f"{m}.weight"], np.asarray(tensors[f"{m}.weight_scale"], np.float32).reshape(-1)
    if codes.dtype != ml_dtypes.float8_e4m3fn or codes.ndim != 2:
        raise ValueError(f"{m}.weight: an FP8 weight is a 2-D float8_e4m3fn tensor; got {codes.dtype} "
                         f"{codes.shape}")
    if scale.size != 1 or not (np.isfinite(scale[0]) and scale[0] > 0):
        raise ValueError(f"{m}.weight_scale: one finite value > 0 per tensor; got {scale.tolist()[:4]}")
    arr = QArray(codes=jnp.asarray(codes), scales=None, global_scale=jnp.float32(scale[0]), format=Format(kind="fp8"),
                 dtype=jnp.dtype(jnp.float32), shape=tuple(codes.shape))
    return packing.PackedWeight(array=arr, s_enc=None, format=packing.Format(kind="fp8"),
                                k=int(codes.shape[1]), n=int(codes.shape[0]))


def _nvfp4_array(m: str, tensors: Mapping[str, np.ndarray], w_fmt: Format) -> tuple[QArray, jax.Array]:
    """The NVFP4 codes and scales of packed module `m` as written ([out, in]), and its encode scale S_enc."""
    codes, scales = tensors[f"{m}.weight_packed"], tensors[f"{m}.weight_scale"]
    g = tensors[f"{m}.weight_global_scale"]
    if codes.dtype != np.uint8 or codes.ndim != 2 or scales.dtype != ml_dtypes.float8_e4m3fn:
        raise ValueError(f"{m}: NVFP4 needs 2-D uint8 weight_packed and float8_e4m3fn weight_scale; got "
                         f"{codes.dtype} {codes.shape}, {scales.dtype} {scales.shape}")
    if scales.shape != (codes.shape[0], codes.shape[1] * 2 // 16) or codes.shape[1] % 8 or g.size != 1:
        raise ValueError(f"{m}: weight_scale {scales.shape} and weight_global_scale {g.shape} do not fit "
                         f"weight_packed {codes.shape} (one E4M3 scale per 16 values, one global scale)")
    s_enc = jnp.asarray(g.reshape(-1)[0], jnp.float32)
    if w_fmt.rows > 1:
        scales = scales[:: w_fmt.rows]
    out, half = codes.shape
    arr = QArray(codes=jnp.asarray(codes), scales=jnp.asarray(scales), global_scale=1.0 / s_enc, format=w_fmt,
                 dtype=jnp.dtype(jnp.float32), shape=(out, 2 * half))
    return arr, s_enc


def _decode(m: str, tensors: Mapping[str, np.ndarray], w_fmt: Format, convention: str) -> jax.Array:
    """The float32 [out, in] weight of packed module `m` (codes, block scales, global scale) as it was evaluated."""
    arr, s_enc = _nvfp4_array(m, tensors, w_fmt)
    return serving.decode(arr, s_enc, convention)


def _load_experts(model: nnx.Module, path: str, var: Any, names: list[str], meta: Mapping[str, Any],
                  tensors: Mapping[str, np.ndarray], packed: bool = False) -> Scheme | None:
    """Stack the per-expert tensors of `path` into its [E, in, out] parameter; quantized experts decoded in their
    convention (``packed``: kept as codes and scales, a `jaxlowfp.ptq.PackedExperts`), with the run-time
    activation quantizer of W4A4 experts (`jaxlowfp.ptq.experts.RaggedActQuant`)."""
    from jaxlowfp import ops
    from jaxlowfp import packed as packing
    from jaxlowfp.ptq.experts import RaggedActQuant, grouped_weights

    info = meta["layers"].get(path)
    mod, name = next((m, n) for p, m, n in grouped_weights(model) if p == path)
    convention = meta.get("convention", "jaxlowfp")
    if info is None:
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"tensors {missing[:3]} ({path}) are missing")
        value = np.stack([tensors[n].T for n in names])
    elif packed:
        from jaxlowfp.ptq.packing import PackedExperts

        w_fmt = _fmt_from(info["weight"])
        if w_fmt.kind != "nvfp4":
            raise NotImplementedError(f"{path}: packed=True loads NVFP4 experts; these are {w_fmt.name}")
        ws = [packing.from_nvfp4(*_nvfp4_array(m, tensors, w_fmt), arithmetic=convention) for m in info["names"]]
        shape = (len(ws), ws[0].k, ws[0].n)
        if shape != tuple(var.shape):
            raise ValueError(f"{path}: the per-expert packed tensors stack to {shape}; the parameter is "
                             f"{tuple(var.shape)}")
        setattr(mod, name, PackedExperts.stack(ws, kernel_dtype=var.dtype))
    else:
        w_fmt = _fmt_from(info["weight"])
        value = np.stack([np.asarray(_decode(m, tensors, w_fmt, convention)).T for m in info["names"]])
    if info is None or not packed:
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"{path}: the per-expert tensors stack to {value.shape}; the parameter is {var.shape}")
        var.set_value(jnp.asarray(value, var.dtype))
    if info is None:
        return None
    a_fmt = _fmt_from(info["activation"])
    if a_fmt is not None:
        amax = info.get("input_amax")
        setattr(mod, "quant_" + name, RaggedActQuant(a_fmt, info.get("activation_scale") or "token",
                                                     None if amax is None else tuple(amax), path,
                                                     ops.new_op_key(path)))
    return Scheme(weight=_fmt_from(info["weight"]), activation=a_fmt)


def load(model: nnx.Module, directory: str | Path, *, packed: bool = False, gemm: str = "auto",
         backend: str | None = None) -> dict[str, Scheme]:
    """Load a directory written by `export` into `model` (same architecture), in place: every parameter, NVFP4
    kernels decoded in the convention they were made in (``(q * s) * (1 / S_enc)`` or ``q * (s / S_enc)``), and the
    activation quantization of W4A4 layers. Returns {path: Scheme} of the quantized layers.

    ``packed=True``: each NVFP4 layer becomes a `jaxlowfp.ptq.PackedLinear` holding the file's codes, E4M3 block
    scales and global scale as they are (`jaxlowfp.packed.from_nvfp4`; nothing is decoded), run on `backend`
    (`jaxlowfp.backends`), with the activation quantizer the float load sets. `model` may be abstract
    (``nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))``): then no float copy of the quantized kernels is ever
    made, and the other parameters are filled from the file."""
    backend = renamed_kwarg("ptq.load", "backend", backend, "gemm", gemm, "auto")
    from jaxlowfp import packed as packing
    from jaxlowfp.ptq.packing import PackedLinear, replace_modules

    replaced: dict[str, tuple[nnx.Module, nnx.Module]] = {}
    directory = Path(directory)
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory}: no {META_FILE} (not written by jaxlowfp.ptq.export)")
    from jaxlowfp._core.errors import CheckpointError
    from jaxlowfp._core.safetensors_read import check_scales

    try:
        meta = json.loads(meta_path.read_text())
        names = meta["tensor_names"]
        if not (isinstance(names, dict) and isinstance(meta["layers"], dict)):
            raise TypeError("tensor_names and layers must be JSON objects")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta_path}: corrupt ({type(e).__name__}: {e})") from None
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: file not found")
    digests = meta.get("sha256")
    if digests is not None:  # written by export: every tensor's bytes as they were written
        got = tensor_digests(weights)
        bad = sorted(n for n in set(got) | set(digests) if got.get(n) != digests.get(n))
        if bad:
            raise CheckpointError(f"{weights}: tensor {bad[0]} (and {len(bad) - 1} more) "
                                  f"{'differs from' if bad[0] in got and bad[0] in digests else 'is not in'} what "
                                  f"export wrote ({META_FILE} records a SHA-256 of each tensor): the file is damaged "
                                  f"or from another export")
    tensors = read_safetensors(weights)  # header checked against the file, every float tensor finite
    check_scales(weights, tensors)
    params = _params(model)
    linears = linear_modules(model)
    missing = sorted(set(params) - set(names))
    if missing:
        raise CheckpointError(f"{directory}: the model has parameters the checkpoint does not name: {missing[:5]} "
                              f"(config.json and the weights do not belong together?)")
    need, optional = _expected_tensors(params, names, meta, linears)
    absent = sorted(need - set(tensors))
    if absent:
        raise CheckpointError(f"{weights}: tensors {absent[:5]} are missing ({len(absent)} in all)")
    extra = sorted(set(tensors) - need - optional)
    if extra:
        more = " ..." if len(extra) > 5 else ""
        raise CheckpointError(f"{weights}: tensors this model does not have: {extra[:5]}{more}"
                              f" ({len(extra)} in all; config.json describes a smaller model than the weights, or the "
                              f"directory mixes two exports)")
    for path, info in meta["layers"].items():
        amax = info.get("input_amax")
        vals = np.asarray([] if amax is None else amax, np.float64).reshape(-1)
        if not (np.isfinite(vals).all() and (vals >= 0).all()):
            raise CheckpointError(f"{meta_path}: layer {path} has input_amax {amax}; it must be finite and >= 0")
    schemes = {}
    for path, var in params.items():
        mod_path, leaf = path.rsplit("/", 1) if "/" in path else ("", path)
        if isinstance(names.get(path), list):  # a grouped expert weight [E, in, out], one tensor per expert
            sch = _load_experts(model, path, var, names[path], meta, tensors, packed)
            if sch is not None:
                schemes[path] = sch
            continue
        if mod_path in meta["layers"] and leaf == "kernel":
            info = meta["layers"][mod_path]
            w_fmt, a_fmt = _fmt_from(info["weight"]), _fmt_from(info["activation"])
            m = info["name"]
            lin = linears[mod_path]
            aq = None if a_fmt is None else act_quant(lin, a_fmt, activation_scale=info.get("activation_scale",
                                                                                             "tensor"),
                                                      amax=info.get("input_amax"), path=mod_path)
            schemes[mod_path] = Scheme(weight=w_fmt, activation=a_fmt)
            if w_fmt.kind == "fp8":
                w8 = _fp8_weight(m, tensors)
                if (w8.k, w8.n) != tuple(var.shape):
                    raise ValueError(f"{m}: FP8 weight is {(w8.n, w8.k)} (PyTorch [out, in]); the model's kernel "
                                     f"{path} is {tuple(var.shape)}")
                if packed:
                    act = None if a_fmt is None else packing.as_format(a_fmt, f"{mod_path} activation")
                    replaced[mod_path] = (lin, PackedLinear(w8, lin.bias, activation=act, gemm=backend,
                                                            dtype=lin.dtype, param_dtype=var.dtype, path=mod_path,
                                                            act_quant=aq))
                else:
                    var.set_value(w8.dequantize(jnp.float32).astype(var.dtype))
                    lin.dot_general = lax.dot_general if aq is None else nnx.data(aq)  # a Module: its record is state
                continue
            arr, s_enc = _nvfp4_array(m, tensors, w_fmt)
            out, half = arr.shape[0], arr.shape[1] // 2
            if packed:
                if (2 * half, out) != tuple(var.shape):
                    raise ValueError(f"{m}: packed weight is {(out, 2 * half)} (PyTorch [out, in]); the model's "
                                     f"kernel {path} is {tuple(var.shape)}")
                w = packing.from_nvfp4(arr, s_enc, arithmetic=meta.get("convention", "jaxlowfp"))
                act = None if a_fmt is None else packing.as_format(a_fmt, f"{mod_path} activation")
                replaced[mod_path] = (lin, PackedLinear(w, lin.bias, activation=act, gemm=backend,
                                                        dtype=lin.dtype, param_dtype=var.dtype, path=mod_path,
                                                        act_quant=aq))
                continue
            kernel = serving.decode(arr, s_enc, meta.get("convention", "jaxlowfp")).T
            if kernel.shape != var.shape:
                raise ValueError(f"{m}: packed weight is {kernel.shape[::-1]} (PyTorch [out, in]); the model's "
                                 f"kernel {path} is {var.shape}")
            var.set_value(kernel.astype(var.dtype))
            lin.dot_general = lax.dot_general if aq is None else nnx.data(aq)  # a Module: its record is state
            continue
        name = names[path]
        if name not in tensors:
            raise ValueError(f"{directory}: tensor {name} ({path}) is missing")
        value = tensors[name]
        if leaf == "kernel" and mod_path in linears:
            value = value.T
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"{name}: shape {value.shape} does not fit {path} {var.shape}")
        var.set_value(jnp.asarray(value, var.dtype))
    replace_modules(model, replaced)
    return schemes


# moved to jaxlowfp.models (ptq imports nothing of models: building a model from an export is the model's side)
__getattr__ = deprecated_getattr(__name__, {
    "load_model": ("jaxlowfp.models.load_export", "jaxlowfp.models:load_export"),
    "llama_hf_config": ("jaxlowfp.models.export.hf_config", "jaxlowfp.models.export:hf_config"),
})
