"""One process of the data=2 x fsdp=2 HiF8 W8A8 QAT run that tests/test_multiprocess.py compares.

    python tests/_multiprocess_worker.py --devices N --steps S --out DIR --result FILE [--resume]

With ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set, `train.mesh.initialize_distributed`
joins the job (CPU collectives over gloo) and this process contributes its ``--devices`` CPU devices to the global
mesh (the test runs every worker so, the one-process reference included); without them it is a plain single
process with ``--devices`` CPU devices. Either way it runs `train.loop.train` on the tiny preset cut to 2 blocks
with a data=2,fsdp=2 mesh for steps up to ``S`` (``--resume``: from the latest checkpoint in ``DIR``),
checkpointing at ``S``, and writes to ``FILE`` (npz) the losses it ran and the final params, amax state and rest of
the model state, gathered from all processes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `train` and `jaxlowfp`

import jax  # noqa: E402

B, T = 8, 32  # global batch rows, sequence length
LAYER = "blocks/1/mlp/down_proj"


def tokens():
    """Deterministic synthetic bytes (no files to read), identical in every process."""
    import numpy as np

    return np.random.default_rng(1234).integers(32, 127, size=16_384, dtype=np.uint8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, required=True, help="CPU devices of this process")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    t0 = time.perf_counter()

    def log(msg: str) -> None:  # to the log the test shows on a failure
        print(f"[worker {os.environ.get('JAX_PROCESS_ID', '-')}] {time.perf_counter() - t0:6.1f} s: {msg}",
              file=sys.stderr, flush=True)

    # as tests/conftest.py: the same numerics configuration as the in-process tests
    jax.config.update("jax_num_cpu_devices", a.devices)
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")

    from train import mesh as mesh_lib

    distributed = mesh_lib.initialize_distributed()

    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    from jaxlowfp.qnnx import paper_rules, quantize_model
    from jaxlowfp.qat import hif8_w8a8
    from train.data import BatchStream
    from train.loop import make_optimizer, make_schedule, train
    from jaxlowfp.models.llama import Llama, loss_fn, preset

    log(f"initialized (distributed={distributed})")
    want = int(os.environ["JAX_NUM_PROCESSES"]) if distributed else 1
    assert jax.process_count() == want, (jax.process_count(), want)
    assert jax.local_device_count() == a.devices and jax.device_count() == a.devices * want, jax.devices()
    if jax.process_count() > 1:  # the check `train.mesh.shard` relies on: equal values pass, different ones raise
        mesh_lib.assert_same_on_every_process([np.arange(3), np.ones((2, 2), np.float32)], what="probe")
        try:
            mesh_lib.assert_same_on_every_process([np.arange(3) + jax.process_index()], what="probe")
        except ValueError as e:
            assert "processes [1] hold other values than process 0" in str(e), e
        else:
            raise AssertionError("assert_same_on_every_process missed values that differ between processes")

    schedule = make_schedule(3e-3)
    tx = make_optimizer(schedule)
    # the tiny preset cut to 2 blocks (block 0 high precision, block 1 quantized): every kind of state the 4-block
    # model has (fsdp-sharded and replicated params, AdamW moments, amax histories) at half the compile time
    model = Llama(preset("tiny", n_layers=2), rngs=nnx.Rngs(0))
    quantize_model(model, paper_rules(2, keep_first=1, keep_last=0, recipe=hif8_w8a8()))
    stream = BatchStream(tokens(), batch_size=B, seq_len=T, seed=0, process_index=jax.process_index(),
                         process_count=jax.process_count())
    res = train(model, stream, steps=a.steps, tx=tx, schedule=schedule, loss_fn=loss_fn, out_dir=a.out,
                stats_layer=LAYER, mesh=mesh_lib.make_mesh("data=2,fsdp=2"), checkpoint_every=a.steps,
                resume=a.resume, progress=False)

    log(f"trained steps {res.resumed_from or 0}..{int(res.state.step)} in {res.wall_s:.1f} s (step ends at "
        f"{[round(r['time_s'], 1) for r in res.rows]} s), losses {res.losses}")
    state = {"params": res.state.params, "qstate": res.state.qstate, "rest": res.state.rest,
             "opt_state": res.state.opt_state}
    gathered = multihost_utils.process_allgather(state, tiled=True)  # global values, in every process
    flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(gathered)[0]}
    np.savez(a.result, losses=np.asarray(res.losses, np.float64),
             resumed_from=np.asarray(-1 if res.resumed_from is None else res.resumed_from),
             step=np.asarray(int(res.state.step)), data_index=np.asarray(int(res.data_state.index)),
             **{"state" + k: v for k, v in flat.items()})
    log("wrote the result")
    if distributed:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
