"""A GGUF file (llama.cpp's format) read as the specification lays it out (ggml-org/ggml ``docs/gguf.md``), its
tensor table validated before any tensor is mapped, its metadata decoded only when asked for.

Layout: magic ``GGUF``, version, tensor and key-value counts, the key-value pairs, then one ``(name, ggml type,
dims, offset)`` per tensor; the data section starts at the next multiple of ``general.alignment`` (default 32).
Little- or big-endian, as the version field says. Shared by the loaders (`jaxlowfp.models.gguf_loader`,
`jaxlowfp.models.moe_loader`) and `jaxlowfp.ptq.export_gguf`'s ``source_gguf``: `open_reader` validates the tensor
table (`check_tensor_infos`) before any tensor is mapped.

``gguf.GGUFReader`` builds one numpy view per element of every metadata array: SmolLM2's 49,152-token vocabulary
and 48,900 merges take seconds in each process that opens the file. `GGUFFile` walks the header once (lengths only),
keeps each value's offset, and decodes a value on ``contents()``. Its ``fields`` and ``tensors`` read as gguf-py's
(``types``, ``contents()``; ``name``, ``tensor_type``, ``shape`` innermost first, ``data`` a read-only map of the
file), which `tests/test_gguf_validation.py` checks against ``gguf.GGUFReader`` on every fixture and on files gguf-py
writes in both byte orders.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxlowfp._core.checks import optional_module
from jaxlowfp._core.errors import CheckpointError

gguf = optional_module("gguf", extra="models", feature="reading a GGUF file")

__all__ = ["GGUFFile", "check_tensor_infos", "open_reader", "read_tensor_table"]

# GGUF metadata value types (``gguf_metadata_value_type``) -> numpy dtype of one scalar; STRING = 8 and ARRAY = 9
_SCALARS = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_VERSIONS = (2, 3)  # GGUF v1 had 32-bit counts; llama.cpp and gguf-py read v2 and v3
_MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses more
_MAX_NESTING = 8  # arrays of arrays: a crafted file could nest them until the walk's recursion overflows
# tensor types whose data gguf-py maps as numbers; every other (block-quantized, BF16) as bytes [..., bytes per row]
_NUMERIC = {"F32": "f4", "F16": "f2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}


@dataclass(frozen=True)
class Field:
    """One metadata value: ``types`` (``[type]``, or ``[ARRAY, element type]``) and where it lies in the file."""

    name: str
    types: list[Any]
    _file: GGUFFile
    _offset: int  # the value's first byte (an array's: its first element's)
    _count: int  # elements of an array; 1 otherwise

    def __len__(self) -> int:
        return self._count

    def contents(self) -> Any:
        """The value as Python objects: a number, bool or str; an array as a list of them."""
        f, (head, *rest) = self._file, [int(t) for t in self.types]
        item = rest[0] if head == _ARRAY else head
        if item == _ARRAY:
            raise ValueError(f"metadata key {self.name!r} is an array of arrays, which this reader does not decode")
        if item == _STRING:
            out, offs = [], self._offset
            for _ in range(self._count):
                n = f.unpack("Q", offs)
                out.append(bytes(f.buf[offs + 8:offs + 8 + n]).decode("utf-8"))
                offs += 8 + n
        else:
            out = np.frombuffer(f.buf, f.endian + _SCALARS[item], self._count, self._offset).tolist()
        return out if head == _ARRAY else out[0]


@dataclass(frozen=True)
class Tensor:
    """One tensor: ``shape`` innermost dimension first (GGUF's order); ``data`` maps its bytes (numbers for the float
    and integer types, else ``uint8 [..., bytes per row]``), as ``gguf.GGUFReader`` maps them."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """A GGUF file's ``fields`` (key -> `Field`) and ``tensors`` (list of `Tensor`).

    The header is walked on construction: a header that runs past the file's end, an unknown value type, a key that
    appears twice, a bad alignment or more than four dimensions is a ValueError. ``tensors`` maps the data section
    on first use; check ``infos`` (`check_tensor_infos`) first, as `open_reader` does."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as fh:
            self.size = os.fstat(fh.fileno()).st_size
            if self.size < 24:
                raise ValueError(f"{self.size} bytes: shorter than a GGUF header (24 bytes)")
            self.buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        if self.buf[:4] != b"GGUF":
            raise ValueError(f"GGUF magic invalid ({bytes(self.buf[:4])!r})")
        # a byte-swapped file reads 0 in the version's low half
        self.endian = "<" if struct.unpack_from("<I", self.buf, 4)[0] & 0xFFFF else ">"
        version, n_tensors, n_kv = struct.unpack_from(self.endian + "IQQ", self.buf, 4)
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version}; readable: {', '.join(map(str, _VERSIONS))}")
        self._offs = 24
        self.fields: dict[str, Field] = {}
        self.alignment = 32
        for _ in range(n_kv):
            key = self._string().decode("utf-8", "replace")
            if key in self.fields:  # gguf-py refuses it too: which value would be meant?
                raise ValueError(f"metadata key {key!r} appears twice")
            vtype = self._take("I")
            start, count, types = self._skip_value(vtype)
            self.fields[key] = Field(key, types, self, start, count)
            if key == "general.alignment":
                if vtype != _UINT32:
                    raise ValueError(f"general.alignment has value type {vtype}; the specification's is UINT32")
                self.alignment = self.fields[key].contents()
                if self.alignment <= 0 or self.alignment & (self.alignment - 1):
                    raise ValueError(f"general.alignment {self.alignment} is not a power of two")
        self.infos: list[tuple[str, int, list[int], int]] = []
        for _ in range(n_tensors):
            name = self._string().decode("utf-8", "replace")
            n_dims = self._take("I")
            if n_dims > _MAX_DIMS:
                raise ValueError(f"tensor {name} has {n_dims} dimensions; GGUF tensors have at most {_MAX_DIMS}")
            dims = [self._take("Q") for _ in range(n_dims)]
            self.infos.append((name, self._take("I"), dims, self._take("Q")))
        self.data_start = self._offs + (-self._offs % self.alignment)
        self._tensors: list[Tensor] | None = None

    def unpack(self, fmt: str, offs: int) -> Any:
        """One value of struct format `fmt` at byte `offs`, in the file's byte order."""
        return struct.unpack_from(self.endian + fmt, self.buf, offs)[0]

    def _take(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        if self._offs + n > self.size:
            raise ValueError(f"the header runs past the end of the {self.size}-byte file (at byte {self._offs})")
        self._offs += n
        return self.unpack(fmt, self._offs - n)

    def _skip(self, n: int) -> None:
        if n < 0 or self._offs + n > self.size:
            raise ValueError(f"the header runs past the end of the {self.size}-byte file (at byte {self._offs})")
        self._offs += n

    def _string(self) -> bytes:
        n = self._take("Q")
        self._skip(n)
        return bytes(self.buf[self._offs - n:self._offs])

    def _skip_value(self, vtype: int, depth: int = 0) -> tuple[int, int, list[Any]]:
        """Step over one value of type `vtype`: ``(offset of its data, element count, its types)``."""
        if depth > _MAX_NESTING:
            raise ValueError(f"metadata arrays nested more than {_MAX_NESTING} deep (at byte {self._offs})")
        if vtype in _SCALARS or vtype == _STRING:
            start = self._offs
            self._skip(np.dtype(_SCALARS[vtype]).itemsize if vtype in _SCALARS else self._take("Q"))
            return start, 1, [gguf.GGUFValueType(vtype)]
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype} (at byte {self._offs})")
        item, count = self._take("I"), self._take("Q")
        start, types = self._offs, [gguf.GGUFValueType(_ARRAY)]
        if item in _SCALARS:
            self._skip(np.dtype(_SCALARS[item]).itemsize * count)
            return start, count, [*types, gguf.GGUFValueType(item)]
        if item not in (_STRING, _ARRAY):
            raise ValueError(f"unknown GGUF array element type {item} (at byte {self._offs})")
        sub = [gguf.GGUFValueType(item)]
        for _ in range(count):
            sub = self._skip_value(item, depth + 1)[2]
        return start, count, [*types, *sub]

    @property
    def tensors(self) -> list[Tensor]:
        """Every tensor, its data a read-only view of the file (made on first use)."""
        if self._tensors is None:
            self._tensors = [self._tensor(*info) for info in self.infos]
        return self._tensors

    def _tensor(self, name: str, raw_type: int, dims: list[int], offset: int) -> Tensor:
        ggml_type = gguf.GGMLQuantizationType(raw_type)
        shape = [int(d) for d in reversed(dims)]  # numpy order: outermost first
        begin = self.data_start + offset
        if ggml_type.name in _NUMERIC:
            data = np.frombuffer(self.buf, self.endian + _NUMERIC[ggml_type.name], int(np.prod(shape)), begin)
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
            shape[-1] = shape[-1] // block * type_size
            data = np.frombuffer(self.buf, np.uint8, int(np.prod(shape)), begin)
        return Tensor(name, ggml_type, np.asarray(dims, np.uint64), begin, data.reshape(shape))


def read_tensor_table(path: Path) -> tuple[list[tuple[str, int, list[int], int]], int, int]:
    """``(infos, data_start, alignment)`` of a GGUF file: one ``(name, ggml type, dims, offset from the data
    section)`` per tensor (`GGUFFile`; a ValueError for a header that is not GGUF)."""
    f = GGUFFile(path)
    return f.infos, f.data_start, f.alignment


def check_tensor_infos(path: Path, infos: list[tuple[str, int, list[int], int]], data_start: int, size: int,
                       alignment: int) -> None:
    """Validate a GGUF file's tensor table before any tensor is read, as safetensors validates its header: every
    ``(name, ggml type, dims, offset)`` has a known type, a first dimension that is a whole number of the type's
    blocks, an offset (from the data section's start) that is a multiple of ``general.alignment``, and its bytes
    (``n_elements / block_size * type_size``) inside the file; no two tensors share a name or overlap. A
    `CheckpointError` naming the file and the tensor otherwise (a truncated or corrupt file, never a tensor read
    from the wrong bytes)."""
    spans, seen = [], set()
    for name, raw_type, dims, offset in infos:
        where = f"{path}: tensor {name}"
        if name in seen:
            raise CheckpointError(f"{where} appears twice in the tensor table (a corrupt file?)")
        seen.add(name)
        try:
            ggml_type = gguf.GGMLQuantizationType(raw_type)
            block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise CheckpointError(f"{where} has the unknown ggml type {raw_type} (a corrupt tensor table?)") from None
        n = 1
        for d in dims:
            n *= int(d)
        if dims and int(dims[0]) % block:
            raise CheckpointError(f"{where}: its first dimension {int(dims[0])} is not a multiple of the "
                                  f"{ggml_type.name} block of {block} values (a corrupt tensor table?)")
        if offset % alignment:
            raise CheckpointError(f"{where}: data offset {offset} is not a multiple of general.alignment "
                                  f"{alignment} (a corrupt tensor table?)")
        begin, nbytes = data_start + offset, n // block * type_size
        if begin + nbytes > size:
            raise CheckpointError(f"{where} ({ggml_type.name} {[int(d) for d in dims]}: {nbytes} bytes at byte "
                                  f"{begin}) ends at byte {begin + nbytes}, past the end of the {size}-byte file: "
                                  f"the file is truncated")
        spans.append((begin, begin + nbytes, name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"{path}: tensor {b} starts at byte {begin}, inside tensor {a} (which ends at "
                                  f"byte {end}): a corrupt tensor table")


def _checked_reader(path: Path) -> GGUFFile:
    """The `GGUFFile` of `path` once its tensor table passed `check_tensor_infos`."""
    f = GGUFFile(path)
    check_tensor_infos(path, f.infos, f.data_start, f.size, f.alignment)
    return f


# The last files read, by (path, inode, size, mtime): one `jaxlowfp.models.load` opens each file twice (the
# mixture-of-experts check, then the loader). A rewritten file has another key; the readers are read-only maps.
_READERS: dict[tuple, GGUFFile] = {}


def open_reader(path: Path) -> GGUFFile:
    """The `GGUFFile` of `path` (its tensor table validated; the last two files read are reused); a CheckpointError
    for a file that is not a readable GGUF."""
    try:
        st = os.stat(path)
        key = (str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
        reader = _READERS.pop(key, None)
        if reader is None:
            reader = _checked_reader(path)
    except CheckpointError:
        raise
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file (truncated or corrupt?): {e}") from e
    _READERS[key] = reader  # the most recent last
    while len(_READERS) > 2:
        del _READERS[next(iter(_READERS))]
    return reader
