"""Memory and decode speed of SmolLM2-135M in float32, bfloat16, packed NVFP4 and packed HiF8
(`jaxlowfp.ptq.pack_model`),
and the log-prob difference between a packed model and its fake-quant twin.

    .venv/bin/python bench/packed_memory.py [--model smollm2-135m] [--configs float32 bfloat16 nvfp4 hif8] [--no-write]

Each configuration runs in a fresh interpreter (one run's allocations cannot hide another's):
  - float32 / bfloat16: ``models.load(name, dtype=..., param_dtype=...)``;
  - nvfp4: float32 load, ``ptq.quantize`` RTN of every ``*_proj`` layer to W4A4 NVFP4 4/6 (``scheme("nvfp4-mse")``),
    the fake-quant model's log-probs on a 128-token text, then ``ptq.pack_model`` (gemm "auto": dequantize + dot
    on this
    CPU), the packed model's log-probs (max |difference| reported);
  - hif8: the same with ``scheme("hif8")`` (W8A8, per-tensor scales);
  - nvfp4-load: the nvfp4 model exported (``ptq.export``, float32 high-precision tensors, by a process of its own)
    and loaded packed into an abstract model (``ptq.load(nnx.eval_shape(...), export, packed=True)``): no float
    kernel, no PTQ and no fake-quant program ever exist in that process, so its RSS and peaks are the packed
    model's own.
The packed models are saved with orbax and restored (size on disk, restored bit for bit). Then, with the model
built and the float copies dropped (``gc.collect()`` and glibc's ``malloc_trim(0)``, so the resident set counts
live memory and not freed heap pages): the parameter bytes (every leaf of ``nnx.state``), the
resident set (VmRSS), the peak resident set (VmHWM, reset through ``/proc/self/clear_refs`` before each phase) of a
jitted forward over 128 tokens and of a 128-token greedy generation (each phase's first call compiles; the peaks are
of a second, warm call, and "peak incl. compile" is the first call's), and decode tokens/s of the warm generation.
`bits / quantized param` is ``PackReport.bits_per_param`` (codes, block scales and global scales of the packed
layers). The tiny Llama's log-prob difference is measured the same way, in the parent.

Writes the ``## Packed models: memory and decode speed`` section of bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION = "Packed models: memory and decode speed"
TEXT = ("The quick brown fox jumps over the lazy dog. Memory is the first thing a quantized model should save: "
        "packed weights hold four bits per value and one scale per sixteen, and the rest of the model stays as it "
        "was. ") * 6

CHILD = r"""
import gc, json, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jaxlowfp import models, ptq
from jaxlowfp.models.llama import generate

name, config, text, export_dir = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key)) * 1024

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

def trim():  # hand freed heap pages back to the OS, so VmRSS counts what is alive (the float copies are not)
    gc.collect()  # (compiled programs stay cached: a PTQ'd process keeps its quantizers' and fake forward's)
    __import__("ctypes").CDLL("libc.so.6").malloc_trim(0)

dtype = "bfloat16" if config == "bfloat16" else "float32"
LOADS = {"nvfp4-load": "w4a4", "nvfp4-a16-load": "w4a16"}  # packed rows loaded from an export, and its folder
EXPORTS = {"export": "w4a4", "export-a16": "w4a16"}
if config in LOADS:  # the export's arrays straight into an abstract model: no float kernel is ever made
    from jaxlowfp.models import Llama, gguf_loader, resolve
    from jaxlowfp.ptq.packing import report_of
    export_dir = f"{export_dir}/{LOADS[config]}"
    path = resolve(name)
    reader = gguf_loader.open_reader(path)
    cfg, tok = gguf_loader.read_config(reader, path), gguf_loader.read_tokenizer(reader, path)
    del reader
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    ptq.load(model, export_dir, packed=True)
else:
    model, tok = models.load(name, dtype=dtype, param_dtype=dtype)
ids = tok.encode(text)[:128]
tokens = jnp.asarray([ids], jnp.int32)
if config == "qwix":  # Qwix's PTQ of every projection, NVFP4 weights in tiles of 16, as its docs configure nvfp4
    import qwix
    rules = [qwix.QtRule(module_path=r".*_proj", weight_qtype="nvfp4", tile_size=16)]
    model = qwix.quantize_model(model, qwix.PtqProvider(rules), tokens)

@jax.jit
def logprobs(g, s, t):
    return jax.nn.log_softmax(nnx.merge(g, s)(t), axis=-1)

out = {"config": config}
if config in LOADS:
    rep = report_of(model)
    out.update(bits=rep.bits_per_param, packed_layers=len(rep.layers), quantized_params=rep.params)
if config in ("nvfp4", "hif8", *EXPORTS):
    scheme = ptq.scheme("hif8" if config == "hif8" else "nvfp4-mse", weights_only=config == "export-a16")
    # (the export needs each layer's calibration input amax for its input_global_scale; RTN weights and per-token
    # activation scales do not depend on it, so the exported model is the nvfp4 row's)
    calib = np.asarray([ids], np.int32) if config == "export" else None
    res = ptq.quantize(model, [ptq.Rule(path=r".*_proj", scheme=scheme)], progress=False, calibration=calib)
    if config in EXPORTS:  # for the *-load rows: the model's export, and its fake-quant log-probs
        export_dir = f"{export_dir}/{EXPORTS[config]}"
        ptq.export(model, res, export_dir, dtype="float32")
        np.save(f"{export_dir}/fake_logprobs.npy", np.asarray(logprobs(*nnx.split(model), tokens)))
        print("RESULT " + json.dumps(out))
        sys.exit(0)
    fake = logprobs(*nnx.split(model), tokens)
    rep = ptq.pack_model(model, res)
    packed_lp = logprobs(*nnx.split(model), tokens)
    out.update(max_logprob_diff=float(jnp.max(jnp.abs(packed_lp - fake))), bits=rep.bits_per_param,
               packed_layers=len(rep.layers), backends=sorted({b for _, _, b, _ in rep.layers}),
               quantized_params=rep.params)
    del res, fake, packed_lp
    import tempfile, pathlib, orbax.checkpoint as ocp
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = ocp.StandardCheckpointer()
        _, st = nnx.split(model)
        ckpt.save(pathlib.Path(tmp) / "c", st)
        ckpt.wait_until_finished()
        out["disk_bytes"] = sum(f.stat().st_size for f in pathlib.Path(tmp).rglob("*") if f.is_file())
        back = ckpt.restore(pathlib.Path(tmp) / "c", jax.tree.map(ocp.utils.to_shape_dtype_struct, st))
        out["orbax_bitwise"] = all(
            a.dtype == b.dtype
            and bool(np.array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8)))
            for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(back), strict=True))
        del st, back, ckpt
trim()
graph, state = nnx.split(model)
out["param_bytes"] = int(sum(a.nbytes for a in jax.tree.leaves(state)))
out["rss_model"] = status("VmRSS")
for phase in ("forward", "generate"):
    for warm in (False, True):
        trim()
        reset_peak()
        t0 = time.perf_counter()
        if phase == "forward":
            lp = jax.block_until_ready(logprobs(graph, state, tokens))
        else:
            new = generate(model, [ids[:8]], max_new_tokens=128)
        dt = time.perf_counter() - t0
        out[f"peak_{phase}{'' if warm else '_compile'}"] = status("VmHWM")
        out[f"s_{phase}{'' if warm else '_compile'}"] = dt
    if phase == "forward":
        out["prefill_tok_s"] = tokens.shape[1] / dt
        if config in LOADS:  # the loaded packed model against the exporting process's fake-quant model
            fake = np.load(f"{export_dir}/fake_logprobs.npy")
            out["max_logprob_diff"] = float(np.max(np.abs(np.asarray(lp) - fake)))
        del lp
    if phase == "generate":
        out["decode_tok_s"] = len(new[0]) / dt
mem = logprobs.lower(graph, state, tokens).compile().memory_analysis()
out["xla_temp"] = int(mem.temp_size_in_bytes)
out["maxrss"] = __import__("resource").getrusage(__import__("resource").RUSAGE_SELF).ru_maxrss * 1024
print("RESULT " + json.dumps(out))
"""


CONFIGS = ("float32", "bfloat16", "nvfp4-a16-load", "nvfp4-load", "hif8", "qwix", "nvfp4")
DEFAULT_CONFIGS = CONFIGS[:6]
IN_PROCESS = ("hif8", "nvfp4")  # packed after PTQ in the row's process: its log-prob check compiled the forward
LOAD_EXPORTS = {"nvfp4-load": ("export", "w4a4"), "nvfp4-a16-load": ("export-a16", "w4a16")}


def run_child(name: str, config: str, export_dir: str = "") -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, name, config, TEXT, export_dir], capture_output=True,
                          text=True, cwd=ROOT, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{config}: the child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def tiny_llama_diffs() -> dict[str, float]:
    """max |log-prob difference| packed vs fake-quant on the 4-block tiny Llama, per scheme and backend."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxlowfp import ptq
    from jaxlowfp.models.llama import PRESETS, Llama

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 64)), jnp.int32)
    out = {}
    for scheme, backend in (("nvfp4-mse", "scaled_matmul"), ("nvfp4-mse", "dequant"), ("hif8", "dequant")):
        model = Llama(PRESETS["tiny"], rngs=nnx.Rngs(0))
        res = ptq.quantize(model, [ptq.Rule(path=r".*_proj", scheme=ptq.scheme(scheme))], progress=False)
        fake = jax.nn.log_softmax(model(tokens), -1)
        ptq.pack_model(model, res, gemm=backend)
        out[f"{scheme} ({backend})"] = float(jnp.max(jnp.abs(jax.nn.log_softmax(model(tokens), -1) - fake)))
    return out


def mb(b: float) -> str:
    return f"{b / 2**20:.0f}"


def render(results: list[dict], tiny: dict[str, float], model: str, loads: tuple[float, float],
           command: str = "", note: str = "") -> str:
    """The RESULTS.md section from the children's results and the tiny Llama's differences."""
    import jax

    sys.path.insert(0, str(ROOT / "bench"))
    from _results import markdown_table

    base = next((r for r in results if r["config"] == "float32"), None)

    def vs(r: dict, key: str) -> str:
        return f"{r[key]:.1f}" + (f" ({r[key] / base[key]:.2f}x)" if base else "")

    rows = []
    for r in results:
        rows.append([r["config"], mb(r["param_bytes"]), f"{r['bits']:.3f}" if "bits" in r else "-",
                     mb(r["rss_model"]), mb(r["peak_forward"]), mb(r["peak_forward_compile"]),
                     mb(r["peak_generate"]), mb(r["peak_generate_compile"]), f"{r['xla_temp'] / 2**20:.1f}",
                     vs(r, "prefill_tok_s"), vs(r, "decode_tok_s"),
                     (f"{r['s_forward_compile'] - r['s_forward']:.1f}" if r["config"] not in IN_PROCESS
                      else "- (compiled by the check)"),
                     f"{r['s_generate_compile'] - r['s_generate']:.1f}",
                     f"{r['max_logprob_diff']:.1e}" if "max_logprob_diff" in r else "-",
                     (f"{mb(r['disk_bytes'])} ({'bitwise' if r['orbax_bitwise'] else 'DIFFERS'})"
                      if "disk_bytes" in r else "-")])
    body = markdown_table(["model", "param MiB", "bits / quantized param", "RSS MiB", "peak forward MiB",
                           "peak forward incl. compile", "peak generate MiB", "peak generate incl. compile",
                           "XLA temp MiB (forward)", "prefill tok/s (vs float32)", "decode tok/s (vs float32)",
                           "compile s (forward)", "compile s (generate)",
                           "max \\|Δ log-prob\\| vs fake-quant", "orbax MiB (restore)"], rows)
    tiny_rows = markdown_table(["tiny Llama (4 blocks), scheme (backend)",
                                "max \\|Δ log-prob\\| packed vs fake-quant"],
                               [[k, f"{v:.1e}"] for k, v in tiny.items()])
    return (f"`{command or '.venv/bin/python bench/packed_memory.py'}` ({model}, jax {jax.__version__}, "
            f"{platform.machine()} CPU; each row a fresh process). Rows: float32 and bfloat16 are "
            "`models.load(dtype=..., param_dtype=...)`; nvfp4-load (W4A4: NVFP4 4/6 mse weights, NVFP4 4/6 "
            "per-token activations) and nvfp4-a16-load (W4A16: the same weights, float32 activations) are RTN PTQ "
            "of every projection, exported (`ptq.export`, by a process of its own) and loaded packed "
            "(`ptq.load(abstract model, export, packed=True)`) in a process that never held a float kernel, PTQ or "
            "a fake-quant program, so their RSS and peaks are the packed model's own (log-prob difference against "
            "the exporting process's fake-quant model); hif8 is RTN W8A8 HiF8 packed by `ptq.pack_model` in the "
            "process that ran PTQ and the fake-quant forward (its RSS and peaks include those programs; param MiB "
            "does not; the log-prob check compiled its forward, so its forward's first call is warm); qwix is "
            "Qwix's PTQ of every projection (`qwix.PtqProvider`, `weight_qtype=\"nvfp4\"`, `tile_size=16`, as "
            "its docs configure nvfp4: W4A16) of the float32 model, the float model dropped. Packed "
            "products: gemm auto (the dequant backend: the native CPU GEMV at M <= 8, decode and "
            "dot above); the run-time activation quantizer is one shared program per shape "
            "(`backends.shared_quantizer`). Embeddings (tied with the head) and norms stay float32 (bfloat16 in "
            "the bfloat16 row). RSS is VmRSS with the model built (after gc and malloc_trim). Peaks are VmHWM "
            "(reset through /proc/self/clear_refs) of a warm call, 'incl. compile' of the first call: a jitted "
            "log-softmax forward over 128 tokens, and a 128-token greedy generation from an 8-token prompt "
            "(`models.llama.generate`). Prefill tok/s: 128 / the warm forward's seconds; decode tok/s: 128 / the "
            "warm generation's seconds; compile s: first call's seconds minus the warm call's. XLA temp: "
            "`compile().memory_analysis().temp_size_in_bytes` of the forward. Load average "
            f"{loads[0]:.1f} at the start and {loads[1]:.1f} at the end on {os.cpu_count()} cores (shared with other "
            "jobs): seconds and tokens/s are indicative only; memory is not load-dependent."
            + (f" {note}" if note else "") + "\n\n"
            + body + ("\n\n" + tiny_rows if tiny else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                    help=f"rows, each a fresh process, of {', '.join(CONFIGS)} (default: %(default)s)")
    ap.add_argument("--export-dir", default=None,
                    help="keep the exports the *-load rows read here, and reuse those already there (default: a "
                         "temporary folder)")
    ap.add_argument("--no-tiny", action="store_true", help="skip the tiny Llama's log-prob differences")
    ap.add_argument("--results", default=None,
                    help="append each row's raw result (JSON lines) to this file as it completes")
    ap.add_argument("--render", default=None,
                    help="no runs: render the section from a --results file (rows in its order)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    command = "nice -n 19 .venv/bin/python bench/packed_memory.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    sys.path.insert(0, str(ROOT / "bench"))
    from _results import write_section

    import tempfile

    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        ap.error(f"--configs: unknown {bad}; allowed: {', '.join(CONFIGS)}")
    if args.render:
        lines = [json.loads(ln) for ln in Path(args.render).read_text().splitlines() if ln.strip()]
        meta = next((ln for ln in lines if "command" in ln), {})
        text = render([ln for ln in lines if "config" in ln], meta.get("tiny", {}), args.model,
                      tuple(meta.get("loads", (float("nan"), float("nan")))), meta.get("command", ""),
                      meta.get("note", ""))
        print(text)
        if not args.no_write:
            write_section(SECTION, text)
        return 0
    load0 = os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        export_dir = args.export_dir or tmp
        for load, (export, sub) in LOAD_EXPORTS.items():
            if load in args.configs and not (Path(export_dir) / sub / "fake_logprobs.npy").is_file():
                run_child(args.model, export, export_dir)
        for c in args.configs:
            r = run_child(args.model, c, export_dir)
            print(json.dumps(r), flush=True)
            results.append(r)
            if args.results:
                with open(args.results, "a") as f:
                    f.write(json.dumps(r) + "\n")
    tiny = {} if args.no_tiny else tiny_llama_diffs()
    print(json.dumps(tiny))
    loads = (load0, os.getloadavg()[0])
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps({"command": command, "tiny": tiny, "loads": loads}) + "\n")
    text = render(results, tiny, args.model, loads, command)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
