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
    r, t = _tensor(p, "blk.0.attn_k.weight")
    _, q = _tensor(p, "blk.0.attn_q.weight")
    t.field.parts[5][0] = q.field.parts[5][0] + 32  # k's bytes now start inside q's (aligned: 32)
    r.data.flush()
    del r
    with pytest.raises(CheckpointError, match=rf"{p}: tensor blk.0.attn_k.weight starts at byte \d+, inside tensor "
                                              rf"blk.0.attn_q.weight"):
        load(p)


def test_misaligned_offset_and_unknown_type_are_refused(tmp_path):
    p = _copy(tmp_path)
    r, t = _tensor(p, "blk.1.ffn_up.weight")
    t.field.parts[5][0] += 4
    r.data.flush()
    del r
    with pytest.raises(CheckpointError, match=rf"{p}: tensor blk.1.ffn_up.weight: data offset \d+ is not a multiple "
                                              rf"of general.alignment 32"):
        load(p)
    p = _copy(tmp_path)
    r, t = _tensor(p, "blk.1.ffn_up.weight")
    t.field.parts[4][0] = 250
    r.data.flush()
    del r
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
