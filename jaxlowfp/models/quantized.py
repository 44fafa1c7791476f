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
import struct
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax import lax

from jaxlowfp._core import ct_nvfp4
from jaxlowfp._core.minifloat import E2M1
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
    from jaxlowfp import nvfp4, packed

    out, half = codes.shape
    s_dec = np.float32(1.0) / np.float32(g) if kind == "compressed-tensors" else np.float32(g)
    arr = nvfp4.NVFP4Array(codes=jnp.asarray(codes), scales=jnp.asarray(scales), global_scale=jnp.float32(s_dec),
                           rule="static_6", block_shape=(1, 16), dtype=jnp.dtype(jnp.float32), shape=(out, 2 * half))
    if kind == "compressed-tensors":
        return packed.from_nvfp4(arr, jnp.float32(g), arithmetic="compressed-tensors")
    return packed.from_nvfp4(arr)


def load_quantized(directory: str | Path, *, dtype: str = "float32", param_dtype: str = "float32",
                   mesh: Any = None, rules: Any = None, tokenizer: str | Path | None = "auto",
                   packed: bool = False, backend: str = "auto") -> tuple[Llama, Tokenizer | None]:
    """`Llama` (weights decoded exactly, W4A4 activation quantizers set) and `Tokenizer` of a compressed-tensors
    or ModelOpt NVFP4 directory (module docstring); ``mesh``, ``rules``: placed as `build_model` places them
    (each tensor decoded whole on the host, then sharded).

    ``packed=True``: each NVFP4 layer is a `jaxlowfp.ptq.PackedLinear` holding the file's uint8 codes, E4M3 block
    scales and global scale as they are (nothing is decoded: no float copy of those kernels is ever made), run on
    `backend` (`jaxlowfp.backends`; W4A4 inputs quantized as the float load's `NVFP4Act` does, then the weights-only
    product, so "auto" / "dequant"); with ``mesh``, placed as their kernel's rule places ``W'``
    (`jaxlowfp.sharding.packed_shardings`)."""
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
                              f"jaxlowfp.ptq.load_model(directory) the FP8 ones jaxlowfp.ptq.export wrote")
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

    def fetch(spec: TensorSpec) -> tuple[np.ndarray, str]:
        m = spec.hf[: -len(".weight")] if spec.hf.endswith(".weight") else None
        quant = (spec.transpose and m is not None and not _matches(m, ignore) and
                 any(_matches(m, [t]) for t in targets) and f"{m}.{scale_names[0]}" in files)
        if not quant:
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
        install_packed(model, packs, backend=backend, source=directory, mesh=mesh, rules=rules,
                       act_fns={p: _Input(NVFP4Act(g)) for p, g in acts.items() if p in packs})
    return model, tok


_DTYPES = {"F32": np.float32, "U8": np.uint8, "F8_E4M3": ml_dtypes.float8_e4m3fn, "BF16": ml_dtypes.bfloat16,
           "F16": np.float16, "I32": np.int32, "I64": np.int64}
_FLOATS = ("F32", "F16", "BF16", "F8_E4M3")
_MAX_HEADER = 100_000_000  # the safetensors library's own limit on the header length


def safetensors_header(path: str | Path) -> tuple[dict[str, dict], int]:
    """The validated header of a .safetensors file, ``({name: {"dtype", "shape", "data_offsets"}}, data start)``:
    what the ``safetensors`` library checks before reading a tensor (``Metadata::validate``), with messages that
    name the file and the tensor. The header must be a JSON object of at most 100 MB; every tensor needs a
    supported dtype, a shape of non-negative integers and ``data_offsets [a, b]`` with ``b - a`` = its byte size;
    the tensors must tile the data section from 0 to the end of the file with no gap or overlap (so a truncated or
    padded file is refused before anything is read). Raises `CheckpointError`."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors file (8-byte header "
                                      f"length first)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: header length {n} does not fit the file ({size} bytes; at most "
                                      f"{_MAX_HEADER}): truncated or not a safetensors file")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (not UTF-8 JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
    start, data = 8 + n, size - 8 - n
    spans = []
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{where}: corrupt header entry {str(info)[:100]} (dtype, shape, data_offsets "
                                  f"expected)")
        dt, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if dt not in _DTYPES:
            raise CheckpointError(f"{where} has dtype {dt!r}; supported: {sorted(_DTYPES)}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise CheckpointError(f"{where}: data_offsets {offs!r} are not [begin, end] with 0 <= begin <= end")
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dt]).itemsize
        if offs[1] - offs[0] != nbytes:
            raise CheckpointError(f"{where}: data_offsets {offs} hold {offs[1] - offs[0]} bytes; {dt} {shape} "
                                  f"needs {nbytes}")
        if offs[1] > data:
            raise CheckpointError(f"{where}: data_offsets {offs} end past the file's data section ({data} bytes): "
                                  f"the file is truncated")
        spans.append((offs[0], offs[1], name))
        out[name] = info
    end = 0
    for a, b, name in sorted(spans):
        if a != end:
            raise CheckpointError(f"{path}: tensor {name} starts at byte {a} of the data section, where "
                                  f"{'a gap' if a > end else 'an overlap'} begins (the previous tensor ends at "
                                  f"{end}): corrupt header")
        end = b
    if end != data:
        raise CheckpointError(f"{path}: the tensors end at byte {end} of a {data}-byte data section "
                              f"({'trailing bytes' if data > end else 'truncated'}): corrupt or truncated file")
    return out, start


def read_safetensors(path: str | Path, *, check_finite: bool = True) -> dict[str, np.ndarray]:
    """All tensors of a .safetensors file as numpy arrays (float8_e4m3fn via ml_dtypes; the safetensors package's
    numpy reader has no fp8 type), after `safetensors_header` validated the header against the file.
    ``check_finite``: every floating-point tensor (F32, F16, BF16, F8_E4M3) must be finite: a NaN or Inf in a
    weight or a scale (a damaged file) is a `CheckpointError` naming the tensor, never a NaN model."""
    path = Path(path)
    header, start = safetensors_header(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read: {e}") from e
    if len(data) != start + sum(i["data_offsets"][1] - i["data_offsets"][0] for i in header.values()):
        raise CheckpointError(f"{path}: changed size while being read")
    out = {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[start + a: start + b], _DTYPES[info["dtype"]]).reshape(info["shape"])
        if check_finite and info["dtype"] in _FLOATS and not np.isfinite(arr.astype(np.float32)).all():
            bad = int((~np.isfinite(arr.astype(np.float32))).sum())
            raise CheckpointError(f"{path}: tensor {name} ({info['dtype']} {info['shape']}) has {bad} NaN/Inf "
                                  f"values (a damaged file?)")
        out[name] = arr
    return out


_PER_TENSOR_SCALES = ("weight_global_scale", "input_global_scale", "weight_scale_2", "input_scale")


def check_scales(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """The scales of a quantized checkpoint's tensors, by their compressed-tensors / ModelOpt names: per-tensor
    ones (``*.weight_global_scale``, ``*.input_global_scale``, ``*.weight_scale_2``, ``*.input_scale``) finite and
    > 0, block and per-tensor weight scales (``*.weight_scale``) finite and >= 0 (an all-zero block has scale 0).
    A non-positive global scale decodes to Inf or NaN: refused with a `CheckpointError` naming the tensor."""
    for name, t in tensors.items():
        suffix = name.rsplit(".", 1)[-1]
        if suffix not in _PER_TENSOR_SCALES and suffix != "weight_scale":
            continue
        if t.dtype.kind not in "fV":  # float32/16, and ml_dtypes' float8 / bfloat16
            continue
        v = np.asarray(t, np.float32)
        ok = np.isfinite(v) & ((v > 0) if suffix in _PER_TENSOR_SCALES else (v >= 0))
        if not ok.all():
            bad = v[~ok].reshape(-1)[:4].tolist()
            raise CheckpointError(f"{path}: tensor {name} has {int((~ok).sum())} scales that are not finite and "
                                  f"{'> 0' if suffix in _PER_TENSOR_SCALES else '>= 0'} (e.g. {bad}): a damaged "
                                  f"file or a broken export")
