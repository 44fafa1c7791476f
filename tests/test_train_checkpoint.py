"""train.checkpoint: round trip, refusal of non-finite states, atomicity; exact resume; SIGKILL resume."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_train_loop import run, tiny_model  # the tiny QAT setup of the loop tests
from train.checkpoint import CheckpointError, Checkpointer, nonfinite_leaves
from train.data import load_domain
from train.loop import checkpointer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return load_domain("python", max_bytes=120_000).train


class Pos(NamedTuple):
    epoch: object
    index: object


def _state(scale: float = 1.0) -> dict:
    return {
        "params": {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) * scale, "b": jnp.ones(3, jnp.bfloat16)},
        "opt_state": (jnp.zeros(3, jnp.float32), jnp.int32(7)),
        "qstate": {"hist": jnp.full((4,), 2.5, jnp.float32)},
        "rng": jax.random.PRNGKey(3),
        "data": Pos(np.int64(2), np.int64(5)),
    }


def _same(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def test_round_trip_is_exact(tmp_path):
    s = _state()
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(3, s, {"note": "x"})
        assert ck.latest_step() == 3
        out, meta = ck.restore(_state(scale=0.0))
    _same(out, s)
    assert meta["note"] == "x" and meta["schema_version"] == 1
    assert isinstance(out["data"], Pos) and np.asarray(out["data"].index).dtype == np.int64


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_save_refuses_nonfinite_params_and_writes_nothing(tmp_path, bad):
    s = _state()
    s["params"]["w"] = s["params"]["w"].at[1, 2].set(bad)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, _state())
        with pytest.raises(CheckpointError, match=r"refusing to save step 2.*\['w'\]"):
            ck.save(2, s)
        assert ck.all_steps() == [1]
    assert not any(p.name.startswith("2") for p in (tmp_path / "ck").iterdir())


def test_save_refuses_nonfinite_optimizer_state(tmp_path):
    s = _state()
    s["opt_state"] = (jnp.array([0.0, np.nan, 0.0], jnp.float32), jnp.int32(7))
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(CheckpointError, match="opt_state"):
        ck.save(1, s)


def test_restore_refuses_a_nonfinite_checkpoint(tmp_path):
    s = _state()
    s["params"]["b"] = s["params"]["b"].at[0].set(jnp.inf)
    with Checkpointer(tmp_path / "ck", checked=()) as unsafe:  # a checkpoint written by something else
        unsafe.save(5, s)
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(CheckpointError, match="refusing to restore"):
        ck.restore(_state())


def test_restore_without_checkpoint_is_a_clear_error(tmp_path):
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(CheckpointError, match="no checkpoint"):
        ck.restore(_state())


def test_unfinished_save_is_ignored(tmp_path):
    """A save killed before orbax's rename leaves only a tmp directory: never the latest, cleaned up on open."""
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(4, _state())
    junk = tmp_path / "ck" / "8.orbax-checkpoint-tmp-1234567"
    (junk / "state").mkdir(parents=True)
    (junk / "state" / "half_written").write_bytes(b"\x00" * 10)
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.latest_step() == 4
        out, _ = ck.restore(_state(scale=0.0))
    _same(out, _state())
    assert not junk.exists()


def test_nonfinite_leaves_names_paths():
    tree = {"a": jnp.array([1.0, np.nan]), "b": jnp.array([1, 2]), "c": jnp.ones(2, jnp.bfloat16)}
    assert nonfinite_leaves(tree) == ["['a']"]


# ---------------------------------------------------------------------------------------------- the training loop


def _assert_same_run(a, b) -> None:
    """Bitwise equality of two RunResults' final states (params, amax state, the rest of the model state, optimizer,
    counters, data)."""
    for name in ("params", "qstate", "rest", "opt_state", "step", "skipped"):
        _same(jax.device_get(getattr(a.state, name)), jax.device_get(getattr(b.state, name)))
    _same(a.data_state, b.data_state)


def test_interrupted_run_resumed_ends_bit_identical(tokens, tmp_path):
    """A run that dies after its step-3 checkpoint and is resumed ends exactly like an uninterrupted one; the
    warmup boundary (step 4) lies after the resume point."""
    full = run(tiny_model(), tokens, tmp_path / "full", steps=8, warmup=4, checkpoint_every=3)

    def crash(step, row):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(tiny_model(), tokens, tmp_path / "cut", steps=8, warmup=4, checkpoint_every=3, on_step=crash)
    resumed = run(tiny_model(seed=1), tokens, tmp_path / "cut", steps=8, warmup=4, checkpoint_every=3, resume=True)
    assert resumed.resumed_from == 3 and len(resumed.rows) == 5
    _assert_same_run(full, resumed)
    # metrics.jsonl of the resumed run: steps 1..8 once each, the same losses as the uninterrupted run
    rows = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["loss"] for r in rows] == [r["loss"] for r in full.rows]
    assert [r["observe_only"] for r in rows] == [True] * 4 + [False] * 4


def test_resume_without_a_checkpoint_starts_fresh_and_fresh_runs_discard_old_ones(tokens, tmp_path):
    first = run(tiny_model(), tokens, tmp_path, steps=2, warmup=4, checkpoint_every=1, resume=True)
    assert first.resumed_from is None
    again = run(tiny_model(), tokens, tmp_path, steps=2, warmup=4, checkpoint_every=2)  # not resuming: starts over
    assert again.resumed_from is None and len(again.rows) == 2
    with checkpointer(tmp_path) as ck:
        assert ck.all_steps() == [2]


CHILD = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    import sys
    sys.path.insert(0, "tests")
    from test_train_loop import one_device, run, tiny_model
    from train.data import load_domain
    tokens = load_domain("python", max_bytes=120_000).train
    run(tiny_model(), tokens, sys.argv[1], steps=10_000, warmup=4, checkpoint_every=2)
    """
)


def test_run_killed_with_sigkill_resumes_from_its_last_checkpoint(tokens, tmp_path):
    out = tmp_path / "run"
    log = (tmp_path / "child.log").open("w")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(out)], cwd=REPO, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 240
        while True:
            ckpt = out / "ckpt"
            done = [int(p.name) for p in ckpt.glob("*") if p.name.isdigit()] if ckpt.exists() else []
            if done and max(done) >= 6 or child.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert child.poll() is None, (tmp_path / "child.log").read_text()[-3000:]
        assert done and max(done) >= 6, "no checkpoint within the deadline"
        os.kill(child.pid, signal.SIGKILL)  # possibly in the middle of writing the next checkpoint
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
        log.close()
    assert child.returncode == -signal.SIGKILL
    with checkpointer(out) as ck:
        last = ck.latest_step()
    assert last is not None and last >= 6 and last % 2 == 0
    logged = {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    resumed = run(tiny_model(seed=1), tokens, out, steps=last + 2, warmup=4, checkpoint_every=2, resume=True)
    assert resumed.resumed_from == last and [r["step"] for r in resumed.rows] == [last + 1, last + 2]
    for r in resumed.rows:  # steps the child did after its last checkpoint are redone identically
        if r["step"] in logged:
            assert r["loss"] == logged[r["step"]]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, last + 3))
