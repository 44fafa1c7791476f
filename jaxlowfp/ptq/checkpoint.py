"""Export of a PTQ'd model's NVFP4 weights as a compressed-tensors ``nvfp4-pack-quantized`` checkpoint (the writer).

The reader is `jaxlowfp.ptq.checkpoint_load` (``load``, re-exported here), the file's names and tensors per layer
`jaxlowfp.ptq.export_layout`, the all-or-nothing directory write `jaxlowfp.ptq.atomic`.

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

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxlowfp._core.deprecation import deprecated_getattr
from jaxlowfp import nvfp4
from jaxlowfp import packed as packing
from jaxlowfp._core import ct_nvfp4
from jaxlowfp.ptq import checks, known_gaps, serving, stream
from jaxlowfp.ptq.protocol import Exportable, require_exportable
from jaxlowfp.ptq.api import PTQResult
from jaxlowfp.ptq.layers import require_linear
from jaxlowfp.ptq.formats import Scheme
from jaxlowfp.scaling import CurrentScaling
from jaxlowfp.ptq.atomic import TargetExistsError, record_digests, target_check, write_atomically
from jaxlowfp.ptq.checkpoint_load import load
from jaxlowfp.ptq.export_layout import (META_FILE, WEIGHTS_FILE, PackedView, UniqueNames, check_complete,
                                        check_finite_param, ct_quant_args, default_name, export_params, format_json,
                                        linear_layers, namer, read_safetensors, safetensors_names, same_packed_nvfp4,
                                        tensor_digests)

# the old import paths of what moved out (the reader, the file layout, the atomic write) keep working
__all__ = ["export", "ExportReport", "load", "read_safetensors", "tensor_digests", "default_name", "export_params",
           "PackedView", "check_finite_param", "same_packed_nvfp4", "check_complete", "check_export_inputs",
           "TargetExistsError", "target_check", "write_atomically", "META_FILE", "WEIGHTS_FILE", "WRITTEN_KINDS"]

_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


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
        if t.expert is not None and t.path is not None:
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
        elif w is not None and not np.array_equal(np.asarray(serving.decode(arr, s_enc, conv)).T, w[e]):
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
    layers[path] = {"name": mods[0], "names": mods, "weight": format_json(sch.weight),
                    "activation": format_json(sch.activation), "experts": len(mods)}
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
    name_of = namer(tensor_names)
    params = export_params(model)  # a packed model's packed parameters too (PackedView)
    linears = linear_layers(model)
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
        record_digests(tmp)
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


def _write(model: nnx.Module, result: PTQResult, directory: Path, spool: stream.Spool, *, params: dict,
           linears: dict, name_of: Callable[[str], str], model_config: Mapping[str, Any] | None, tokenizer: Any,
           dtype: str, schemes: Mapping[str, Scheme], per_expert: Mapping[str, list[str]]) -> ExportReport:
    conv = result.arithmetic
    tensors: dict[str, stream.SpoolEntry] = UniqueNames()  # a name given twice raises: no layer silently overwritten
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
            layers[mod_path] = {"name": m, "weight": format_json(sch.weight), "activation": format_json(sch.activation)}
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
            layers[mod_path] = {"name": m, "weight": format_json(sch.weight), "activation": format_json(sch.activation)}
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
    check_complete(schemes, layers, safetensors_names(directory / WEIGHTS_FILE), "export")
    groups: dict[str, dict[str, Any]] = {}
    fp8 = any(schemes[p].weight.kind == "fp8" for p in layers)
    fmt = "float-quantized" if fp8 else "nvfp4-pack-quantized"
    for act in (True, False):
        targets = sorted(n for p, v in layers.items() if (schemes[p].activation is not None) == act
                         for n in v.get("names", [v["name"]]))
        if targets:
            w_args = _fp8_quant_args(None) if fp8 else ct_quant_args(False)
            a_args = (_fp8_quant_args(result.activation_scale) if fp8 else ct_quant_args(True)) if act else None
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


# moved to jaxlowfp.models (ptq imports nothing of models: building a model from an export is the model's side)
__getattr__ = deprecated_getattr(__name__, {
    "load_model": ("jaxlowfp.models.load_export", "jaxlowfp.models:load_export"),
    "llama_hf_config": ("jaxlowfp.models.export.hf_config", "jaxlowfp.models.export:hf_config"),
})
