"""Exports written tensor by tensor: the host holds one tensor at a time, never the whole model or file.

A sharded model's arrays live on many devices (and, multi-host, on many processes). The exporters fetch one
tensor's shards to the host (`fetch`), turn it into its file layout, check it, and put its bytes in a `Spool` (a
temporary file next to the output), dropping it before the next one. Once every tensor has passed its checks the
file is written from the spool:

- safetensors (`write_safetensors`): the format's header lists every tensor's dtype, shape and byte range, with
  the tensors ordered by descending dtype, then name, and the JSON header padded with spaces to a multiple of 8
  bytes (huggingface/safetensors, ``safetensors/src/tensor.rs``: ``prepare`` and ``serialize``), so the file is
  byte for byte what ``safetensors.numpy.save_file`` writes for the same arrays;
- GGUF: ``gguf.GGUFWriter.add_tensor_info`` for every tensor, then ``write_tensor_data`` one tensor at a time
  (``gguf-py/gguf/gguf_writer.py``), byte for byte what ``add_tensor`` + ``write_tensors_to_file`` write.

Peak host memory is then about one tensor (plus its float32 copy while checked), not the file.
"""
from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

__all__ = ["SAFETENSORS_DTYPES", "Spool", "SpoolEntry", "fetch", "write_safetensors"]

# numpy dtype -> safetensors dtype name, in safetensors' own ``Dtype`` order (the header sorts by it, descending)
SAFETENSORS_DTYPES = {
    np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8",
    np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(np.int16): "I16", np.dtype(np.uint16): "U16", np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.int32): "I32", np.dtype(np.uint32): "U32",
    np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.int64): "I64", np.dtype(np.uint64): "U64",
}
_RANK = {name: i for i, name in enumerate(SAFETENSORS_DTYPES.values())}
_CHUNK = 1 << 24  # bytes copied at a time from the spool into the file


def fetch(x: Any) -> np.ndarray:
    """One tensor's value on the host: its shards copied from their devices (every process's, gathered, when it
    spans processes: `jaxlowfp.sharding.to_host`, a collective), nothing else of the model.

    ``np.asarray`` of a `jax.Array` that had to be copied to the host (a sharded one, or any on an accelerator)
    keeps that copy cached on the array (``jax.Array._value``), so converting every parameter would leave the whole
    model on the host; here each shard is copied from a temporary device copy of it (which goes with its cache)
    into one host array, so the host holds the tensor and one shard. The temporary copy is a transfer
    (``jax.device_put(..., may_alias=False)``), not a jitted copy, so nothing compiles per shard shape."""
    import jax

    from jaxlowfp.sharding import to_host

    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if not x.is_fully_addressable:
        return to_host(x)
    out = np.empty(x.shape, x.dtype)
    for s in x.addressable_shards:
        if s.replica_id == 0:  # each distinct slice once
            out[s.index] = np.asarray(jax.device_put(s.data, may_alias=False))
    return out


class SpoolEntry(NamedTuple):
    offset: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]


class Spool:
    """Arrays appended to an unnamed temporary file as they are made (`put`), read back one at a time (`get`,
    `copy_to`); the file goes when the spool is closed (a context manager)."""

    def __init__(self, near: str | Path | None = None) -> None:
        """``near``: the output path; the spool goes into its closest existing folder (same disk as the output)."""
        where = None
        if near is not None:
            where = Path(near).absolute()
            while not where.is_dir():
                where = where.parent
        self._file = tempfile.TemporaryFile(dir=where)
        self._end = 0

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def put(self, a: np.ndarray) -> SpoolEntry:
        a = np.ascontiguousarray(a)
        self._file.seek(self._end)
        self._file.write(memoryview(a.reshape(-1).view(np.uint8)))
        entry = SpoolEntry(self._end, a.nbytes, a.dtype, tuple(a.shape))
        self._end += a.nbytes
        return entry

    def get(self, e: SpoolEntry) -> np.ndarray:
        self._file.seek(e.offset)
        out = np.empty(e.shape, e.dtype)
        self._file.readinto(memoryview(out.reshape(-1).view(np.uint8)))
        return out

    def chunks(self, e: SpoolEntry) -> Iterator[bytes]:
        done = 0
        while done < e.nbytes:
            self._file.seek(e.offset + done)
            b = self._file.read(min(_CHUNK, e.nbytes - done))
            done += len(b)
            yield b

    def copy_to(self, e: SpoolEntry, out: Any) -> None:
        for b in self.chunks(e):
            out.write(b)


def safetensors_header(entries: Mapping[str, SpoolEntry], metadata: Mapping[str, str] | None) -> tuple[bytes, list]:
    """The header bytes (8-byte little-endian length, JSON, space padding) and the tensors' names in file order."""
    for name, e in entries.items():
        if e.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{name}: safetensors has no dtype for {e.dtype}; allowed: "
                            f"{', '.join(sorted(map(str, SAFETENSORS_DTYPES)))}")
    order = sorted(entries, key=lambda n: (-_RANK[SAFETENSORS_DTYPES[entries[n].dtype]], n.encode()))
    head: dict[str, Any] = {} if not metadata else {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        e = entries[name]
        head[name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                      "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()  # serde_json's compact form
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, order


def write_safetensors(path: str | Path, spool: Spool, entries: Mapping[str, SpoolEntry],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write the spooled tensors ``{name: entry}`` as a .safetensors file (module docstring)."""
    header, order = safetensors_header(entries, metadata)
    with open(path, "wb") as out:
        out.write(header)
        for name in order:
            spool.copy_to(entries[name], out)
