"""Two real processes (`jax.distributed`, gloo CPU collectives, coordinator on localhost, two CPU devices each)
train the data=2 x fsdp=2 HiF8 W8A8 QAT model (the tiny preset cut to 2 blocks, block 1 quantized) for 3 steps
and checkpoint; a fresh pair restores the checkpoint and trains 3 more. Losses, params, optimizer state, amax
histories and the rest of the model state equal bit for bit those of one process with 4 CPU devices and the same
mesh that trains the 6 steps without stopping.

The reference process also joins a (one-process) `jax.distributed` job, so that its all-reduces run through gloo
too: without a distributed client XLA's in-process CPU all-reduce adds the 4 partial gradients in device order and
gloo in another, and one ulp of gradient difference changes later HiF8 roundings (the losses of such a reference
differ from these by up to 4e-4 relative within 6 steps). The rest is what the test is about: one process against
two that each build their shards of the state, feed their own rows of each batch and write one checkpoint together,
and a restore into processes that have never seen the state.

The processes run tests/_multiprocess_worker.py (`train.loop.train`, `train.mesh.initialize_distributed`,
`train.checkpoint`). Most of the time is compiling the step: the reference, and each process of the first pair.
The workers share this run's persistent compilation cache (conftest), or without one (the default) the pairs share
one of this test's own: the first pair's process 0 writes its step there (only process 0 of a job writes), and the
second pair, the same program over the same global devices, loads it instead of compiling (seen: after a run the
run-wide cache holds two step programs, the reference's and the first pair's; a second pair that compiled would
have written a third). A loaded executable is the same compiled program, so the
bit-for-bit comparisons below are unchanged."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import child_cache_env, child_xla_flags

WORKER = Path(__file__).with_name("_multiprocess_worker.py")
ROOT = WORKER.parents[1]
TIMEOUT_S = 300  # per pair: generous, since a shared 2-core machine ran the whole test in 90-290 s
STEPS, FIRST = 6, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(tmp: Path, name: str, *, n_proc: int, devices: int, steps: int, out: Path, resume: bool = False
            ) -> list[tuple[subprocess.Popen, Path, Path]]:
    """Start a `jax.distributed` job of `n_proc` workers; returns (process, result file, log file) for each."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
    env["XLA_FLAGS"] = child_xla_flags()
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), JAX_COORDINATOR_ADDRESS=f"localhost:{_free_port()}",
               JAX_NUM_PROCESSES=str(n_proc))
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # this run's persistent cache (conftest): the second pair
        env.update({k: os.environ[k] for k in ("JAX_COMPILATION_CACHE_DIR",  # loads the first pair's step
                                               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS") if k in os.environ})
    elif n_proc > 1:  # no run-wide cache (conftest's default): the pairs share one of this test's own
        env.update(child_cache_env(tmp / "xla-cache"))
    procs = []
    for i in range(n_proc):
        result, log = tmp / f"{name}-{i}.npz", tmp / f"{name}-{i}.log"
        cmd = [sys.executable, str(WORKER), "--devices", str(devices), "--steps", str(steps), "--out", str(out),
               "--result", str(result)] + (["--resume"] if resume else [])
        with log.open("w") as f:
            procs.append((subprocess.Popen(cmd, cwd=ROOT, env={**env, "JAX_PROCESS_ID": str(i)}, stdout=f,
                                           stderr=subprocess.STDOUT), result, log))
    return procs


def _kill(procs: list[tuple[subprocess.Popen, Path, Path]]) -> None:
    for p, _, _ in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _wait(procs: list[tuple[subprocess.Popen, Path, Path]], what: str) -> list[dict[str, np.ndarray]]:
    """Wait for every worker (TIMEOUT_S in all); on a failure or timeout kill the rest (a peer waiting in a
    collective would otherwise hang) and fail with every worker's output."""
    deadline = time.monotonic() + TIMEOUT_S
    failed = []
    for i, (p, _, _) in enumerate(procs):
        try:
            rc = p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0:
            failed.append((i, rc))
            _kill(procs)
    if failed:
        logs = "\n".join(f"----- {what} process {i} (exit {p.returncode}) -----\n{log.read_text()[-6000:]}"
                         for i, (p, _, log) in enumerate(procs))
        pytest.fail(f"{what}: worker(s) {failed} failed (exit code or timeout after {TIMEOUT_S} s)\n{logs}")
    return [dict(np.load(r)) for _, r, _ in procs]


def _state(res: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in res.items() if k.startswith("state")}


@pytest.mark.slow
def test_two_processes_checkpoint_resume_match_one_process(tmp_path):
    ckpt = tmp_path / "two"
    # the single-process reference runs beside the pairs
    single = _launch(tmp_path, "single", n_proc=1, devices=4, steps=STEPS, out=tmp_path / "one")
    try:
        first_res = _wait(_launch(tmp_path, "first", n_proc=2, devices=2, steps=FIRST, out=ckpt),
                          "first pair (steps 1-3)")
        assert (ckpt / "ckpt" / str(FIRST)).is_dir(), sorted(p.name for p in (ckpt / "ckpt").iterdir())
        second_res = _wait(_launch(tmp_path, "second", n_proc=2, devices=2, steps=STEPS, out=ckpt, resume=True),
                           "second pair (restore, steps 4-6)")
        (ref,) = _wait(single, "single process (steps 1-6)")
    finally:
        _kill(single)

    assert int(ref["step"]) == STEPS and len(ref["losses"]) == STEPS and np.all(np.isfinite(ref["losses"]))
    for r in first_res:
        assert int(r["resumed_from"]) == -1 and int(r["step"]) == FIRST
    for r in second_res:  # restored the step counter and the data position, then ran steps 4-6
        assert int(r["resumed_from"]) == FIRST and int(r["step"]) == STEPS
        assert int(r["data_index"]) == int(ref["data_index"]) == STEPS
    # both processes of a pair see the same global values
    for pair in (first_res, second_res):
        np.testing.assert_array_equal(pair[0]["losses"], pair[1]["losses"])
        for k, v in _state(pair[0]).items():
            np.testing.assert_array_equal(pair[1][k], v, err_msg=k)
    # bit for bit against the uninterrupted single-process run
    losses = np.concatenate([first_res[0]["losses"], second_res[0]["losses"]])
    np.testing.assert_array_equal(losses, ref["losses"])
    got, want = _state(second_res[0]), _state(ref)
    assert sorted(got) == sorted(want)
    assert any("amax" in k and "history" in k for k in want), sorted(want)[:20]  # the amax histories are compared
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        np.testing.assert_array_equal(got[k], v, err_msg=k)
