"""Load NVFP4 checkpoints written by other tools into `jaxlowfp.models.llama.Llama`: compressed-tensors
``nvfp4-pack-quantized`` directories (llm-compressor, and `jaxlowfp.ptq.export`) and ModelOpt's NVFP4 Hugging Face
layout. Weights are decoded exactly in the producer's arithmetic; W4A4 layers get the activation quantizer the
serving engine applies.

compressed-tensors (vllm-project/compressed-tensors 0.20: ``compressors/nvfp4/base.py``, ``helpers.py``,
``quantization/lifecycle/forward_helpers.py``), for a Linear ``<m>``::

    <m>.weight_packed uint8 [out, in/2] (element 2j in the low nibble, code = sign << 3 | E2M1 index),
    <m>.weight_scale float8_e4m3fn [out, in/16], <m>.weight_global_scale float32 [1] (ENCODE scale g),
    <m>.input_global_scale float32 [1] (W4A4)            w = q * (s / g)

ModelOpt (NVIDIA/TensorRT-Model-Optimizer, ``hf_quant_config.json`` with ``quant_algo: NVFP4``; the same layout
llama.cpp's converter reads, ``conversion/base.py: _nvfp4_pack``)::

    <m>.weight uint8 [out, in/2], <m>.weight_scale float8_e4m3fn [out, in/16], <m>.weight_scale_2 float32
    (DECODE scale, the reciprocal of compressed-tensors' g), <m>.input_scale float32 (activation decode scale)
                                                         w = (q * s) * weight_scale_2

Activations of W4A4 layers (``input_activations`` of the config group, or ModelOpt's ``NVFP4``): NVFP4 with block
scales from the current input and the stored static global scale, in compressed-tensors' arithmetic
(`jaxlowfp._core.ct_nvfp4.fake_quantize`, ``g = 1 / input_scale`` for ModelOpt).
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax import lax

from jaxlowfp._core import ct_nvfp4
from jaxlowfp._core.deprecation import renamed_kwarg
from jaxlowfp._core.minifloat import E2M1
from jaxlowfp._core.safetensors_read import check_scales, read_safetensors, safetensors_header
from jaxlowfp.models.common import CheckpointError, TensorSpec, Tokenizer, build_model, install_packed
from jaxlowfp.models.llama import Llama

__all__ = ["FORMATS", "NVFP4Act", "detect", "load_quantized", "check_scales", "read_safetensors",
           "safetensors_header"]

FORMATS = ("compressed-tensors", "modelopt")
_E2M1 = np.asarray(E2M1.decode(jnp.arange(16, dtype=jnp.uint8)), np.float32)


@dataclasses.dataclass(frozen=True)
class NVFP4Act:
    """The ``dot_general`` of a W4A4 layer loaded from a foreign checkpoint: NVFP4 input activations in
    compressed-tensors' arithmetic with the static encode scale `g` (block scales from the current input), then
    the plain ``lax.dot_general``. Hashable."""

    g: float

    def quantize_input(self, x):
        """The input as the engine quantizes it (`jaxlowfp._core.ct_nvfp4.fake_quantize` with `g`)."""
        return ct_nvfp4.fake_quantize(x, jnp.float32(self.g))

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
        x = self.quantize_input(lhs)
        return lax.dot_general(x, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kw)


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON: {e}") from e


def detect(directory: str | Path) -> str | None:
    """"compressed-tensors", "modelopt" or None (not a quantized checkpoint) for a Hugging Face directory; a
    quantization method we do not read raises `CheckpointError`."""
    directory = Path(directory)
    if (directory / "hf_quant_config.json").is_file():
        return "modelopt"
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        return None
    q = _json(cfg_path).get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return "compressed-tensors"
    if method == "modelopt":
        return "modelopt"
    raise CheckpointError(f"{cfg_path}: quantization_config.quant_method {method!r} is not supported; allowed: "
                          f"'compressed-tensors' (format nvfp4-pack-quantized), 'modelopt' (NVFP4)")


def _matches(name: str, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.fullmatch(p[3:], name) or re.match(p[3:], name):
                return True
        elif name == p or p == "Linear" or name.endswith("." + p):
            return True
    return False


def _ct_layers(where: Path, q: dict) -> dict[str, bool]:
    """{config group target pattern: W4A4} of a compressed-tensors config, checked: NVFP4 only."""
    fmt = q.get("format")
    out = {}
    for gname, g in (q.get("config_groups") or {}).items():
        w = g.get("weights") or {}
        gfmt = g.get("format") or fmt
        ok = (gfmt == "nvfp4-pack-quantized" and w.get("num_bits") == 4 and w.get("type") == "float"
              and w.get("strategy") == "tensor_group")
        if not ok:
            raise CheckpointError(f"{where}: config group {gname!r} is format {gfmt!r} with weights {w}; only "
                                  f"NVFP4 (format 'nvfp4-pack-quantized', 4-bit float, strategy 'tensor_group') is "
                                  f"supported")
        if w.get("group_size") != 16:
            raise CheckpointError(f"{where}: config group {gname!r} has group_size {w.get('group_size')}; NVFP4 "
                                  f"needs 16")
        a = g.get("input_activations")
        if a is not None and not (a.get("num_bits") == 4 and a.get("type") == "float" and a.get("group_size") == 16):
            raise CheckpointError(f"{where}: config group {gname!r} has input activations {a}; only NVFP4 (4-bit "
                                  f"float, group_size 16) or none is supported")
        for t in g.get("targets", []):
            out[t] = a is not None
    if not out:
        raise CheckpointError(f"{where}: quantization_config has no config_groups")
    return out


def _decode_ct(codes: np.ndarray, scales: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``q * (s / g)`` in float32 [out, in], compressed-tensors' decompression order."""
    out, half = codes.shape
    q = _E2M1[np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(out, half * 2)]
    step = scales.astype(np.float32) / np.float32(g.reshape(-1)[0])
    return (q.reshape(out, -1, 16) * step[..., None]).reshape(out, half * 2)


def _decode_modelopt(codes: np.ndarray, scales: np.ndarray, scale2: np.ndarray) -> np.ndarray:
    """``(q * s) * weight_scale_2`` in float32 (q * s is exact)."""
    out, half = codes.shape
    q = _E2M1[np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(out, half * 2)]
    qs = q.reshape(out, -1, 16) * scales.astype(np.float32)[..., None]
    return (qs * np.float32(scale2.reshape(-1)[0])).reshape(out, half * 2)


@dataclasses.dataclass(frozen=True)
class _Input:
    """A packed W4A4 layer's input quantizer (`NVFP4Act.quantize_input`), hashable."""

    act: NVFP4Act

    def __call__(self, x):
        return self.act.quantize_input(x)


def _packed_weight(kind: str, codes: np.ndarray, scales: np.ndarray, g: float) -> Any:
    """The `jaxlowfp.packed.PackedWeight` of W'^T = [out, in] from the file's arrays as they are (no decoding):
    compressed-tensors decodes ``q * (s / g)`` (g the encode scale), ModelOpt ``(q * s) * weight_scale_2``."""
    from jaxlowfp import packed
    from jaxlowfp._core.format import Format
    from jaxlowfp._core.qarray import QArray

    out, half = codes.shape
    s_dec = np.float32(1.0) / np.float32(g) if kind == "compressed-tensors" else np.float32(g)
    fmt = Format(kind="nvfp4", arithmetic="compressed-tensors" if kind == "compressed-tensors" else None)
    arr = QArray(codes=jnp.asarray(codes), scales=jnp.asarray(scales), global_scale=jnp.float32(s_dec), format=fmt,
                 dtype=jnp.dtype(jnp.float32), shape=(out, 2 * half))
    if kind == "compressed-tensors":
        return packed.from_nvfp4(arr, jnp.float32(g), arithmetic="compressed-tensors")
    return packed.from_nvfp4(arr)


def load_quantized(directory: str | Path, *, dtype: str = "float32", param_dtype: str = "float32",
                   mesh: Any = None, rules: Any = None, tokenizer: str | Path | None = "auto",
                   packed: bool = False, gemm: str = "auto", backend: str | None = None
                   ) -> tuple[Llama, Tokenizer | None]:
    """`Llama` (weights decoded exactly, W4A4 activation quantizers set) and `Tokenizer` of a compressed-tensors
    or ModelOpt NVFP4 directory (module docstring); ``mesh``, ``rules``: placed as `build_model` places them
    (each tensor decoded whole on the host, then sharded).

    ``packed=True``: each NVFP4 layer is a `jaxlowfp.ptq.PackedLinear` holding the file's uint8 codes, E4M3 block
    scales and global scale as they are (nothing is decoded: no float copy of those kernels is ever made), run on
    the GEMM backend `gemm` (`jaxlowfp.backends`; ``backend=`` is its deprecated name; W4A4 inputs quantized as the
    float load's `NVFP4Act` does, then the weights-only product, so "auto" / "dequant"); with ``mesh``, placed as
    their kernel's rule places ``W'`` (`jaxlowfp.sharding.packed_shardings`)."""
    gemm = renamed_kwarg("models.quantized.load_quantized", "backend", backend, "gemm", gemm, "auto")
    from jaxlowfp.models import hf_loader  # needs the jaxlowfp[models] extra

    directory = Path(directory)
    kind = detect(directory)
    if kind is None:
        raise CheckpointError(f"{directory}: not a quantized checkpoint (no quantization_config in config.json, no "
                              f"hf_quant_config.json)")
    config = hf_loader.read_config(directory, dtype=dtype, param_dtype=param_dtype)
    if kind == "compressed-tensors" and _json(directory / "config.json")["quantization_config"].get(
            "format") == "float-quantized":
        raise CheckpointError(f"{directory}: compressed-tensors format 'float-quantized' (FP8); models.load reads "
                              f"only NVFP4 ('nvfp4-pack-quantized') checkpoints of any producer, and "
                              f"jaxlowfp.models.load_export(directory) the FP8 ones jaxlowfp.ptq.export wrote")
    if kind == "compressed-tensors":
        qcfg = _json(directory / "config.json")["quantization_config"]
        targets = _ct_layers(directory / "config.json", qcfg)
        ignore = list(qcfg.get("ignore") or [])
        packed_name, scale_names = "weight_packed", ("weight_scale", "weight_global_scale")
    else:
        hq = directory / "hf_quant_config.json"
        qcfg = _json(hq).get("quantization", {}) if hq.is_file() else _json(directory / "config.json")[
            "quantization_config"]
        algo = qcfg.get("quant_algo")
        if algo not in ("NVFP4", "W4A16_NVFP4"):
            raise CheckpointError(f"{directory}: ModelOpt quant_algo {algo!r} is not supported; allowed: 'NVFP4', "
                                  f"'W4A16_NVFP4'")
        if qcfg.get("group_size", 16) != 16:
            raise CheckpointError(f"{directory}: ModelOpt group_size {qcfg.get('group_size')}; NVFP4 needs 16")
        targets = {"Linear": algo == "NVFP4"}
        ignore = [p.replace("*", ".*") for p in qcfg.get("exclude_modules") or []]
        ignore = [f"re:{p}" for p in ignore]
        packed_name, scale_names = "weight", ("weight_scale", "weight_scale_2")
    tok = hf_loader.checkpoint_tokenizer(directory, tokenizer, config.vocab)
    files = hf_loader.weight_files(directory)
    handles: dict[Path, dict[str, np.ndarray]] = {}
    acts: dict[str, float] = {}
    packs: dict[str, Any] = {}
    used: set[str] = set()

    def get(name: str) -> np.ndarray:
        f = files.get(name)
        if f is None:
            raise CheckpointError(f"{directory}: tensor {name} is missing")
        if f not in handles:
            handles[f] = read_safetensors(f)
            check_scales(f, handles[f])
        if name not in handles[f]:
            raise CheckpointError(f"{f}: tensor {name} is missing (the index lists it in this file)")
        used.add(name)
        return handles[f][name]

    def fetch(spec: TensorSpec) -> tuple[np.ndarray, str] | None:  # None: the layer is packed, no float kernel
        m = spec.hf[: -len(".weight")] if spec.hf.endswith(".weight") else None
        quant = (spec.transpose and m is not None and not _matches(m, ignore) and
                 any(_matches(m, [t]) for t in targets) and f"{m}.{scale_names[0]}" in files)
        if not quant or m is None:
            return np.asarray(get(spec.hf), np.float32), f"{files.get(spec.hf)}: tensor {spec.hf}"
        codes = get(f"{m}.{packed_name}")
        scales, gs = get(f"{m}.{scale_names[0]}"), get(f"{m}.{scale_names[1]}")
        where = f"{files[f'{m}.{packed_name}']}: tensor {m}.{packed_name}"
        if codes.dtype != np.uint8 or scales.dtype != ml_dtypes.float8_e4m3fn:
            raise CheckpointError(f"{where}: NVFP4 needs uint8 codes and float8_e4m3fn scales; got {codes.dtype}, "
                                  f"{scales.dtype}")
        if scales.shape != (codes.shape[0], codes.shape[1] * 2 // 16):
            raise CheckpointError(f"{where}: scales {scales.shape} do not fit codes {codes.shape} with groups of 16")
        gv = np.asarray(gs, np.float32).reshape(-1)
        if gv.size != 1 or not np.isfinite(gv[0]) or gv[0] <= 0:
            raise CheckpointError(f"{where}: global scale {gv.tolist()} must be one finite value > 0")
        w4a4 = any(_matches(m, [t]) and a for t, a in targets.items())
        mod_path = spec.path.rsplit("/", 1)[0]
        if w4a4 and kind == "compressed-tensors":
            acts[mod_path] = float(np.asarray(get(f"{m}.input_global_scale"), np.float32).reshape(-1)[0])
        elif w4a4:
            a = float(np.asarray(get(f"{m}.input_scale"), np.float32).reshape(-1)[0])
            acts[mod_path] = float(np.float32(1.0) / np.float32(a))
        if packed:
            packs[mod_path] = _packed_weight(kind, codes, scales, float(gv[0]))
            return None
        w = _decode_ct(codes, scales, gv) if kind == "compressed-tensors" else _decode_modelopt(codes, scales, gv)
        return w, where

    model = build_model(config, fetch, directory / "config.json", mesh=mesh, rules=rules)
    leftover = sorted(n for n in files if n not in used and not n.endswith(("rotary_emb.inv_freq", "input_scale",
                                                                              "input_global_scale", "k_scale",
                                                                              "v_scale"))
                      and not (config.tie_embeddings and n == "lm_head.weight"))
    if leftover:
        raise CheckpointError(f"{directory}: tensors this model does not use: {', '.join(leftover[:5])} (an "
                              f"unsupported architecture variant or quantization target?)")
    mods = {"/".join(map(str, p)): x for p, x in nnx.iter_graph(model) if isinstance(x, nnx.Linear)}
    for path, g in acts.items():
        if not (np.isfinite(g) and g > 0):
            raise CheckpointError(f"{directory}: layer {path} has an activation global scale {g}; it must be "
                                  f"finite and > 0")
        if path not in packs:
            mods[path].dot_general = NVFP4Act(g)
    if packs:
        install_packed(model, packs, gemm=gemm, source=directory, mesh=mesh, rules=rules,
                       act_fns={p: _Input(NVFP4Act(g)) for p, g in acts.items() if p in packs})
    return model, tok
