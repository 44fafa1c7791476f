"""The lm-eval backend (`jaxlowfp.harness`) on SmolLM2-135M: what the adapter costs, and the local tasks.

1. Throughput of ``loglikelihood`` requests at batch 8: multiple-choice requests (a held-out Shakespeare context of
   ``--context-bytes`` bytes and four continuations each, `train.evaluate.build_choice_task`) scored by the library's
   own loop (`jaxlowfp.evaluation.choice_requests` + `score_requests`), by the backend's ``loglikelihood`` (lm-eval's
   TemplateLM tokenization, left truncation, ``is_greedy``), and by a whole ``lm_eval.simple_evaluate`` of the same
   items as a multiple-choice task (lm-eval builds the requests and the metrics too). Compilation happens before
   timing (one padded shape, shared by all three); the three are interleaved, ``--reps`` times: requests/s of the
   best and of the median pass, and the seconds spent outside the model's forward passes (the adapter's own cost).
   Goal: the backend at least 0.9x the library's requests/s.
2. The local lm-eval tasks of ``tests/lm_eval_tasks`` (multiple choice, rolling perplexity, generation) through
   ``simple_evaluate`` on SmolLM2 in high precision and with HiF8 W8A8 and NVFP4 4/6 (MSE) W4A4 fake quantization of
   the middle blocks' MLPs (`jaxlowfp.harness.fake_quantize_model`, the Max-Window paper's layers): the table the README
   shows (local tasks: these machines cannot download lm-eval's datasets).

Writes the ``## lm-eval backend (SmolLM2-135M)`` section of bench/RESULTS.md.

    .venv/bin/python bench/lm_eval_backend.py [--items 8] [--reps 5] [--context-bytes 160] [--no-tasks]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _results import machine, markdown_table, write_section  # noqa: E402  (puts the checkout root on sys.path)
from lm_eval.api.instance import Instance  # noqa: E402

from jaxlowfp import evaluation as ev  # noqa: E402
from jaxlowfp.harness import LM_EVAL_VERSION, JaxLowFPLM, choice_task, evaluate, fake_quantize_model  # noqa: E402
from jaxlowfp.models import load  # noqa: E402
from train.data import load_domain  # noqa: E402
from train.evaluate import build_choice_task  # noqa: E402
from train.text_eval import choice_items  # noqa: E402

TASKS = Path(__file__).resolve().parents[1] / "tests" / "lm_eval_tasks"
BATCH = 8


def throughput(model, tok, args) -> tuple[str, dict]:
    task = build_choice_task(load_domain("shakespeare").val, n_items=args.items, context_len=args.context_bytes,
                             continuation_len=64, seed=0)
    items = choice_items(task)
    n = sum(len(it.choices) for it in items)
    lm = JaxLowFPLM(model=model, tokenizer=tok, batch_size=BATCH, max_length=args.max_length)
    insts = [Instance(request_type="loglikelihood", doc={}, arguments=(it.context, c), idx=j)
             for it in items for j, c in enumerate(it.choices)]
    mc = choice_task("bench_choice", items)

    def library():
        reqs = ev.choice_requests(tok, items, max_length=args.max_length)
        return ev.score_requests(model, reqs, batch_size=BATCH)[0]

    def backend():
        return [ll for ll, _ in lm.loglikelihood(insts)]

    def whole():
        return evaluate(lm, [mc], log_samples=False)

    runs = {"library loop (choice_requests + score_requests)": library,
            "backend loglikelihood (lm-eval tokenization, is_greedy)": backend,
            "lm_eval.simple_evaluate (multiple-choice task)": whole}
    lengths = [len(r.tokens) - 1 for r in ev.choice_requests(tok, items, max_length=args.max_length)]
    a, b = library(), backend()  # compile (one padded shape), and the two agree
    worst = max(abs(x - y) for x, y in zip(a, b))
    whole()
    times = {k: [] for k in runs}
    overhead = {k: [] for k in runs}  # seconds outside the batched forward passes (tokenization, requests, metrics)
    for _ in range(args.reps):
        for k, fn in runs.items():
            t = time.perf_counter()
            if k.startswith("library"):
                reqs = ev.choice_requests(tok, items, max_length=args.max_length)
                t1 = time.perf_counter()
                ev.score_requests(model, reqs, batch_size=BATCH)
                overhead[k].append(t1 - t)
            else:
                lm.calls.clear()
                fn()
                overhead[k].append(time.perf_counter() - t - sum(c["seconds"] for c in lm.calls))
            times[k].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    base_b, base_m = best[next(iter(runs))], med[next(iter(runs))]
    rows = [[k, f"{n / best[k]:.2f}", f"{base_b / best[k]:.2f}x", f"{n / med[k]:.2f}", f"{base_m / med[k]:.2f}x",
             f"{1000 * statistics.median(overhead[k]):.0f}"] for k in runs]
    table = markdown_table(["scoring", "requests/s (best pass)", "vs library", "requests/s (median)", "vs library",
                            "ms outside the forward passes (median)"], rows)
    text = (f"{args.items} items x 4 choices = {n} `loglikelihood` requests ({min(lengths)}..{max(lengths)} model "
            f"inputs, padded to {ev._bucket(max(lengths))}), batch {BATCH}, float32, {args.reps} interleaved passes "
            f"after compilation (best and median); largest difference between the library's and the backend's "
            f"log-likelihoods {worst:.1e}. The last column is the adapter's own cost: tokenization, request "
            f"building (and for simple_evaluate lm-eval's task setup and metrics), without the model.\n\n{table}")
    return text, {k: n / v for k, v in best.items()}


def local_tasks(args) -> str:
    rows = []
    metrics = [("jaxlowfp_local_mc", "acc,none", "MC acc", ".3f"), ("jaxlowfp_local_mc", "acc_norm,none",
                                                                    "MC acc_norm", ".3f"),
               ("jaxlowfp_local_rolling", "word_perplexity,none", "word ppl", ".2f"),
               ("jaxlowfp_local_rolling", "byte_perplexity,none", "byte ppl", ".4f"),
               ("jaxlowfp_local_gen", "exact_match,strip", "gen exact match", ".3f")]
    for quant in ("none", "hif8", "nvfp4"):
        model, tok = load("smollm2-135m")
        label = "high precision" if quant == "none" else {"hif8": "HiF8 W8A8", "nvfp4": "NVFP4 4/6 (mse) W4A4"}[quant]
        if quant != "none":
            fake_quantize_model(model, quant)
        t = time.perf_counter()
        res = evaluate(JaxLowFPLM(model=model, tokenizer=tok, batch_size=BATCH), [str(TASKS)], log_samples=False)
        r = res["results"]
        rows.append([label] + [format(r[task][key], spec) for task, key, _, spec in metrics]
                    + [f"{time.perf_counter() - t:.0f}"])
        print(rows[-1], flush=True)
    header = ["SmolLM2-135M"] + [m[2] for m in metrics] + ["s"]
    return ("The local tasks of `tests/lm_eval_tasks` (8 multiple-choice questions, 4 short documents, 6 sentence "
            "completions; written for the tests: they show that the pipeline runs, not how good the model is) "
            "through `lm_eval.simple_evaluate`; quantization of the MLPs of blocks 3..27 (paper_rules, keep_first 3, "
            "keep_last 2), seconds include compilation:\n\n" + markdown_table(header, rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--context-bytes", type=int, default=160)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--no-tasks", action="store_true", help="skip the local-task table")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args()
    load_avg = os.getloadavg()[0]
    model, tok = load("smollm2-135m")
    text, rates = throughput(model, tok, args)
    print(text, flush=True)
    parts = [f"{machine()}, lm-eval {LM_EVAL_VERSION}; load average {load_avg:.1f} at the start "
             f"(2 cores shared with other work: absolute times vary, the interleaved ratios less).", text]
    if not args.no_tasks:
        parts.append(local_tasks(args))
        print(parts[-1])
    if not args.no_write:
        write_section("lm-eval backend (SmolLM2-135M)", "\n\n".join(parts) + "\n\nCommand: `.venv/bin/python "
                      "bench/lm_eval_backend.py`.")


if __name__ == "__main__":
    main()
