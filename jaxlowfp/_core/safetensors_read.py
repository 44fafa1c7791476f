"""Reading .safetensors files without the ``safetensors`` package's torch or flax paths, and checking what they
hold: the header validated before anything is read (`safetensors_header`), every tensor as numpy
(`read_safetensors`, float8 via ml_dtypes) and the scales of a quantized checkpoint (`check_scales`).

Shared by the loaders (`jaxlowfp.models.quantized`, which re-exports these names) and by `jaxlowfp.ptq`'s export
and load; the file format is https://github.com/huggingface/safetensors (README, "Format").
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxlowfp._core.errors import CheckpointError

__all__ = ["check_scales", "read_safetensors", "safetensors_header"]

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
