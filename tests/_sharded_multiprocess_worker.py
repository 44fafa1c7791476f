"""One process of the two-process sharded load + evaluation that tests/test_sharded_multiprocess.py runs.

    python tests/_sharded_multiprocess_worker.py --devices N --gguf FILE --result FILE

With ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set it joins the `jax.distributed`
job (gloo CPU collectives) with its ``--devices`` CPU devices, builds the ``fsdp=2,tensor=2`` mesh over the global
devices, loads the GGUF file into it (`jaxlowfp.models.load(..., mesh=...)`: each process reads only the shards of
its own devices), and writes to ``FILE`` (npz): whether every local shard equals the same slice of this process's
unsharded load (integer-exact), the local devices' bytes, the perplexity log-likelihood and the greedy tokens of
`jaxlowfp.models.generate` under the mesh; with ``--ptq`` also the GPTQ codes and scales of the same sharded model
(`gptq`), quantized after the evaluation, and (``--export DIR``) its exports.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

import jax  # noqa: E402

DOCS = ["The quick brown fox jumps over the lazy dog. " * 3, "hello world, hello jax", "sharded models agree " * 4]
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]]


def calibration_tokens():
    import numpy as np

    return np.random.default_rng(0).integers(0, 272, (4, 32)).astype(np.int32)


PTQ_LAYERS = r"blocks/\d+/mlp/\w+_proj"


def gptq(model, mesh, export: str | None = None, source: str | None = None) -> dict:
    """GPTQ NVFP4 4/6 (mse, W4A16) of the MLP projections, calibration rows over the data axes of the global mesh;
    every packed code and scale array gathered (``codes:<layer>``, ``scales:<layer>``, ``s_enc:<layer>``).
    ``export``: then every process runs `ptq.export` and `ptq.export_gguf` (``source`` the GGUF the model came
    from) of the sharded model into ``<export>/p<process index>/`` (the exporters' per-tensor gathers are collectives,
    so every process takes part; each writes its own copy)."""
    import numpy as np

    from jaxlowfp import ptq, sharding

    rules = [ptq.Rule(path=PTQ_LAYERS, scheme=ptq.scheme("nvfp4-mse", weights_only=True))]
    calib = sharding.shard(calibration_tokens(), sharding.batch_sharding(mesh))
    res = ptq.quantize_model(model, rules, method=ptq.GPTQ(), calibration=calib)
    out = {}
    for p, (arr, s_enc) in res.packed.items():
        out[f"codes:{p}"] = sharding.to_host(arr.codes)
        out[f"scales:{p}"] = sharding.to_host(arr.scales).view(np.uint8)
        out[f"s_enc:{p}"] = np.asarray(sharding.to_host(s_enc), np.float32)
    kernel = model.blocks[0].mlp.up_proj.kernel.get_value()
    out["kernel_local_shards"] = len(kernel.addressable_shards)
    out["kernel_spec"] = str(kernel.sharding.spec)
    if export is not None:
        d = Path(export) / f"p{jax.process_index()}"
        ptq.export(model, res, d, dtype="float32")
        ptq.export_gguf(model, res, d / "model.gguf", source_gguf=source)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--ptq", action="store_true", help="after the evaluation, GPTQ NVFP4 4/6 of the MLP")
    ap.add_argument("--export", help="with --ptq: export the result into EXPORT/p<process index>/")
    a = ap.parse_args()
    jax.config.update("jax_num_cpu_devices", a.devices)
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")

    from jaxlowfp import evaluation, sharding

    sharding.initialize_distributed()
    import numpy as np

    from jaxlowfp.models import generate, load

    mesh = sharding.make_mesh("fsdp=2,tensor=2")
    ref, tok = load(a.gguf)  # this process's unsharded copy, on its first device
    model, _ = load(a.gguf, mesh=mesh)
    want = {p: np.asarray(v.get_value()) for p, v in sharding.variable_paths(ref).items()}
    equal, local = True, 0
    for p, v in sharding.variable_paths(model).items():
        x = v.get_value()
        for s in x.addressable_shards:
            equal &= np.array_equal(np.asarray(s.data).view(np.uint32), want[p][s.index].view(np.uint32))
            local += s.data.nbytes
    score = evaluation.perplexity(model, tok, DOCS, max_length=32, batch_size=4, mesh=mesh)
    tokens = generate(model, PROMPTS, max_new_tokens=6, mesh=mesh)
    # then (--ptq) GPTQ of the same sharded model, which replaces its MLP kernels: after the evaluation above
    np.savez(a.result, equal=equal, local_bytes=local, local_devices=len(jax.local_devices()),
             processes=jax.process_count(), ll=score.log_likelihood, tokens=np.asarray(tokens),
             total_bytes=sum(w.nbytes for w in want.values()), **(gptq(model, mesh, a.export, a.gguf) if a.ptq else {}))


if __name__ == "__main__":
    main()
