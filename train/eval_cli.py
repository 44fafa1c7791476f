"""``python -m train eval`` and ``python -m train generate``: a real checkpoint's perplexity table, and greedy text.

    python -m train eval --model smollm2-135m                 # or a .gguf file, or a Hugging Face directory
    python -m train eval --model smollm2-135m --quantize hif8 # HiF8 W8A8 fake quantization of the middle MLPs
    python -m train generate --model smollm2-135m --prompt "The capital of France is"

``eval`` prints word / byte / token perplexity of held-out Shakespeare, Python standard library and English prose
(`train.text_eval`), the multiple-choice accuracy with the real tokenizer and the throughput, and writes the table to
``<out>/report.md`` (default ``runs/eval-<model>/``). Everything is scored through lm-eval with the library's backend
(`jaxlowfp.harness`): the texts and the choice task are local in-memory lm-eval tasks, and ``--tasks`` adds lm-eval
tasks by name (``hellaswag,arc_challenge,mmlu,wikitext``: their datasets come from the Hugging Face hub) or local
task YAML files and directories, with lm-eval's own table in the report. Its defaults (4096 tokens per text,
48 items) take about 2 minutes of CPU time (SmolLM2-135M, float32; 4.5 minutes of wall time on a busy 2-core
machine); ``--max-tokens``, ``--mc-items``, ``--max-length`` and ``--stride`` evaluate more.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from jaxlowfp.registry import EVAL_QUANTIZE

__all__ = ["main", "main_generate", "parse_eval_args", "parse_generate_args"]

QUANT_CHOICES = EVAL_QUANTIZE  # none, hif8, nvfp4, nvfp4-<rule>, if4-<rule>, fp8 (jaxlowfp.registry)


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="registry name (smollm2-135m), a .gguf file or a Hugging Face directory (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype; parameters stay float32 (default: %(default)s)")


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int; got {text}")
    return v


def parse_eval_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train eval", description=__doc__.split("\n\n")[0])
    _model_arg(p)
    p.add_argument("--texts", default="shakespeare,python,prose",
                   help="comma-separated texts to score (default: %(default)s)")
    p.add_argument("--max-tokens", type=_positive, default=4096,
                   help="tokens scored per text (default: %(default)s)")
    p.add_argument("--max-length", type=_positive, default=512,
                   help="rolling-window length in tokens (default: %(default)s)")
    p.add_argument("--stride", type=_positive, default=None,
                   help="new tokens scored per window after the first; less than --max-length gives every later "
                        "window max-length - stride tokens of extra context (default: max-length, lm-eval's "
                        "disjoint windows)")
    p.add_argument("--batch-size", type=_positive, default=8, help="sequences per forward pass (default: %(default)s)")
    p.add_argument("--mc-items", type=int, default=48,
                   help="multiple-choice items from held-out Shakespeare, 0 to skip (default: %(default)s)")
    p.add_argument("--quantize", default="none", choices=QUANT_CHOICES,
                   help="fake-quantize the middle blocks' MLPs (jaxlowfp.qnnx.paper_rules, keep_first 3, keep_last "
                        "2): HiF8 W8A8 or NVFP4 4/6 W4A4 (default: %(default)s)")
    p.add_argument("--keep-first", type=int, default=3)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--act-scale", default="token", choices=("token", "tensor"),
                   help="quantized activations' amax: each token's own (a score never depends on its batch) or the "
                        "whole batch's (default: %(default)s; jaxlowfp.harness.eval_recipe)")
    p.add_argument("--tasks", default=None,
                   help="comma-separated lm-eval tasks scored as well: names (hellaswag, arc_challenge, mmlu, "
                        "wikitext; datasets from the Hugging Face hub) or local task YAML files / directories")
    p.add_argument("--limit", type=_positive, default=None, help="at most this many documents per --tasks task")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples for --tasks (lm-eval's default)")
    p.add_argument("--out", default=None, help="report directory (default: runs/eval-<model>)")
    p.add_argument("--seed", type=int, default=0, help="seed of the multiple-choice task (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(list(argv))
    from .text_eval import TEXTS

    args.texts = [t.strip() for t in args.texts.split(",") if t.strip()]
    bad = [t for t in args.texts if t not in TEXTS]
    if bad or not args.texts:
        p.error(f"--texts: unknown {bad}; allowed: {', '.join(TEXTS)}")
    args.stride = args.stride or args.max_length
    if args.stride > args.max_length:
        p.error(f"--stride {args.stride} must be <= --max-length {args.max_length}")
    if args.mc_items < 0:
        p.error("--mc-items must be >= 0")
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else []
    return args


def _model_name(model: str) -> str:
    name = Path(model).stem if ("/" in model or model.endswith(".gguf")) else model
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


def _load(model: str, dtype: str) -> tuple[Any, Any, float]:
    from jaxlowfp.models import CheckpointError, load

    t0 = time.perf_counter()
    try:
        m, tok = load(model, dtype=dtype)
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from e
    return m, tok, time.perf_counter() - t0


def quantize_model(model: Any, kind: str, *, keep_first: int, keep_last: int, act_scale: str = "token") -> str:
    """Swap the middle blocks' MLP projections for fake-quantized ones (``kind``: a name of
    `jaxlowfp.registry.EVAL_QUANTIZE`, e.g. hif8 or nvfp4; activations scaled per ``act_scale``,
    `jaxlowfp.harness.eval_recipe`); the report."""
    from jaxlowfp import qat, qnnx
    from jaxlowfp.harness import eval_recipe

    recipe = eval_recipe(qat.named_recipe(kind), act_scale)
    report = qnnx.quantize_model(model, qnnx.paper_rules(model.config.n_layers, keep_first=keep_first,
                                                         keep_last=keep_last, recipe=recipe))
    return "; ".join(str(report).splitlines()[-2:]) + f"; activation scale: {act_scale}"


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and (math.isnan(v))):
        return "-"
    return format(v, spec) if spec else str(v)


HEADER = ["text", "docs", "tokens", "words", "bytes", "word ppl", "byte ppl", "bits/byte", "token ppl", "tok/s"]


def _rows(scores: list[Any]) -> list[list[str]]:
    return [[s.name, str(s.docs), str(s.tokens), str(s.words), str(s.bytes), _fmt(s.word_perplexity, ".3f"),
             _fmt(s.byte_perplexity, ".4f"), _fmt(s.bits_per_byte, ".4f"), _fmt(s.token_perplexity, ".3f"),
             _fmt(s.tokens_per_s, ".0f")] for s in scores]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m train eval``."""
    args = parse_eval_args(sys.argv[1:] if argv is None else argv)
    from . import evaluate as ev
    from .data import DataError, load_domain
    from .report import text_table
    from .text_eval import CHOICE_TASK, lm_eval_note, load_texts, perplexity, score_choices_tokens, text_task

    t0 = time.perf_counter()
    model, tok, load_s = _load(args.model, args.dtype)
    print(f"model {args.model}: {model.config.num_params() / 1e6:.1f} M parameters, {model.config.n_layers} blocks, "
          f"vocab {model.config.vocab}, compute {args.dtype}; loaded in {load_s:.1f} s", file=sys.stderr)
    quant = None
    if args.quantize != "none":
        quant = quantize_model(model, args.quantize, keep_first=args.keep_first, keep_last=args.keep_last,
                               act_scale=args.act_scale)
        print(f"quantized ({args.quantize}): {quant}", file=sys.stderr)
    try:
        texts = load_texts(args.texts)
    except DataError as e:
        raise SystemExit(f"error: {e}") from e
    kw = dict(max_tokens=args.max_tokens, max_length=args.max_length, stride=args.stride,
              batch_size=args.batch_size, progress=not args.no_progress)
    scores = [perplexity(model, tok, docs, name=name, **kw) for name, docs in texts.items()]
    mc = None
    if args.mc_items:
        task = ev.build_choice_task(load_domain("shakespeare").val, n_items=args.mc_items, seed=args.seed)
        mc = score_choices_tokens(model, tok, task, max_length=args.max_length, batch_size=args.batch_size,
                                  progress=not args.no_progress)
    extra = _lm_eval_tasks(model, tok, args) if args.tasks else None
    wall = time.perf_counter() - t0
    scored = sum(s.tokens for s in scores)
    score_s = sum(s.seconds for s in scores)

    name = _model_name(args.model) + ("" if args.quantize == "none" else f"-{args.quantize}")
    lines_mc = (f"multiple choice (held-out Shakespeare, {int(mc['items'])} items, 4 choices, chance 0.25): "
                f"acc {mc['acc']:.3f}, acc_norm {mc['acc_norm']:.3f}" if mc else "multiple choice: skipped")
    summary = (f"{scored} tokens scored in {score_s:.0f} s ({scored / score_s:.0f} scored tok/s incl. compilation); "
               f"total wall time {wall:.0f} s (loading {load_s:.0f} s)")
    note = lm_eval_note([text_task(s.name) for s in scores] + ([CHOICE_TASK] if mc else [])
                        + (list(extra[2]) if extra is not None else []))
    print(text_table(HEADER, _rows(scores)))
    print(lines_mc)
    print(summary)
    print(note)
    if extra is not None:
        print(extra[0])

    out = Path(args.out or f"runs/eval-{name}")
    out.mkdir(parents=True, exist_ok=True)
    settings = (f"rolling windows of {args.max_length} tokens, stride {args.stride}, at most {args.max_tokens} "
                f"tokens per text, batch {args.batch_size}, compute {args.dtype}")
    report = "\n\n".join([
        f"# Evaluation of {args.model}" + (f" ({args.quantize} fake quantization)" if quant else ""),
        f"{model.config.num_params() / 1e6:.1f} M parameters; {settings}." + (f" Quantized: {quant}." if quant else ""),
        text_table(HEADER, _rows(scores), markdown=True),
        lines_mc + ".",
        summary + ".",
        note + ".",
        *([f"lm-eval tasks ({extra[1]}):\n\n{extra[0]}"] if extra is not None else []),
        "word/byte perplexity: lm-eval's `loglikelihood_rolling` definitions (exp of minus the total log-likelihood "
        "per whitespace-separated word / per UTF-8 byte); token ppl per model token. Texts: validation parts of "
        "train.data's Shakespeare and Python-stdlib domains, and the last 10 % of Alice's Adventures in Wonderland "
        "(see train/text_eval.py).",
    ]) + "\n"
    (out / "report.md").write_text(report)
    results = {"model": args.model, "quantize": args.quantize, "settings": vars(args) | {"texts": args.texts},
               "texts": [dict(vars(s), word_perplexity=s.word_perplexity, byte_perplexity=s.byte_perplexity,
                              token_perplexity=s.token_perplexity, bits_per_byte=s.bits_per_byte) for s in scores],
               "multiple_choice": mc, "wall_s": wall, "load_s": load_s, "lm_eval": note,
               "lm_eval_tasks": None if extra is None else extra[2]}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"report: {out / 'report.md'}")
    return 0


def _lm_eval_tasks(model: Any, tok: Any, args: argparse.Namespace) -> tuple[str, str, dict]:
    """lm-eval's table of the ``--tasks`` (the model's whole window, as lm-eval's own backends), a line on the
    settings, and the results."""
    from lm_eval.utils import make_table

    from jaxlowfp.harness import JaxLowFPLM, evaluate

    lm = JaxLowFPLM(model=model, tokenizer=tok, batch_size=args.batch_size, progress=not args.no_progress)
    try:
        res = evaluate(lm, args.tasks, limit=args.limit, num_fewshot=args.num_fewshot, log_samples=False)
    except (ConnectionError, OSError, ValueError, KeyError) as e:
        raise SystemExit(f"error: --tasks {','.join(args.tasks)}: {type(e).__name__}: {e} (lm-eval's tasks "
                         "download their datasets from the Hugging Face hub; without access, give local task "
                         "YAML files)") from e
    settings = (f"limit {args.limit}, num_fewshot {args.num_fewshot}, batch {args.batch_size}, windows of "
                f"{lm.max_length} tokens")
    table = make_table(res) + (make_table(res, "groups") if "groups" in res else "")
    return table, settings, res["results"]


def parse_generate_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train generate", description="Continue a prompt with a checkpoint.")
    _model_arg(p)
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=_positive, default=48, help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)")
    p.add_argument("--top-k", type=_positive, default=None, help="sample among the k most likely tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as one user turn of a ChatML chat (<|im_start|>user ... assistant)")
    p.add_argument("--quantize", default="none", choices=QUANT_CHOICES)
    args = p.parse_args(list(argv))
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    return args


def main_generate(argv: Sequence[str] | None = None) -> int:
    """``python -m train generate``."""
    args = parse_generate_args(sys.argv[1:] if argv is None else argv)
    from jaxlowfp.models.llama import generate

    model, tok, _ = _load(args.model, args.dtype)
    if args.quantize != "none":
        quantize_model(model, args.quantize, keep_first=3, keep_last=2)
    prompt = args.prompt
    stop = tok.eos_id
    if args.chat:
        if tok.token_id("<|im_start|>") is None or tok.token_id("<|im_end|>") is None:
            raise SystemExit("error: --chat needs a ChatML tokenizer (<|im_start|>, <|im_end|>)")
        prompt = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
        stop = tok.token_id("<|im_end|>")
    ids = tok.encode(prompt)
    t0 = time.perf_counter()
    out = generate(model, [ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   eos_id=stop, seed=args.seed)[0]
    dt = time.perf_counter() - t0
    text = tok.decode(out[:-1] if out and out[-1] == stop else out)
    print(text if args.chat else args.prompt + text)
    print(f"({len(out)} tokens in {dt:.1f} s, compilation included)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
