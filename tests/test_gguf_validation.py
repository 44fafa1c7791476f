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
    """A small GGUF file written by gguf-py: metadata of every kind the header skips (strings, string and number
    arrays, scalars), a non-default alignment and tensors of three types."""
    import numpy as np

    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    w.add_custom_alignment(64)
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "", "é"])
    w.add_array("x.numbers", [1, 2, 3])
    w.add_string("x.name", "tiny")
    w.add_float32("x.eps", 1e-5)
    w.add_bool("x.flag", True)
    w.add_tensor("a.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("b.weight", np.ones((3, 5), np.float16))
    w.add_tensor("c.weight", np.zeros((1, 7), np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_tensor_table_is_read_as_gguf_py_reads_it(tmp_path):
    """`read_tensor_table` (the loader's own reading of the GGUF header, no gguf-py) gives every tensor's name,
    type, dimensions and data offset, the data section's start and the alignment that gguf-py's public
    ``GGUFReader.tensors`` / ``data_offset`` / ``alignment`` give: the fixtures, and files gguf-py writes in both
    byte orders; the loader's reader is a plain ``gguf.GGUFReader`` (no subclass, no private hook of gguf-py)."""
    from jaxlowfp.models import gguf_loader

    files = [SRC, *sorted((SRC.parents[1] / "moe").glob("*.gguf"))]
    files += [_written(tmp_path / f"{e.name}.gguf", e) for e in (gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG)]
    for p in files:
        infos, start, alignment = gguf_loader.read_tensor_table(p)
        r = gguf.GGUFReader(p)
        assert [(n, t, d, start + o) for n, t, d, o in infos] == [
            (t.name, int(t.tensor_type), [int(x) for x in t.shape], int(t.data_offset)) for t in r.tensors], p
        assert (start, alignment) == (r.data_offset, r.alignment), p
    assert alignment == 64 and len(infos) == 3
    assert type(gguf_loader.open_reader(SRC)) is gguf.GGUFReader
