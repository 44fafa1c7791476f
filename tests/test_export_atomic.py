"""Exports write atomically and refuse a non-empty target unless ``overwrite=True`` (issue 45): `ptq.export` and
`ptq.export_gguf` write into a temporary sibling, then rename; a refused or failed export leaves the disk as it
was (the target, its siblings)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx

from jaxlowfp import ptq
from jaxlowfp.models import Llama, ModelConfig, load_export
from jaxlowfp.ptq import checkpoint, stream
from jaxlowfp.ptq.checkpoint import TargetExistsError

CFG = ModelConfig(vocab=96, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32)
RULES = [ptq.Rule(path=r"blocks/\d+/mlp/\w+_proj", scheme=ptq.scheme("nvfp4-mse", weights_only=True))]
TOKENS = np.random.default_rng(0).integers(0, 96, (2, 16)).astype(np.int32)


def _quantized(seed=0):
    model = Llama(CFG, rngs=nnx.Rngs(seed))
    return model, ptq.quantize_model(model, RULES, method="rtn", calibration=TOKENS, progress=False)


def _snapshot(root):
    """{relative path: bytes} of every file under root (hidden ones included)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _tokenizer(directory):
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())[:94])}
    vocab["ab"] = 94
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    directory.mkdir(parents=True, exist_ok=True)
    tk.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def test_export_refuses_a_non_empty_directory(tmp_path):
    model, res = _quantized()
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"an older export's shard")
    before = _snapshot(tmp_path)
    with pytest.raises(TargetExistsError, match=r"out is not empty \(model-00001-of-00002.safetensors\).*"
                                                r"overwrite=True"):
        ptq.export(model, res, out)
    assert _snapshot(tmp_path) == before
    assert isinstance(TargetExistsError("x"), ValueError)


def test_export_into_an_empty_or_new_directory(tmp_path):
    model, res = _quantized()
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new" / "deeper"):
        rep = ptq.export(model, res, out)
        assert rep.directory == out and (out / checkpoint.WEIGHTS_FILE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "new"]  # no temporary sibling left


def test_overwrite_replaces_the_whole_directory(tmp_path):
    model, res = _quantized()
    out = tmp_path / "out"
    ptq.export(model, res, out)
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    other, res2 = _quantized(seed=1)
    ptq.export(other, res2, out, overwrite=True)
    assert not (out / "model-00001-of-00002.safetensors").exists()  # replaced, not written into
    fresh, _ = load_export(out, tokenizer=None)
    np.testing.assert_array_equal(np.asarray(fresh.blocks[0].mlp.gate_proj.kernel[...]),
                                  np.asarray(other.blocks[0].mlp.gate_proj.kernel[...]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("existing", [False, True])
def test_a_failure_while_writing_leaves_the_disk_as_it_was(tmp_path, monkeypatch, existing):
    model, res = _quantized()
    out = tmp_path / "out"
    if existing:
        ptq.export(model, res, out)
    before = _snapshot(tmp_path)

    def disk_full(path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(stream, "write_safetensors", disk_full)
    with pytest.raises(OSError, match="No space left"):
        ptq.export(model, res, out, overwrite=True)
    assert _snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if existing else [])


def test_a_refused_export_writes_nothing(tmp_path):
    model, res = _quantized()
    model.blocks[0].attn_norm.scale.set_value(model.blocks[0].attn_norm.scale[...].at[0].set(np.nan))
    with pytest.raises(ValueError, match="non-finite|NaN"):
        ptq.export(model, res, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_export_gguf_refuses_an_existing_file_and_overwrites_atomically(tmp_path, monkeypatch):
    tj = _tokenizer(tmp_path / "tok")
    model, res = _quantized()
    path = tmp_path / "m.gguf"
    path.write_bytes(b"an older file")
    with pytest.raises(TargetExistsError, match=r"m\.gguf exists.*overwrite=True"):
        ptq.export_gguf(model, res, path, tokenizer_json=tj)
    assert path.read_bytes() == b"an older file"
    rep = ptq.export_gguf(model, res, path, tokenizer_json=tj, overwrite=True)
    assert rep.path == path and path.read_bytes()[:4] == b"GGUF"
    good = path.read_bytes()
    before = _snapshot(tmp_path)
    import gguf

    def disk_full(self, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", disk_full)
    with pytest.raises(OSError, match="No space left"):
        ptq.export_gguf(model, res, path, tokenizer_json=tj, overwrite=True)
    assert _snapshot(tmp_path) == before and path.read_bytes() == good
    assert json.loads(json.dumps(sorted(p.name for p in tmp_path.iterdir()))) == ["m.gguf", "tok"]
