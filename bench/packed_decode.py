"""Decode-shaped products of a packed weight (issue 44): per layer at M = 1..16 and whole-model decode steps, packed
NVFP4 against float32 and Qwix's nvfp4 PTQ, side by side in one run (medians of alternated calls; only ratios count
on a shared CPU).

    .venv/bin/python bench/packed_decode.py [--model smollm2-135m | tiny] [--reps 15] [--no-write]

Per layer: ``x [M, 576] @ W' [576, 1536]`` (a SmolLM2-135M MLP projection), W' packed to NVFP4 4/6, by
`jaxlowfp.backends.packed_matmul` on the "dequant" backend (this CPU's), in three forms:
  - "chosen": what the library runs (`backends.plan(..., rows=M).form`: the native GEMV on the packed codes at
    M <= NATIVE_GEMV_ROWS, else the decode fused into the dot by XLA);
  - "decode-then-dot" and "fused": the XLA forms, forced (native GEMV off);
against the float32 dot of the same (decoded) weight and Qwix 0.1.8's PTQ ``nnx.Linear`` (``QtRule(weight_qtype=
"nvfp4", tile_size=16)``, as its docs configure it). W4A4 (the input fake-quantized to NVFP4 first) at M = 1 too.

Whole model: `models.load(model)` in float32; ``ptq.quantize_model`` RTN of every ``*_proj`` to NVFP4 4/6 W4A16 and
W4A4, ``ptq.pack_model``; Qwix's PTQ of the same float model (``qwix.quantize_model``, every ``*_proj``). One jitted
decode step (1 token, batch 1, a KV cache of 64 slots) and a 16-token forward without cache, each model.

Writes the ``## Packed decode (M = 1) and short forwards`` section of bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from _results import machine, markdown_table, write_section
from flax import nnx

from jaxlowfp import backends, models, packed, ptq
from jaxlowfp.models.llama import KVCache, Llama, preset

SECTION = "Packed decode (M = 1) and short forwards"
K, N = 576, 1536


@contextlib.contextmanager
def form(name: str | None):
    """Force the "dequant" form (None: the library's choice): "fused" or "decode-then-dot" with the native GEMV off.
    Only while tracing: a jitted program keeps what it was traced with."""
    saved = backends.dequant_form, backends.NATIVE_GEMV_ROWS
    if name is not None:
        backends.NATIVE_GEMV_ROWS = 0
        backends.dequant_form = lambda rows: name
    try:
        yield
    finally:
        backends.dequant_form, backends.NATIVE_GEMV_ROWS = saved


def qwix_model(model: nnx.Module, pattern: str, *args):
    """Qwix's PTQ of `model` (NVFP4 weights, tiles of 16 along the input, as Qwix's docs configure nvfp4)."""
    import qwix

    rules = [qwix.QtRule(module_path=pattern, weight_qtype="nvfp4", tile_size=16)]
    return qwix.quantize_model(model, qwix.PtqProvider(rules), *args)


def alternated(fns: dict, reps: int) -> dict[str, float]:
    """Median seconds per call of each ``fn()`` in `fns`, the calls alternated (one round calls each once)."""
    for f in fns.values():
        jax.block_until_ready(f())
        jax.block_until_ready(f())
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f())
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def cell(t: float, f32: float) -> str:
    """Microseconds and speed against float32 (float32's time / this one: > 1 is faster)."""
    return f"{t * 1e6:.0f} ({f32 / t:.2f}x)"


SPEED: dict[str, float] = {}  # speed against float32 of what the reading below quotes


def per_layer(reps: int) -> list[list]:
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((K, N)).astype(np.float32) * 0.05)
    pw = packed.pack(w, "nvfp4-mse")
    wd = pw.dequantize(jnp.float32)
    lin = nnx.Linear(K, N, use_bias=False, rngs=nnx.Rngs(0))
    lin.kernel[...] = w
    rows = []
    for m, act in [(1, None), (2, None), (4, None), (8, None), (16, None), (1, "nvfp4-mse")]:
        x = jnp.asarray(rng.standard_normal((m, K)).astype(np.float32))
        fns = {}
        for name in ("chosen", "decode-then-dot", "fused"):
            with form(None if name == "chosen" else name):
                f = jax.jit(lambda x, p: backends.packed_matmul(x, p, gemm="dequant", activation=act)[0])
                f.lower(x, pw)  # traced under the form
                fns[name] = (lambda f=f: f(x, pw))
        xq = x if act is None else packed.fake_quantize(x, act)
        g = jax.jit(lambda x, w: x @ w)
        fns["float32"] = lambda: g(xq, wd)
        if act is None:
            qg, qs = nnx.split(qwix_model(lin, ".*", x))
            qf = jax.jit(lambda s, x: nnx.merge(qg, s)(x))
            fns["qwix"] = lambda: qf(qs, x)
        t = alternated(fns, reps)
        chosen = backends.plan(pw, act, "dequant", rows=m).form
        f32 = t["float32"]
        rows.append([m, "W4A16" if act is None else "W4A4", chosen, f"{f32 * 1e6:.0f}", cell(t["chosen"], f32),
                     cell(t["decode-then-dot"], f32), cell(t["fused"], f32),
                     cell(t["qwix"], f32) if "qwix" in t else ""])
        print(rows[-1], flush=True)
        if m == 1:
            tag = "W4A16" if act is None else "W4A4"
            SPEED[f"layer {tag}"] = f32 / t["chosen"]
            if "qwix" in t:
                SPEED["layer qwix"] = f32 / t["qwix"]
    return rows


def whole_model(name: str, reps: int) -> tuple[list[list], str]:
    if name == "tiny":
        model, cfg = Llama(preset("small"), rngs=nnx.Rngs(0)), preset("small")
        label = "the 'small' preset Llama (random weights)"
    else:
        model, _ = models.load(name)
        cfg = model.config
        label = name
    one = jnp.asarray([[7]], jnp.int32)
    sixteen = jnp.asarray(np.random.default_rng(16).integers(0, cfg.vocab, (1, 16)), jnp.int32)
    cache = KVCache.init(cfg, 1, 64)
    progs: dict[tuple[str, str], tuple] = {}

    def build(key: str, m: nnx.Module, mode: str | None = None) -> None:
        graph, state = nnx.split(m)
        with form(mode):
            step = jax.jit(lambda s, x, c, graph=graph: nnx.merge(graph, s)(x, cache=c)[0])
            t0 = time.perf_counter()
            step.lower(state, one, cache).compile()
            progs[(key, "decode")] = (lambda: step(state, one, cache), time.perf_counter() - t0)
            fwd = jax.jit(lambda s, x, graph=graph: nnx.merge(graph, s)(x))
            fwd.lower(state, sixteen).compile()
            progs[(key, "16")] = (lambda: fwd(state, sixteen), 0.0)
        print("built", key, flush=True)

    build("float32", model)
    try:
        build("Qwix nvfp4 PTQ W4A16", qwix_model(model, r".*_proj", one))
    except Exception as e:  # noqa: BLE001 (reported in the table)
        print("qwix failed:", e)
    for label_q, sch in (("W4A16", ptq.scheme("nvfp4-mse", weights_only=True)), ("W4A4", ptq.scheme("nvfp4-mse"))):
        m = models.load(name)[0] if name != "tiny" else Llama(preset("small"), rngs=nnx.Rngs(0))
        res = ptq.quantize_model(m, [ptq.Rule(path=r".*_proj", scheme=sch)], progress=False)
        ptq.pack_model(m, res)
        build(f"packed NVFP4 {label_q}", m)
        if label_q == "W4A16":
            build(f"packed NVFP4 {label_q}, XLA decode-then-dot", m, "decode-then-dot")
    rows = []
    for what in ("decode", "16"):
        fns = {k: f for (k, w), (f, _) in progs.items() if w == what}
        times = alternated(fns, reps)
        f32 = times["float32"]
        t = 1 if what == "decode" else 16
        for k, sec in times.items():
            rows.append(["1 (KV cache)" if what == "decode" else "16 (no cache)", k, f"{sec * 1e3:.1f}",
                         f"{t / sec:.1f}", f"{f32 / sec:.2f}x",
                         f"{progs[(k, what)][1]:.1f}" if what == "decode" else ""])
            print(rows[-1], flush=True)
            if what == "decode":
                SPEED[f"model {k}"] = f32 / sec
    return rows, label


def reading() -> str:
    """Issue 44's decode floor against this run's numbers (speed = float32's time / the model's)."""
    def get(k: str) -> str:
        return f"{SPEED[k]:.2f}x" if k in SPEED else "not measured"

    def verdict(k: str, floor: float) -> str:
        return "n/a" if k not in SPEED else ("met" if SPEED[k] >= floor else "NOT met")

    w16, w4, q = "model packed NVFP4 W4A16", "model packed NVFP4 W4A4", "model Qwix nvfp4 PTQ W4A16"

    def ahead(k: str, other: str) -> str:
        return "n/a" if k not in SPEED or other not in SPEED else ("ahead" if SPEED[k] > SPEED[other] else "NOT ahead")

    return (
        f"Reading (issue 44's decode floor, speed = float32's time / its time at M = 1): packed NVFP4 W4A16 "
        f"{get('layer W4A16')} per layer (floor 0.5x: {verdict('layer W4A16', 0.5)}; Qwix {get('layer qwix')}: "
        f"{ahead('layer W4A16', 'layer qwix')} of Qwix), "
        f"{get(w16)} whole-model decode step ({verdict(w16, 0.5)}; Qwix {get(q)}: {ahead(w16, q)} of Qwix; XLA "
        f"decode-then-dot "
        f"{get(w16 + ', XLA decode-then-dot')}); W4A4 {get('layer W4A4')} per layer and {get(w4)} whole model "
        f"(floor 0.33x: {verdict(w4, 1 / 3)}). The native GEMV reads the 4-bit codes and block scales and decodes in "
        f"registers, so at M = 1 it reads 4.5 bits a parameter where float32 reads 32. Past "
        f"M = {backends.NATIVE_GEMV_ROWS} (and for the 16-token forward) the XLA forms run: prefill speed is not "
        f"this kernel's.")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    t0 = time.time()
    load = os.getloadavg()[0]
    layer = per_layer(a.reps)
    model_rows, label = whole_model(a.model, a.reps)
    from jaxlowfp._core import native_gemv

    body = (
        f"`nice -n 19 .venv/bin/python bench/packed_decode.py --model {a.model} --reps {a.reps}` on {machine()}, "
        f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end ({time.time() - t0:.0f} s; a "
        f"shared CPU: only ratios count; medians of {a.reps} alternated calls). Native GEMV: "
        f"{native_gemv.status()[1].split(' (')[0]}.\n\n"
        f"Per layer: `x [M, {K}] @ W' [{K}, {N}]`, W' packed NVFP4 4/6 (W4A16; W4A4: x fake-quantized to NVFP4 "
        f"first), `backends.packed_matmul` on the \"dequant\" backend. Each cell: microseconds per call and, in "
        f"brackets, the speed against the float32 dot of the same weight (float32's time / its time: the tokens/s "
        f"ratio; > 1 is faster). \"chosen\" is the form the library runs (`backends.plan(..., rows=M).form`: "
        f"\"native-gemv\" at M <= {backends.NATIVE_GEMV_ROWS}); \"decode-then-dot\" and \"fused\" are the XLA "
        f"forms, forced; \"qwix\": Qwix's PTQ `nnx.Linear` (nvfp4, tile 16).\n\n"
        + markdown_table(["M", "weights x acts", "chosen form", "float32 us", "chosen", "decode-then-dot", "fused",
                          "qwix"], layer)
        + f"\n\nWhole model ({label}): float32; Qwix's nvfp4 PTQ of every `*_proj` (W4A16, tile 16); "
        f"`ptq.quantize_model` RTN NVFP4 4/6 of every `*_proj` then `ptq.pack_model` (W4A16, W4A4: activations "
        f"fake-quantized in XLA, then the kernel), and the packed W4A16 model with the native GEMV off (XLA "
        f"decode-then-dot, what ran before it). One jitted decode step (1 token, batch 1, a 64-slot KV cache) and "
        f"a 16-token forward (no cache); compile s: the decode step's.\n\n"
        + markdown_table(["tokens", "model", "ms / call", "tokens / s", "vs float32", "compile s"], model_rows)
        + "\n\n" + reading())
    print(body)
    if not a.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
