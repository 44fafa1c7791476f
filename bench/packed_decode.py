"""Decode-shaped products of a packed weight (issue 44): per layer at M = 1..256 and whole-model forwards, packed NVFP4
against float32, side by side in one run (medians of alternated calls; only ratios count on a shared CPU).

    .venv/bin/python bench/packed_decode.py [--model smollm2-135m | tiny] [--reps 15] [--no-write]

Per layer: ``x [M, 576] @ W' [576, 1536]`` (a SmolLM2-135M MLP projection), W' packed to NVFP4 4/6 (W4A16), by
`jaxlowfp.backends.packed_matmul` on the "dequant" backend (this CPU's), in three forms:
  - "chosen": what the library runs (`backends.plan(..., rows=M).form`: decode-then-dot at M <= DECODE_THEN_DOT_ROWS,
    else the decode fused into the dot by XLA);
  - "fused" and "decode-then-dot": each form forced at every M;
and the float32 dot of the same (decoded) weight. W4A4 (the input fake-quantized to NVFP4 first) at M = 1 too.

Whole model: `models.load(model)` in float32, ``ptq.quantize_model`` RTN of every ``*_proj`` to NVFP4 4/6 W4A16,
``ptq.pack_model``; jitted forwards of 1 token and of 16 tokens, float32 against the packed model, and the packed model
as it ran before issue 44 (no `backends.after_input` barrier, the decode always fused: both patched out while its
programs are traced), with the XLA temp bytes of each compiled forward.

Writes the ``## Packed decode (M = 1) and short forwards`` section of bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from _results import machine, markdown_table, write_section
from flax import nnx

from jaxlowfp import backends, models, packed, ptq
from jaxlowfp.models.llama import Llama, preset

SECTION = "Packed decode (M = 1) and short forwards"
K, N = 576, 1536
NOTE = ("Reading: at M = 1 \"chosen\" and \"decode-then-dot\" are the same program, so their gap is this shared "
        "CPU's noise. Decode-then-dot writes the float32 weight on every call and then reads it, so it cannot reach "
        "float32's GEMV; issue 44's floor (packed decode >= 0.5x float32) needs a GEMV that reads the packed codes (a "
        "custom kernel), not done here. The XLA temp of the packed forward is float32's plus the decoded weights of "
        "the layers that share one input (gate/up: 2 x 3.5 MB); before issue 44 it was every projection's.")


@contextlib.contextmanager
def form(name: str | None):
    """Force the "dequant" form (None: the library's choice); "before": no barrier and the fused form (pre issue 44).
    Only while tracing: a jitted program keeps what it was traced with."""
    saved = backends.dequant_form, backends.after_input
    if name in ("fused", "before"):
        backends.dequant_form = lambda rows: "fused"
    elif name == "decode-then-dot":
        backends.dequant_form = lambda rows: "decode-then-dot"
    if name == "before":
        backends.after_input = lambda x, w: (x, w)
    try:
        yield
    finally:
        backends.dequant_form, backends.after_input = saved


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


def per_layer(reps: int) -> list[list]:
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((K, N)).astype(np.float32) * 0.05)
    pw = packed.pack(w, "nvfp4-mse")
    wd = pw.dequantize(jnp.float32)
    rows = []
    for m, act in [(1, None), (2, None), (4, None), (16, None), (256, None), (1, "nvfp4-mse")]:
        x = jnp.asarray(rng.standard_normal((m, K)).astype(np.float32))
        fns = {}
        for name in ("chosen", "fused", "decode-then-dot"):
            with form(None if name == "chosen" else name):
                f = jax.jit(lambda x, p: backends.packed_matmul(x, p, gemm="dequant", activation=act)[0])
                f.lower(x, pw)  # traced under the form
                fns[name] = (lambda f=f: f(x, pw))
        xq = x if act is None else packed.fake_quantize(x, act)
        g = jax.jit(lambda x, w: x @ w)
        fns["float32"] = lambda: g(xq, wd)
        t = alternated(fns, reps)
        chosen = backends.plan(pw, act, "dequant", rows=m).form
        f32 = t["float32"]
        rows.append([m, "W4A16" if act is None else "W4A4", chosen, f"{f32 * 1e6:.0f}",
                     f"{t['chosen'] / f32:.1f}x", f"{t['fused'] / f32:.1f}x", f"{t['decode-then-dot'] / f32:.1f}x"])
        print(rows[-1], flush=True)
    return rows


def whole_model(name: str, reps: int) -> tuple[list[list], str]:
    if name == "tiny":
        model, cfg = Llama(preset("small"), rngs=nnx.Rngs(0)), preset("small")
        label = "the 'small' preset Llama (random weights)"
    else:
        model, _ = models.load(name)
        cfg = model.config
        label = name
    vocab = cfg.vocab
    tok = {t: jnp.asarray(np.random.default_rng(t).integers(0, vocab, (1, t)), jnp.int32) for t in (1, 16)}
    long = jax.ShapeDtypeStruct((4, min(256, cfg.max_seq_len)), jnp.int32)  # compiled only: its XLA temp
    progs: dict[tuple[str, int], tuple] = {}
    long_temp: dict[str, int] = {}

    def build(key: str, m: nnx.Module, mode: str | None) -> None:
        graph, state = nnx.split(m)
        for t, tokens in tok.items():
            with form(mode):
                f = jax.jit(lambda s, x, graph=graph: nnx.merge(graph, s)(x))
                temp = f.lower(state, tokens).compile().memory_analysis().temp_size_in_bytes
            progs[(key, t)] = (f, state, tokens, temp)
        with form(mode):
            f = jax.jit(lambda s, x, graph=graph: nnx.merge(graph, s)(x))
            long_temp[key] = f.lower(state, long).compile().memory_analysis().temp_size_in_bytes

    build("float32", model, None)
    res = ptq.quantize_model(model, [ptq.Rule(path=r".*_proj", scheme=ptq.scheme("nvfp4-mse", weights_only=True))],
                             progress=False)
    ptq.pack_model(model, res)
    build("packed", model, None)
    build("packed, before issue 44", model, "before")
    rows = []
    for t in tok:
        fns = {k: (lambda f=f, s=s, x=x: f(s, x)) for (k, tt), (f, s, x, _) in progs.items() if tt == t}
        times = alternated(fns, reps)
        f32 = times["float32"]
        for k, sec in times.items():
            rows.append([t, k, f"{sec * 1e3:.1f}", f"{sec / f32:.2f}x", f"{t / sec:.0f}",
                         f"{progs[(k, t)][3] / 1e6:.1f}"])
            print(rows[-1], flush=True)
    for k, temp in long_temp.items():
        rows.append([f"{long.shape[0]}x{long.shape[1]}", k, "", "", "", f"{temp / 1e6:.1f}"])
        print(rows[-1], flush=True)
    return rows, label


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    layer = per_layer(a.reps)
    model_rows, label = whole_model(a.model, a.reps)
    body = (
        f"`bench/packed_decode.py --model {a.model} --reps {a.reps}` on {machine()} (a shared CPU: only ratios "
        f"count; medians of {a.reps} alternated calls).\n\n"
        f"Per layer: `x [M, {K}] @ W' [{K}, {N}]`, W' packed NVFP4 4/6, `backends.packed_matmul` on the \"dequant\" "
        f"backend; time / the float32 dot of the same weight. \"chosen\" is the form the library runs "
        f"(`backends.plan(..., rows=M).form`; decode-then-dot at M <= {backends.DECODE_THEN_DOT_ROWS}).\n\n"
        + markdown_table(["M", "weights x acts", "chosen form", "float32 us", "chosen", "fused", "decode-then-dot"],
                         layer)
        + f"\n\nWhole model ({label}), NVFP4 4/6 W4A16 packed (`ptq.pack_model`), jitted forward of T tokens (batch "
        f"1, no cache); \"before issue 44\": the same packed model traced without the decode barrier and with the "
        f"decode always fused. XLA temp: `compile().memory_analysis().temp_size_in_bytes`; 4x256: compiled, "
        f"not run.\n\n"
        + markdown_table(["T", "model", "ms / forward", "vs float32", "tokens / s", "XLA temp MB"], model_rows)
        + "\n\n" + NOTE)
    print(body)
    if not a.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
