"""Two real processes (`jax.distributed`, gloo CPU collectives, two CPU devices each) load the tiny Q8_0 GGUF Llama of
tests/test_sharding.py into one ``fsdp=2,tensor=2`` mesh over their four devices, each reading only its own devices'
shards, then compute a rolling-window perplexity and greedy continuations under the mesh
(tests/_sharded_multiprocess_worker.py). Every local shard equals the same slice of the unsharded load bit for bit,
each process holds about half of the parameters, and both processes' log-likelihood and tokens agree with each
other and with one device in this process (within float32 rounding: tests/test_sharded_eval.py says why). The same
pair then quantizes the model by GPTQ and exports it (the second test); one pair serves both tests (`pair`)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from test_multiprocess import _free_port, _kill, _wait
from test_sharded_eval import _ATOL_PER_TOKEN, _near_greedy
from jaxlowfp import evaluation
from jaxlowfp.models import generate, load

WORKER = Path(__file__).with_name("_sharded_multiprocess_worker.py")
ROOT = WORKER.parents[1]
sys.path.insert(0, str(WORKER.parent))
from _sharded_multiprocess_worker import DOCS, PROMPTS, PTQ_LAYERS, calibration_tokens  # noqa: E402
from conftest import child_xla_flags


def _pair(tmp_path: Path, path: Path, *flags: str) -> list[dict]:
    """Run the worker as two `jax.distributed` processes of two CPU devices each; their npz results."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
    env["XLA_FLAGS"] = child_xla_flags()
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), JAX_COORDINATOR_ADDRESS=f"localhost:{_free_port()}",
               JAX_NUM_PROCESSES="2")
    procs = []
    try:
        for i in range(2):
            result, log = tmp_path / f"r{i}.npz", tmp_path / f"log{i}"
            with log.open("w") as f:
                procs.append((subprocess.Popen([sys.executable, str(WORKER), "--devices", "2", "--gguf", str(path),
                                                "--result", str(result), *flags], cwd=ROOT,
                                               env={**env, "JAX_PROCESS_ID": str(i)}, stdout=f,
                                               stderr=subprocess.STDOUT), result, log))
        return _wait(procs, f"sharded pair {' '.join(flags)}")
    finally:
        _kill(procs)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    """One pair of processes for both tests (each process's start, `jax.distributed` setup and sharded load once):
    each evaluates the model, then quantizes it by GPTQ and exports it (`_sharded_multiprocess_worker`). The model:
    test_sharding's Q8_0 file (`_write`: the same weights), its vocabulary padded to the embedding's rows (a GGUF
    export checks what llama.cpp checks; the padding tokens are never encoded from the documents). Returns the
    directory, the GGUF file and the two processes' results."""
    from test_models_gguf import CFG, T, write_gguf
    from test_models_oracle import random_weights, tiny_bpe

    tmp_path = tmp_path_factory.mktemp("pair")
    path = tmp_path / "m.gguf"
    toks = tiny_bpe()[0]
    write_gguf(path, random_weights(CFG, seed=5), qtype=T.Q8_0,
               tokens=toks + [f"<pad{i}>" for i in range(CFG["vocab"] - len(toks))])
    return tmp_path, path, _pair(tmp_path, path, "--ptq", "--export", str(tmp_path / "export"))


@pytest.mark.slow
def test_two_processes_load_their_shards_and_evaluate_as_one_device(pair):
    _, path, res = pair
    for r in res:
        assert int(r["processes"]) == 2 and int(r["local_devices"]) == 2
        assert bool(r["equal"])  # every local shard: the unsharded load's slice, integer-exact
        assert 0.45 * int(r["total_bytes"]) < int(r["local_bytes"]) < 0.55 * int(r["total_bytes"])
    assert float(res[0]["ll"]) == float(res[1]["ll"])  # one global computation, gathered by both
    np.testing.assert_array_equal(res[0]["tokens"], res[1]["tokens"])
    ref, tok = load(path)
    one = evaluation.perplexity(ref, tok, DOCS, max_length=32, batch_size=4)
    assert abs(float(res[0]["ll"]) - one.log_likelihood) <= _ATOL_PER_TOKEN * one.tokens
    want = generate(ref, PROMPTS, max_new_tokens=6)
    for p, g, w in zip(PROMPTS, res[0]["tokens"].tolist(), want):
        assert g == w or _near_greedy(ref, p, g, tol=1e-4), (p, g, w)


@pytest.mark.slow
def test_two_processes_gptq_gives_the_one_device_codes(pair, tmp_path):
    """GPTQ NVFP4 4/6 (mse, W4A16) of the MLP projections by the two processes on one ``fsdp=2,tensor=2`` mesh:
    calibration rows split over the processes' devices, the Hessians X^T X and input amax reduced on the devices by
    XLA's collectives (gloo across the processes) and taken whole by each process, each process runs the same GPTQ
    column loop on its host and rebuilds its own shards of the kernel. The packed codes, block scales and global
    scales equal one device's in this process bit for bit (on this model no Hessian summation order moved a code).
    Then both processes export the sharded result (`ptq.export`, `ptq.export_gguf`: each tensor gathered across
    the processes, one copy written by each): both files are byte for byte the one-device export's."""
    import hashlib

    from jaxlowfp import ptq

    pair_dir, path, res = pair  # the pair quantized the model it evaluated in the test above, as loaded
    ref, _ = load(path)
    rules = [ptq.Rule(path=PTQ_LAYERS, scheme=ptq.scheme("nvfp4-mse", weights_only=True))]
    one = ptq.quantize_model(ref, rules, method=ptq.GPTQ(), calibration=jax.numpy.asarray(calibration_tokens()))
    assert len(one.packed) == 6
    ptq.export(ref, one, tmp_path / "one", dtype="float32")
    ptq.export_gguf(ref, one, tmp_path / "one" / "model.gguf", source_gguf=path)
    for name in ("model.safetensors", "model.gguf"):
        want = hashlib.sha256((tmp_path / "one" / name).read_bytes()).hexdigest()
        for i in range(2):
            got = hashlib.sha256((pair_dir / "export" / f"p{i}" / name).read_bytes()).hexdigest()
            assert got == want, (name, i)
    for r in res:
        assert int(r["processes"]) == 2
        assert int(r["kernel_local_shards"]) == 2 and str(r["kernel_spec"]) == "P('fsdp', 'tensor')"
        differ = 0
        for p, (arr, s_enc) in one.packed.items():
            differ += int(np.sum(r[f"codes:{p}"] != np.asarray(arr.codes)))
            np.testing.assert_array_equal(r[f"scales:{p}"], np.asarray(arr.scales).view(np.uint8), err_msg=p)
            assert float(r[f"s_enc:{p}"]) == float(s_enc), p
        assert differ == 0
