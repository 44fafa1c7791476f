"""A GGUF file's tensor table is validated before any tensor is read (issue 45, item 4): a truncated file, a tensor
whose bytes overlap another's, a misaligned offset or an unknown type is a `CheckpointError` naming the file and the
tensor, never a model built from the wrong bytes (gguf-py's reader maps whatever the table says)."""
import shutil
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlowfp.models import CheckpointError, load

SRC = Path(__file__).parent / "fixtures" / "interop" / "llama3_tiny.gguf"  # a tiny llama written by gguf-py


def _copy(tmp_path):
    p = tmp_path / "m.gguf"
    shutil.copyfile(SRC, p)
    return p


def _tensor(p, name):
    r = gguf.GGUFReader(p, "r+")  # writable memmap: a table entry changed here is changed in the file
    return r, next(t for t in r.tensors if t.name == name)


def _edit(p, name, part, value):
    """Set part `part` of tensor `name`'s table entry in the file at `p` (4: the ggml type, 5: the data offset) to
    ``value(its current value)``, in place."""
    r, t = _tensor(p, name)
    t.field.parts[part][0] = value(t.field.parts[part][0])
    r.data.flush()


def test_the_fixture_loads():
    model, _ = load(SRC)
    assert model.config.n_layers == 2


@pytest.mark.parametrize("cut, tensor", [(1, "output_norm.weight"), (100, "output_norm.weight"),
                                         (270144 - 72522, "blk.0.attn_q.weight")])
def test_truncated_names_the_file_and_the_first_tensor_past_the_end(tmp_path, cut, tensor):
    p = _copy(tmp_path)
    raw = p.read_bytes()
    assert len(raw) == 270144
    p.write_bytes(raw[:-cut])
    with pytest.raises(CheckpointError, match=rf"{p}: tensor {tensor} .*past the end of the {len(raw) - cut}-byte "
                                              rf"file: the file is truncated"):
        load(p)


def test_overlapping_tensors_are_refused(tmp_path):
    p = _copy(tmp_path)
    _, q = _tensor(p, "blk.0.attn_q.weight")
    q_start = int(q.field.parts[5][0])
    _edit(p, "blk.0.attn_k.weight", 5, lambda _: q_start + 32)  # k's bytes now start inside q's (aligned: 32)
    with pytest.raises(CheckpointError, match=rf"{p}: tensor blk.0.attn_k.weight starts at byte \d+, inside tensor "
                                              rf"blk.0.attn_q.weight"):
        load(p)


def test_misaligned_offset_and_unknown_type_are_refused(tmp_path):
    p = _copy(tmp_path)
    _edit(p, "blk.1.ffn_up.weight", 5, lambda offset: offset + 4)
    with pytest.raises(CheckpointError, match=rf"{p}: tensor blk.1.ffn_up.weight: data offset \d+ is not a multiple "
                                              rf"of general.alignment 32"):
        load(p)
    p = _copy(tmp_path)
    _edit(p, "blk.1.ffn_up.weight", 4, lambda _: 250)
    with pytest.raises(CheckpointError, match=rf"{p}: tensor blk.1.ffn_up.weight has the unknown ggml type 250"):
        load(p)


def _rename(p, old: bytes, new: bytes) -> None:
    """Overwrite the first `old` in the file's header with `new` (the same length)."""
    raw = bytearray(p.read_bytes())
    at = raw.index(old)
    raw[at:at + len(old)] = new
    p.write_bytes(bytes(raw))


def test_a_name_that_appears_twice_is_refused(tmp_path):
    """Two tensors of one name, or two metadata values of one key: a CheckpointError naming the file and the name,
    not the last one silently winning (gguf-py's reader refuses both too)."""
    p = _copy(tmp_path)
    _rename(p, b"blk.0.attn_k.weight", b"blk.0.attn_q.weight")
    with pytest.raises(CheckpointError, match=rf"{p}: tensor blk.0.attn_q.weight appears twice in the tensor table"):
        load(p)
    p = _copy(tmp_path)
    _rename(p, b"llama.block_count", b"general.file_type")
    with pytest.raises(CheckpointError, match=rf"{p}: not a readable GGUF.*metadata key 'general.file_type' appears "
                                              rf"twice"):
        load(p)


def test_arrays_nested_without_end_are_a_named_error(tmp_path):
    """A crafted header of arrays nested 5,000 deep (12 bytes a level) is a CheckpointError, not a RecursionError."""
    import struct

    p = tmp_path / "deep.gguf"
    level = struct.pack("<IQ", 9, 1)  # element type ARRAY, count 1
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"x" + struct.pack("<I", 9)
                  + level * 5000 + struct.pack("<IQ", 4, 1) + b"\0" * 4)
    with pytest.raises(CheckpointError, match=rf"{p}: not a readable GGUF.*arrays nested more than 8 deep"):
        load(p)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(where=st.floats(0, 1, exclude_max=True))
def test_cut_anywhere_is_a_named_error(where):
    """A copy cut at any byte is a CheckpointError naming the file (hypothesis: 25 cut points)."""
    import tempfile

    raw = SRC.read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "cut.gguf"
        p.write_bytes(raw[: int(where * len(raw))])
        with pytest.raises(CheckpointError, match=str(p)):
            load(p)


def _written(path, endianess):
    """A small GGUF file written by gguf-py: metadata of every kind (strings, string, number and nested arrays,
    scalars), a non-default alignment and tensors of five types (F32, F16, I32, Q8_0, BF16)."""
    import numpy as np

    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    w.add_custom_alignment(64)
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "", "é"])
    w.add_array("x.numbers", [1, 2, 3])
    w.add_array("x.nested", [[1, 2], [3]])
    w.add_string("x.name", "tiny")
    w.add_float32("x.eps", 1e-5)
    w.add_bool("x.flag", True)
    w.add_tensor("a.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("b.weight", np.ones((3, 5), np.float16))
    w.add_tensor("c.weight", np.zeros((1, 7), np.int32))
    q8 = gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("d.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("e.weight", np.arange(32, dtype=np.uint16).reshape(1, 32), raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_file_is_read_as_gguf_py_reads_it(tmp_path):
    """`GGUFFile` (the loaders' own reading of a GGUF file, no gguf-py reader) gives every metadata value (types and
    contents), every tensor (name, type, dimensions, data offset, the mapped data's dtype, shape and bytes), the data
    section's start and the alignment that gguf-py's ``GGUFReader`` gives: the fixtures, and files gguf-py writes in
    both byte orders with strings, arrays, scalars, a custom alignment and float, integer and block-quantized
    tensors. `read_tensor_table` lists the table `check_tensor_infos` validates."""
    import numpy as np

    from jaxlowfp._core.gguf_read import GGUFFile, open_reader
    from jaxlowfp.models.gguf_loader import read_tensor_table  # the public name

    files = [SRC, *sorted((SRC.parents[1] / "moe").glob("*.gguf"))]
    files += [_written(tmp_path / f"{e.name}.gguf", e) for e in (gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG)]
    for p in files:
        ours, theirs = GGUFFile(p), gguf.GGUFReader(p)
        kv = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # gguf-py's header pseudo-keys
        assert list(ours.fields) == list(kv), p
        for k, f in kv.items():
            assert ours.fields[k].types == f.types, (p, k)
            if f.types[:2] == [gguf.GGUFValueType.ARRAY] * 2:  # walked over (the keys after it read right), refused
                with pytest.raises(ValueError, match=f"{k!r} is an array of arrays"):
                    ours.fields[k].contents()
                continue
            assert ours.fields[k].contents() == f.contents(), (p, k)
            assert len(ours.fields[k]) == len(f.data), (p, k)
        assert len(ours.tensors) == len(theirs.tensors) > 0, p
        for a, b in zip(ours.tensors, theirs.tensors):
            assert (a.name, a.tensor_type, [int(x) for x in a.shape], a.data_offset) == (
                b.name, b.tensor_type, [int(x) for x in b.shape], int(b.data_offset)), (p, b.name)
            assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape), (p, b.name)
            assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), (p, b.name)
        infos, start, alignment = read_tensor_table(p)
        assert [(n, t, d, start + o) for n, t, d, o in infos] == [
            (t.name, int(t.tensor_type), [int(x) for x in t.shape], int(t.data_offset)) for t in theirs.tensors], p
        assert (start, alignment) == (theirs.data_offset, theirs.alignment), p
    assert alignment == 64 and len(infos) == 5
    assert open_reader(SRC) is open_reader(SRC)  # parsed once


def test_a_metadata_value_that_cannot_be_decoded_is_a_named_error(tmp_path):
    """A string that is not UTF-8 is a CheckpointError naming the file and the key when the loader reads it."""
    from jaxlowfp.models import gguf_loader

    p = _copy(tmp_path)
    raw = bytearray(p.read_bytes())
    at = raw.index(b"llama", raw.index(b"general.architecture") + len("general.architecture"))
    raw[at] = 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"{p}: metadata key 'general.architecture' cannot be read"):
        load(p)
    with pytest.raises(CheckpointError, match="general.architecture"):
        gguf_loader.read_field(gguf_loader.open_reader(p), "general.architecture", p)
