"""``python -m train ptq``: the Four Over Six paper's PTQ experiment on a real checkpoint (`jaxlowfp.ptq`).

    python -m train ptq --model smollm2-135m                  # defaults: static_6 vs 4/6 mse vs HiF8 (see below)
    python -m train ptq --model smollm2-135m --formats all    # every format (28 models: roughly 25 minutes, not timed)
    python -m train ptq --model smollm2-135m --full           # the full sizes (hours on a CPU)

Every method (RTN, GPTQ, SmoothQuant, AWQ) x every format of ``--formats`` (NVFP4 static_6 / static_4 / 4/6 abs_max
/ mae / mse, MXFP4, HiF8; W4A4 resp. W8A8, activations fake-quantized at run time with each token's own amax, or
``--act-scale static`` / ``tensor``: the calibrated input amax / the batch's; default
static_6, the paper's PTQ rule mse, and HiF8: the grid took 9 min 37 s on an idle 2-core CPU) is applied to every
attention and MLP projection of the model, from one calibration pass over the training parts of the three texts
(the Hessians, activation maxima and samples do not depend on the format). Each quantized model is scored on the
held-out texts of `train.text_eval` (word perplexity) and the multiple-choice task, both through lm-eval with the
library's backend (`jaxlowfp.harness`; the report names lm-eval's version and the tasks); the report
``<out>/report.md`` (default ``runs/ptq-<model>/``) has the table, ``perplexity.png`` (word perplexity by format,
one line per method) and, per method, whether Four Over Six beat static_6 and by how much of the gap to high
precision. ``--formats`` (``all`` for every format) and ``--methods`` choose the part of the grid. ``--export`` also
writes the GPTQ + nvfp4-mse model as a compressed-tensors NVFP4 checkpoint and checks that it reloads to bit-identical
logits.
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

from jaxlowfp import registry
from jaxlowfp._core.format import Format

__all__ = ["main", "parse_args"]

METHODS = ("rtn", "gptq", "smoothquant", "awq")
FORMATS = registry.PTQ_FORMATS  # nvfp4-<rule>, mxfp4, hif8, if4-<rule> (jaxlowfp.ptq.scheme's names)
FOUR_OVER_SIX = ("nvfp4-abs_max", "nvfp4-mae", "nvfp4-mse")
DEFAULT_FORMATS = ("nvfp4-static_6", "nvfp4-mse", "hif8")  # the paper's PTQ comparison, about 10 minutes
LAYERS = r".*(attn|mlp)/\w+_proj"
# default sizes: the default grid in 9 min 37 s on 2 idle CPU cores (2048 tokens per text: at 512 a text's word
# perplexity rests on a few hundred words); --full: the paper-like sizes
SMALL = {"calib_seqs": 8, "calib_len": 256, "max_tokens": 2048, "max_length": 512, "mc_items": 24}
FULL = {"calib_seqs": 128, "calib_len": 512, "max_tokens": 100_000, "max_length": 2048, "mc_items": 400}


def _canonical(name: str) -> str | None:
    """The registry name of a format name that parses ("nvfp4-static_6" -> "nvfp4"), else None."""
    try:
        return Format.parse(name).name
    except (TypeError, ValueError):
        return None


def _list(text: str, allowed: Sequence[str], what: str, p: argparse.ArgumentParser) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed and _canonical(t) not in allowed]
    if bad or not items:
        p.error(f"--{what}: unknown {bad or text!r}; allowed: {', '.join(allowed)}")
    return items


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train ptq", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m",
                   help="registry name, .gguf file or Hugging Face directory (default: %(default)s)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated, from: " + ", ".join(METHODS))
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                   help="comma-separated, from: " + ", ".join(FORMATS) + "; or all (default: %(default)s)")
    p.add_argument("--weights-only", action="store_true", help="W4A16 / W8A16: activations in high precision")
    p.add_argument("--act-scale", default="token", choices=("token", "static", "tensor"),
                   help="W4A4 activations' amax: each token's own (default), the calibrated input amax, or the whole "
                        "batch's (the Four Over Six paper's setting; scores then depend on the batch)")
    p.add_argument("--weight-block", default="1x16", choices=("1x16", "16x16"), help="NVFP4 weight blocks")
    p.add_argument("--layers", default=LAYERS, help="regex of the Linear paths to quantize (default: %(default)s)")
    p.add_argument("--full", action="store_true", help="full sizes: " + ", ".join(f"{k}={v}" for k, v in FULL.items()))
    for k, v in SMALL.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"(default {v}; --full: {FULL[k]})")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per forward pass (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength (default: %(default)s)")
    p.add_argument("--alpha-search", default=None,
                   help="SmoothQuant: comma-separated alphas, each fold takes the best (e.g. 0.3,0.4,0.5,0.6,0.7)")
    p.add_argument("--awq-grid", type=int, default=20, help="AWQ grid points, llm-compressor's n_grid (default: "
                   "%(default)s)")
    p.add_argument("--awq-duo", default="true", choices=("true", "false", "both"),
                   help="AWQ duo scaling, as llm-compressor's duo_scaling (default: %(default)s)")
    p.add_argument("--awq-clip", action="store_true", help="AWQ: llm-awq's weight clipping search")
    p.add_argument("--damp", type=float, default=1.0, help="GPTQ damping, %% of mean diag H = 100 x llm-compressor's "
                   "dampening_frac (default: %(default)s)")
    p.add_argument("--act-order", action="store_true", help="GPTQ act-order (llm-compressor's actorder='weight')")
    p.add_argument("--block-size", type=int, default=128, help="GPTQ lazy-update width (default: %(default)s)")
    p.add_argument("--gptq-scales", default="as-reached", choices=("as-reached", "original"),
                   help="GPTQ block scales fixed as reached, or from the original weights as llm-compressor "
                   "(default: %(default)s)")
    p.add_argument("--pipeline", default="sequential", choices=("sequential", "one-pass"),
                   help="calibration of GPTQ / SmoothQuant / AWQ: block by block through the quantized prefix, or "
                   "one pass over the unquantized model shared by every method and format (default: %(default)s)")
    p.add_argument("--export", action="store_true",
                   help="export the gptq / nvfp4-mse model (compressed-tensors NVFP4) to <out>/export and check reload")
    p.add_argument("--out", default=None, help="report directory (default: runs/ptq-<model>)")
    p.add_argument("--seed", type=int, default=0, help="seed of the multiple-choice task (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(list(argv))
    args.methods = _list(args.methods, METHODS, "methods", p)
    args.formats = list(FORMATS) if args.formats.strip() == "all" else _list(args.formats, FORMATS, "formats", p)
    for k in SMALL:
        v = getattr(args, k)
        if v is None:
            setattr(args, k, (FULL if args.full else SMALL)[k])
        elif v < (0 if k == "mc_items" else 1):
            p.error(f"--{k.replace('_', '-')} must be positive; got {v}")
    if args.batch_size < 1 or args.awq_grid < 1 or args.block_size < 1:
        p.error("--batch-size, --awq-grid and --block-size must be positive")
    args.awq_duo = {"true": True, "false": False}.get(args.awq_duo, args.awq_duo)
    if args.alpha_search is not None:
        try:
            args.alpha_search = tuple(float(a) for a in args.alpha_search.split(",") if a.strip())
        except ValueError:
            p.error(f"--alpha-search must be comma-separated numbers; got {args.alpha_search!r}")
        if not args.alpha_search or not all(0 <= a <= 1 for a in args.alpha_search):
            p.error(f"--alpha-search needs numbers in [0, 1]; got {args.alpha_search}")
    if not 0 <= args.alpha <= 1:
        p.error(f"--alpha must be in [0, 1]; got {args.alpha}")
    args.weight_block = (16, 16) if args.weight_block == "16x16" else (1, 16)
    if args.weight_block != (1, 16) and not any(f.startswith("nvfp4") for f in args.formats):
        p.error("--weight-block 16x16 applies to NVFP4 formats only")
    return args


# ---------------------------------------------------------------------------------------------------------------


def calibration_tokens(tok: Any, n_seqs: int, seq_len: int) -> Any:
    """int32 [n_seqs, seq_len]: consecutive chunks of the *training* parts of the three texts (Shakespeare, Python
    standard library, the first 90 % of Alice), an equal share from each, so nothing evaluated is calibrated on."""
    import numpy as np

    from .data import VAL_FRACTION, load_domain
    from .text_eval import prose_text

    prose = prose_text()
    sources = [bytes(load_domain("shakespeare").train[: 400_000]).decode("utf-8", "replace"),
               bytes(load_domain("python").train[: 400_000]).decode("utf-8", "replace"),
               prose[: len(prose) - max(1, int(len(prose) * VAL_FRACTION))]]
    rows = []
    for i, text in enumerate(sources):
        want = n_seqs // len(sources) + (1 if i < n_seqs % len(sources) else 0)
        ids = tok.encode(text[: 8 * seq_len * max(want, 1)])
        for j in range(want):
            chunk = ids[j * seq_len: (j + 1) * seq_len]
            if len(chunk) < seq_len:
                raise SystemExit(f"error: not enough calibration text for {n_seqs} x {seq_len} tokens")
            rows.append(chunk)
    return np.asarray(rows, np.int32)


def model_name(model: str) -> str:
    """A directory-safe name of a registry name or checkpoint path."""
    name = Path(model).stem if ("/" in model or model.endswith(".gguf")) else model
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


def _restore(graphdef: Any, state: Any) -> Any:
    from flax import nnx

    return nnx.merge(graphdef, state, copy=True)  # fresh Variables: quantize() must not touch the HP state


def _evaluate(model: Any, tok: Any, texts: dict, task: Any, args: argparse.Namespace) -> dict[str, Any]:
    from .text_eval import perplexity, score_choices_tokens

    t0 = time.perf_counter()
    kw = dict(max_tokens=args.max_tokens, max_length=args.max_length, stride=args.max_length,
              batch_size=1, progress=not args.no_progress)
    # each text as one document: every text is then one window of the same shape (one compilation per format)
    out = {name: perplexity(model, tok, ["\n\n".join(docs)], name=name, **kw).word_perplexity
           for name, docs in texts.items()}
    if task is not None:
        mc = score_choices_tokens(model, tok, task, max_length=args.max_length, batch_size=4 * args.batch_size,
                                  progress=not args.no_progress)
        out["acc"], out["acc_norm"] = mc["acc"], mc["acc_norm"]
    out["eval_s"] = time.perf_counter() - t0
    return out


def _geomean(vals: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if all(v > 0 and math.isfinite(v) for v in vals) \
        else math.inf


def _table(rows: list[dict], texts: Sequence[str], mc: bool) -> str:
    from .report import text_table

    head = ["method", "format"] + [f"{t} wppl" for t in texts] + ["mean wppl"]
    head += ["MC acc", "MC acc_norm"] if mc else []
    head += ["PTQ s", "eval s"]
    body = []
    for r in rows:
        cells = [r["method"], r["format"]] + [f"{r[t]:.2f}" for t in texts] + [f"{r['mean']:.2f}"]
        cells += [f"{r['acc']:.3f}", f"{r['acc_norm']:.3f}"] if mc else []
        body.append(cells + [f"{r['ptq_s']:.0f}", f"{r['eval_s']:.0f}"])
    return text_table(head, body, markdown=True, text_columns=2)


def verdicts(rows: list[dict], hp: float) -> list[str]:
    """Per method: did the 4/6 rules beat static_6 (mean word perplexity), and how much of the gap to high
    precision they closed: (ppl_static6 - ppl_rule) / (ppl_static6 - ppl_hp)."""
    out = []
    for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "none"):
        by = {r["format"]: r["mean"] for r in rows if r["method"] == method}
        s6 = by.get("nvfp4-static_6", by.get("nvfp4"))
        rules = [f for f in FOUR_OVER_SIX if f in by]
        if s6 is None or not rules:
            continue
        gap = s6 - hp
        parts = []
        for f in rules:
            closed = (s6 - by[f]) / gap if gap > 0 else float("nan")
            word = "beat" if by[f] < s6 else "did not beat"
            parts.append(f"{f.split('-')[1]} {by[f]:.2f} ({word} static_6 {s6:.2f}; {100 * closed:+.0f} % of the gap "
                         f"to high precision {hp:.2f})")
        wins = sum(by[f] < s6 for f in rules)
        out.append(f"- **{method}**: 4/6 beat static_6 with {wins} of {len(rules)} rules: " + "; ".join(parts) + ".")
    return out


def _plot(rows: list[dict], texts: Sequence[str], hp_row: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmts = list(dict.fromkeys(r["format"] for r in rows if r["method"] != "none"))
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "none"))
    cols = list(texts) + ["mean"]
    fig, axes = plt.subplots(1, len(cols), figsize=(4.2 * len(cols), 4), squeeze=False)
    for ax, t in zip(axes[0], cols):
        for m in methods:
            by = {r["format"]: r[t] for r in rows if r["method"] == m}
            ax.plot(range(len(fmts)), [by.get(f, math.nan) for f in fmts], marker="o", label=m)
        ax.axhline(hp_row[t], color="k", linestyle="--", linewidth=1, label="high precision")
        ax.set_xticks(range(len(fmts)))
        ax.set_xticklabels([f.replace("nvfp4-", "") for f in fmts], rotation=45, ha="right")
        ax.set_yscale("log")
        ax.set_title(f"{t} word perplexity" if t != "mean" else "geometric mean")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def export_and_check(model: Any, result: Any, graphdef: Any, hp_state: Any, calib: Any, out: Path) -> str:
    """Export the model (HF tensor names), reload it into a fresh copy and compare logits bit for bit."""
    import jax.numpy as jnp

    from jaxlowfp import ptq
    from jaxlowfp.models.common import tensor_specs

    names = {s.path: s.hf for s in tensor_specs(model.config)}
    ptq.export(model, result, out, tensor_names=names, dtype="float32")  # float32: the reload check is bitwise
    fresh = _restore(graphdef, hp_state)
    ptq.load(fresh, out)
    x = jnp.asarray(calib[:1, :64])
    same = bool(jnp.all(model(x) == fresh(x)))
    size = sum(f.stat().st_size for f in out.iterdir())
    return (f"exported {result.method} / nvfp4-mse to `{out}` ({size / 2**20:.0f} MiB, compressed-tensors "
            f"nvfp4-pack-quantized); reloaded logits {'bit-identical' if same else 'DIFFER'}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from flax import nnx

    from jaxlowfp import ptq
    from . import evaluate as ev
    from .data import DataError, load_domain
    from jaxlowfp.ptq.calibrate import linear_modules
    from jaxlowfp.models import CheckpointError, load
    from .text_eval import load_texts

    t_all = time.perf_counter()
    try:
        model, tok = load(args.model, dtype="float32")
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from e
    load_s = time.perf_counter() - t_all
    print(f"model {args.model}: {model.config.num_params() / 1e6:.1f} M parameters, loaded in {load_s:.0f} s",
          file=sys.stderr)
    try:
        texts = load_texts()
        calib = calibration_tokens(tok, args.calib_seqs, args.calib_len)
    except DataError as e:
        raise SystemExit(f"error: {e}") from e
    task = ev.build_choice_task(load_domain("shakespeare").val, n_items=args.mc_items, seed=args.seed) \
        if args.mc_items else None
    graphdef, hp_state = nnx.split(model)
    layers = [p for p in linear_modules(model)
              if ptq.Rule(path=args.layers, scheme=None).matches(p)]
    if not layers:
        raise SystemExit(f"error: --layers {args.layers!r} matches no Linear of the model")

    t0 = time.perf_counter()
    # one pass: every method's statistics (sequential: RTN's activation maxima only; the others calibrate themselves)
    need_h = "gptq" in args.methods and args.pipeline == "one-pass"
    samples = 512 if args.pipeline == "one-pass" and ("awq" in args.methods or (
        "smoothquant" in args.methods and args.alpha_search)) else 0
    batches = [calib[i:i + args.batch_size] for i in range(0, len(calib), args.batch_size)]
    stats = ptq.collect(model, layers, batches, hessian=need_h, samples_per_batch=-(-samples // len(batches)),
                        progress=not args.no_progress)
    calib_s = time.perf_counter() - t0
    print(f"calibration: {calib.shape[0]} x {calib.shape[1]} tokens, {len(layers)} layers, {calib_s:.0f} s",
          file=sys.stderr)

    names = list(texts)
    out = Path(args.out or f"runs/ptq-{model_name(args.model)}")
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    hp = _evaluate(model, tok, texts, task, args)
    hp_row = {"method": "none", "format": "high precision", **hp, "ptq_s": 0.0,
              "mean": _geomean([hp[t] for t in names])}
    rows.append(hp_row)
    print(_row_line(hp_row, names), file=sys.stderr)
    methods = {"rtn": ptq.RTN(),
               "gptq": ptq.GPTQ(damp_percent=args.damp, act_order=args.act_order, block_size=args.block_size,
                                scales=args.gptq_scales),
               "smoothquant": ptq.SmoothQuant(alpha=args.alpha, alphas=args.alpha_search),
               "awq": ptq.AWQ(grid=args.awq_grid, duo_scaling=args.awq_duo, clip=args.awq_clip)}
    export_line = None
    for fmt in args.formats:
        sch = ptq.scheme(fmt, weights_only=args.weights_only,
                         weight_block=args.weight_block if fmt.startswith("nvfp4") else (1, 16))
        for method in args.methods:
            m = _restore(graphdef, hp_state)
            own = args.pipeline == "sequential" and method != "rtn"  # calibrated block by block in this call
            res = ptq.quantize_model(m, [ptq.Rule(path=args.layers, scheme=sch)], method=methods[method],
                               stats=None if own else stats, calibration=calib if own else None,
                               batch_size=args.batch_size, progress=not args.no_progress,
                               activation_scale=args.act_scale)
            r = _evaluate(m, tok, texts, task, args)
            row = {"method": method, "format": fmt, **r, "ptq_s": res.seconds, "mean": _geomean([r[t] for t in names])}
            rows.append(row)
            print(_row_line(row, names), file=sys.stderr)
            _save(out, rows, calib_s, args, done=False)  # a stopped run keeps what it measured
            if args.export and method == "gptq" and fmt == "nvfp4-mse":
                out_dir = Path(args.out or f"runs/ptq-{model_name(args.model)}") / "export"
                export_line = export_and_check(m, res, graphdef, hp_state, calib, out_dir)
                print(export_line, file=sys.stderr)
            del m, res
    if args.export and export_line is None:
        export_line = "export skipped: --export needs gptq in --methods and nvfp4-mse in --formats"
    total = time.perf_counter() - t_all
    _plot(rows, names, hp_row, out / "perplexity.png")
    table = _table(rows, names, task is not None)
    verdict = verdicts(rows, hp_row["mean"])
    sizes = (f"calibration {args.calib_seqs} x {args.calib_len} tokens (training parts of the three texts, one pass "
             f"shared by every method and format, {calib_s:.0f} s); evaluation: word perplexity on at most "
             f"{args.max_tokens} tokens of each held-out text in windows of {args.max_length}, "
             f"{args.mc_items} multiple-choice items (chance 0.25)")
    from .text_eval import CHOICE_TASK, lm_eval_note, text_task

    sizes += ("; " + lm_eval_note([text_task(n) for n in names] + ([CHOICE_TASK] if task is not None else [])))
    act_txt = {"token": "each token's own amax (per-token, dynamic)",
               "static": "the calibrated input amax of each layer (static)",
               "tensor": "the batch's per-tensor amax (the Four Over Six paper's setting)"}[args.act_scale]
    scheme_txt = ("weights only (W4A16 / W8A16)" if args.weights_only else
                  f"W4A4 (HiF8: W8A8), activations fake-quantized with {act_txt}")
    calib_txt = ("block by block through the quantized prefix, per quantize call" if args.pipeline == "sequential"
                 else "one pass over the unquantized model")
    gptq_scales_txt = "when a block is reached" if args.gptq_scales == "as-reached" else "from the original weights"
    report = "\n\n".join([
        f"# Post-training quantization of {args.model}",
        f"Layers: every Linear matching `{args.layers}` ({len(layers)} of "
        f"{len(linear_modules(model))}); {scheme_txt}; NVFP4 weight blocks "
        f"{'x'.join(map(str, args.weight_block))}. Calibration: {args.pipeline} ("
        f"{calib_txt}). "
        f"Methods: RTN; GPTQ (damp {args.damp} %, act-order {args.act_order}, block size {args.block_size}, "
        f"NVFP4-aware: scale and 4/6 choice fixed {gptq_scales_txt}); "
        f"SmoothQuant (alpha {args.alpha_search or args.alpha}) and AWQ (grid {args.awq_grid}, duo scaling "
        f"{args.awq_duo}, clipping {args.awq_clip}), both folded into the preceding RMSNorm / up_proj, then RTN. "
        f"{sizes}.",
        table,
        "Four Over Six against static_6 (geometric mean of the word perplexities; the paper reports 4/6 lowering "
        "perplexity relative to standard NVFP4 under every PTQ method it tests):",
        "\n".join(verdict) if verdict else "(no static_6 / 4/6 pair in this run)",
        "![perplexity](perplexity.png)",
        *([export_line + "."] if export_line else []),
        f"Command: `python -m train ptq {' '.join(sys.argv[1:] if argv is None else argv)}`; total wall time "
        f"{total:.0f} s (model loading {load_s:.0f} s).",
    ]) + "\n"
    (out / "report.md").write_text(report)
    _save(out, rows, calib_s, args, done=True, total_s=total)
    print(table)
    print("\n".join(verdict))
    if export_line:
        print(export_line)
    print(f"total wall time {total:.0f} s; report: {out / 'report.md'}")
    return 0


def _save(out: Path, rows: list[dict], calib_s: float, args: argparse.Namespace, *, done: bool,
          total_s: float | None = None) -> None:
    (out / "results.json").write_text(json.dumps({"complete": done, "rows": rows, "total_s": total_s,
                                                  "calib_s": calib_s, "settings": vars(args)}, indent=1, default=str))


def _row_line(r: dict, names: Sequence[str]) -> str:
    ppl = ", ".join(f"{t} {r[t]:.2f}" for t in names)
    mc = f", MC acc {r['acc']:.3f} / norm {r['acc_norm']:.3f}" if "acc" in r else ""
    return f"{r['method']:>11} {r['format']:<15} word ppl {ppl}{mc} (PTQ {r['ptq_s']:.0f} s, eval {r['eval_s']:.0f} s)"


if __name__ == "__main__":
    sys.exit(main())
