"""Child process of tests/test_eight_devices.py: one model (a checkpoint path or preset name) on 8 simulated CPU
devices, unsharded against ``fsdp=4,tensor=2``, through sharded load, perplexity, greedy generation, GPTQ NVFP4
4/6 (W4A16, sequential calibration) of the layers matching ``--ptq-layers`` and the compressed-tensors export.

    python tests/eight_devices_child.py MODEL --ptq-layers REGEX OUT_DIR

Prints one JSON object of what it compared (the parent asserts on it); no conftest here, so the device count is
this process's own (jax_num_cpu_devices before the backend starts).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxlowfp import evaluation, ptq, sharding  # noqa: E402
from jaxlowfp.models import generate, load  # noqa: E402

DOCS = ["The quick brown fox jumps over the lazy dog. " * 3, "hello world, hello jax", "sharded models agree " * 4]


def _log(t0: float, what: str) -> None:
    print(f"[{time.perf_counter() - t0:6.1f} s, {time.process_time():6.1f} s CPU] {what}", file=sys.stderr, flush=True)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _greedy_slack(model, prompt: list[int], new: list[int]) -> float:
    """How far below the largest logit of the one-device `model` the tokens of ``new`` lie, at worst."""
    seq = jnp.asarray([prompt + new], jnp.int32)
    logits = np.asarray(jax.jit(lambda m, x: m(x))(model, seq))[0, len(prompt) - 1: -1]
    return float(np.max(logits.max(-1) - logits[np.arange(len(new)), new]))


def _nibbles_differ(a: np.ndarray, b: np.ndarray) -> int:
    return int(((a & 15) != (b & 15)).sum() + ((a >> 4) != (b >> 4)).sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--ptq-layers", required=True)
    args = ap.parse_args()
    t0 = time.perf_counter()
    out: dict = {"devices": jax.device_count()}
    mesh = sharding.make_mesh("fsdp=4,tensor=2")
    ref, tok = load(args.model)
    model, _ = load(args.model, mesh=mesh)
    _log(t0, "loaded")

    # sharded load: every parameter bit for bit the unsharded one; per-device bytes on 1 / 2 / 4 / 8 devices
    want = {p: sharding.to_host(v.get_value()) for p, v in sharding.variable_paths(ref).items()}
    got = sharding.variable_paths(model)
    out["params_equal"] = sorted(got) == sorted(want) and all(
        np.array_equal(_bits(sharding.to_host(v.get_value())), _bits(want[p])) for p, v in got.items())
    out["placed"] = {p: str(v.get_value().sharding.spec) for p, v in got.items()}
    per = {"1": max(sharding.device_bytes(ref).values()), "8": max(sharding.device_bytes(model).values())}
    for n in (2, 4):
        sub = sharding.make_mesh(f"fsdp={n // 2},tensor=2", jax.devices()[:n])
        placed = {p: jax.device_put(v.get_value(), s)
                  for (p, v), s in zip(sharding.variable_paths(ref).items(),
                                       sharding.model_shardings(ref, sub, sharding.llama_rules()).values())}
        per[str(n)] = max(sharding.device_bytes(placed).values())
        del placed
    out["device_bytes"] = per
    _log(t0, "compared parameters")

    # evaluation and generation
    a = evaluation.perplexity(ref, tok, DOCS, max_length=32, batch_size=4)
    b = evaluation.perplexity(model, tok, DOCS, max_length=32, batch_size=4, mesh=mesh)
    out["perplexity"] = {"tokens": [a.tokens, b.tokens], "log_likelihood": [a.log_likelihood, b.log_likelihood]}
    prompts = [tok.encode(d)[:n] for d, n in zip(DOCS + ["fox"], (12, 5, 9, 2))]
    _log(t0, "perplexity")
    want_gen = generate(ref, prompts, max_new_tokens=8)
    got_gen = generate(model, prompts, max_new_tokens=8, mesh=mesh)
    out["generate"] = [{"equal": g == w, "slack": 0.0 if g == w else _greedy_slack(ref, p, g)}
                       for p, g, w in zip(prompts, got_gen, want_gen)]
    _log(t0, "evaluated and generated")

    # GPTQ NVFP4 4/6 on the mesh (calibration rows over the data axes) against one device, then the export
    rules = [ptq.Rule(path=args.ptq_layers, scheme=ptq.scheme("nvfp4-mse", weights_only=True))]
    vocab = int(ref.config.vocab)
    calib = np.random.default_rng(0).integers(0, vocab, (8, 32)).astype(np.int32)
    ctl = nnx.clone(ref)  # the float model for the control below (quantize_model replaces the kernels it quantizes)
    res_one = ptq.quantize_model(ref, rules, method=ptq.GPTQ(), calibration=calib)
    _log(t0, "gptq one")
    # control: one device, the same calibration rows in another order, i.e. the Hessians' sums in another order
    res_ctl = ptq.quantize_model(ctl, rules, method=ptq.GPTQ(),
                                 calibration=calib[np.random.default_rng(1).permutation(len(calib))])
    res_mesh = ptq.quantize_model(model, rules, method=ptq.GPTQ(), calibration=sharding.put_batch(calib, mesh))
    _log(t0, "quantized")
    layers = sorted(res_one.packed)
    codes = {p: (sharding.to_host(res_one.packed[p][0].codes), sharding.to_host(res_mesh.packed[p][0].codes))
             for p in layers}
    scales = {p: (sharding.to_host(res_one.packed[p][0].scales), sharding.to_host(res_mesh.packed[p][0].scales))
              for p in layers}
    out["gptq"] = {"layers": layers, "same_layers": sorted(res_mesh.packed) == layers,
                   "codes": sum(2 * c[0].size for c in codes.values()),
                   "codes_differ": sum(_nibbles_differ(*c) for c in codes.values()),
                   "control_codes_differ": sum(_nibbles_differ(c[0], sharding.to_host(res_ctl.packed[p][0].codes))
                                               for p, c in codes.items()),
                   "scales": sum(s[0].size for s in scales.values()),
                   "scales_differ": sum(int((_bits(s[0]) != _bits(s[1])).sum()) for s in scales.values()),
                   "control_scales_differ": sum(
                       int((_bits(s[0]) != _bits(sharding.to_host(res_ctl.packed[p][0].scales))).sum())
                       for p, s in scales.items()),
                   "kernel_specs": {p: str(sharding.variable_paths(model)[p + "/kernel"].get_value().sharding.spec)
                                    for p in layers}}

    ptq.export(ref, res_one, f"{args.out}/one")
    ptq.export(model, res_mesh, f"{args.out}/mesh")
    _log(t0, "exported")
    one = ptq.checkpoint.read_safetensors(f"{args.out}/one/model.safetensors")
    shards = ptq.checkpoint.read_safetensors(f"{args.out}/mesh/model.safetensors")
    differ: dict[str, int] = {}
    for name in sorted(set(one) | set(shards)):
        x, y = one.get(name), shards.get(name)
        if x is None or y is None or x.dtype != y.dtype or x.shape != y.shape:
            differ[name] = -1
        elif x.dtype == np.uint8 and name.endswith("weight_packed"):
            if (n := _nibbles_differ(x, y)):
                differ[name] = n
        elif not np.array_equal(_bits(x), _bits(y)):
            differ[name] = int((_bits(x) != _bits(y)).sum())
    out["export"] = {"tensors": len(one), "differ": differ}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
