"""train.checkpoint: round trip, refusal of non-finite states, atomicity; exact resume; SIGKILL resume."""
from __future__ import annotations

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

from train.checkpoint import CheckpointError, Checkpointer, nonfinite_leaves

REPO = Path(__file__).resolve().parents[1]


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
