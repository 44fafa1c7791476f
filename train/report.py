"""Results table and report: ``report.md`` with plots of the arms' loss, saturation and amax telemetry.

Inputs are plain dicts. An *arm* is ``{"name", "label"?, "metrics" | "dir", <summary keys>?}``: its metric rows
come from ``metrics`` or from ``<dir>/metrics.jsonl`` (one JSON object a step: ``step``, ``loss``, ``finite``,
``observe_only``, ``max_saturated_fraction``, ``mean_saturated_fraction`` and, for the one layer the loop
watches, ``amax`` and ``amax_estimate``). A *table row* has the keys of `COLUMNS`; missing values print as "-".
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .evaluate import loss_ape

__all__ = [
    "COLUMNS",
    "GRID_COLUMNS",
    "PRETRAIN_COLUMNS",
    "REAL_COLUMNS",
    "add_final_gaps",
    "fouroversix_notes",
    "format_table",
    "grid_notes",
    "markdown_table",
    "nonfinite_note",
    "read_metrics",
    "saturation_summary",
    "summary_rows",
    "text_table",
    "write_report",
]

# (key, header, format, meaning)
COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    ("arm", "arm", "s", "training arm"),
    ("val_loss_b", "B val loss", ".4f", "domain-B (Python) validation loss, nats/byte: what the arm learns"),
    ("val_loss_a", "A val loss", ".4f", "domain-A (Shakespeare) validation loss: higher = more forgetting"),
    ("acc", "MC acc", ".3f", "multiple-choice accuracy on held-out Shakespeare (4 choices, chance 0.25)"),
    ("acc_norm", "MC acc_norm", ".3f", "the same, log-likelihood per byte (length-normalised, as lm-eval)"),
    ("loss_ape", "loss APE %", ".3f", "mean |L_qat - L_hp| / L_hp over steps, percent, vs the high-precision arm"),
    ("max_saturated_fraction", "max sat", ".2e", "largest fraction of clipped activations, any layer, any step"),
    ("mean_saturated_fraction", "mean sat", ".2e", "mean over quantized steps of the mean over layers"),
    ("wall_s", "wall s", ".0f", "wall-clock seconds of the arm"),
)

# the paper's grid: the arm's learning rate, and the APE against the high-precision arm at that learning rate
GRID_COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    COLUMNS[0],
    ("lr", "LR", ".0e", "the arm's constant learning rate"),
    *COLUMNS[1:5],
    ("loss_ape", "loss APE %", ".3f", "mean |L_qat - L_hp| / L_hp over steps, percent, vs the high-precision arm at "
     "the same learning rate (the matched-LR baseline)"),
    *COLUMNS[6:],
)

# pretraining from scratch (--grid fouroversix)
PRETRAIN_COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    COLUMNS[0],
    ("final_loss", "final train loss", ".4f", "mean training loss over the last 10 % of steps (nats/byte)"),
    ("final_gap", "gap to HP", "+.4f", "final train loss minus the high-precision arm's"),
    ("val_loss_a", "A val loss", ".4f", "domain-A (Shakespeare, the pretraining domain) validation loss"),
    ("val_gap", "A val gap", "+.4f", "A val loss minus the high-precision arm's"),
    ("gap_closed", "gap closed %", ".0f", "share of static_6's final train-loss gap to high precision this rule "
     "removes: 100 (1 - gap / gap_static_6)"),
    ("acc", "MC acc", ".3f", "multiple-choice accuracy on held-out Shakespeare (4 choices, chance 0.25)"),
    ("loss_ape", "loss APE %", ".3f", "mean |L - L_hp| / L_hp over steps, percent, vs the high-precision arm"),
    ("skipped", "skipped", "d", "steps skipped for a non-finite loss, gradient or quantized value"),
    ("wall_s", "wall s", ".0f", "wall-clock seconds of the arm"),
)

# a real checkpoint: word perplexities (train.text_eval) instead of byte losses
REAL_COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    COLUMNS[0],
    ("lr", "LR", ".0e", "the arm's constant learning rate"),
    ("ppl_python", "Python ppl", ".1f", "adaptation: word perplexity of held-out Python standard library"),
    ("ppl_shakespeare", "Shakespeare ppl", ".1f", "retention: word perplexity of held-out Shakespeare"),
    ("ppl_prose", "prose ppl", ".1f", "retention: word perplexity of held-out English prose (Alice in Wonderland)"),
    ("acc", "MC acc", ".3f", "retention: multiple-choice accuracy on held-out Shakespeare (4 choices, chance 0.25)"),
    ("acc_norm", "MC acc_norm", ".3f", "the same, log-likelihood per byte of the choice"),
    ("loss_ape", "loss APE %", ".3f", "mean |L_qat - L_hp| / L_hp over steps, percent, vs the high-precision arm at "
     "the same learning rate"),
    *COLUMNS[6:],
)

Columns = Sequence[tuple[str, str, str, str]]


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if fmt == "s":
        return str(value)
    if fmt == "d":
        return str(int(value))
    return format(float(value), fmt)


def _cells(rows: Sequence[Mapping[str, Any]], columns: Columns) -> tuple[list[str], list[list[str]]]:
    headers = [h for _, h, _, _ in columns]
    return headers, [[_cell(r.get(k), f) for k, _, f, _ in columns] for r in rows]


def text_table(header: Sequence[str], body: Sequence[Sequence[str]], *, markdown: bool = False,
               text_columns: int = 1) -> str:
    """Cells as a table: the first `text_columns` columns left-aligned, the others (numbers) right-aligned; a
    markdown table, or fixed width for the terminal."""
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + ":---|" * text_columns + "---:|" * (len(header) - text_columns)]
        return "\n".join(out + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(x) for x in col) for col in zip(header, *body)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < text_columns else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in body])


def format_table(rows: Sequence[Mapping[str, Any]], columns: Columns = COLUMNS) -> str:
    """A fixed-width table for the terminal: text left-aligned, numbers right-aligned."""
    return text_table(*_cells(rows, columns))


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Columns = COLUMNS) -> str:
    return text_table(*_cells(rows, columns), markdown=True)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` file (or of ``<path>/metrics.jsonl`` for a run directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        raise FileNotFoundError(f"no metrics file at {str(p)!r}")
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _finite_loss(row: Mapping[str, Any]) -> float:
    v = row.get("loss")
    ok = row.get("finite", True) and v is not None and math.isfinite(float(v))
    return float(v) if ok else math.nan


def saturation_summary(metrics: Iterable[Mapping[str, Any]]) -> tuple[float | None, float | None]:
    """(max, mean) saturated fraction over the quantized steps (``observe_only`` warmup steps left out);
    ``(None, None)`` when no quantized step logged saturation (a high-precision arm)."""
    rows = [r for r in metrics if not r.get("observe_only", False) and r.get("max_saturated_fraction") is not None]
    if not rows:
        return None, None
    return (
        float(max(r["max_saturated_fraction"] for r in rows)),
        float(np.mean([r["mean_saturated_fraction"] for r in rows])),
    )


def _normalise_arms(arms: Mapping[str, Mapping[str, Any]] | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    items = [{"name": k, **v} for k, v in arms.items()] if isinstance(arms, Mapping) else [dict(a) for a in arms]
    out = []
    for a in items:
        if "name" not in a:
            raise ValueError(f"an arm needs a 'name'; got keys {sorted(a)}")
        if "metrics" not in a:
            if "dir" not in a:
                raise ValueError(f"arm {a['name']!r} needs 'metrics' (rows) or 'dir' (with metrics.jsonl)")
            a["metrics"] = read_metrics(a["dir"])
        a.setdefault("label", a["name"])
        out.append(a)
    return out


def _aligned_losses(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    la = {int(r["step"]): _finite_loss(r) for r in a}
    lb = {int(r["step"]): _finite_loss(r) for r in b}
    steps = sorted(set(la) & set(lb))
    return np.array([la[s] for s in steps]), np.array([lb[s] for s in steps])


def summary_rows(
    arms: Mapping[str, Mapping[str, Any]] | Sequence[Mapping[str, Any]], *, baseline: str | None = "hp"
) -> list[dict[str, Any]]:
    """Table rows from arms: summary keys as given; saturation from the metric rows; loss APE against the
    ``baseline`` arm on the steps both logged (non-finite steps left out, their count in ``ape_skipped``). An arm
    with a ``"baseline"`` key is compared with that arm instead (None: no APE), e.g. its matched-LR baseline."""
    arms = _normalise_arms(arms)
    by_name = {a["name"]: a for a in arms}
    rows = []
    for a in arms:
        base = by_name.get(a["baseline"] if "baseline" in a else baseline)
        row = {k: a.get(k) for k, *_ in COLUMNS}
        row |= {k: a[k] for cols in (GRID_COLUMNS, PRETRAIN_COLUMNS, REAL_COLUMNS) for k, *_ in cols if k in a}
        row["arm"] = a["label"]
        if row["max_saturated_fraction"] is None:
            row["max_saturated_fraction"], row["mean_saturated_fraction"] = saturation_summary(a["metrics"])
        if row.get("skipped") is None:
            row["skipped"] = sum(1 for r in a["metrics"] if r.get("finite") is False)
        row["nonfinite_quantized"] = sum(int(r.get("nonfinite_quantized", 0)) for r in a["metrics"])
        if row["loss_ape"] is None and base is not None and a is not base:
            q, b = _aligned_losses(a["metrics"], base["metrics"])
            ok = np.isfinite(q) & np.isfinite(b)
            if ok.any():
                row["loss_ape"] = loss_ape(q, b, nonfinite="skip")
                row["ape_skipped"] = int((~ok).sum())
        rows.append(row)
    return rows


def nonfinite_note(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line on the steps skipped for a non-finite loss, gradient or quantized value, and the non-finite values
    counted in quantized tensors (`jaxlowfp.training`: such a step leaves the whole state unchanged)."""
    hit = [r for r in rows if r.get("skipped") or r.get("nonfinite_quantized")]
    if not hit:
        return "Non-finite values: no step was skipped and no quantized tensor held a NaN or Inf in any arm."
    parts = [f"{r['arm']}: {int(r.get('skipped') or 0)} steps, {int(r.get('nonfinite_quantized') or 0)} values"
             for r in hit]
    return ("Steps skipped for a non-finite loss, gradient or quantized value (state left unchanged), and the "
            f"non-finite values counted in quantized tensors: {'; '.join(parts)}.")


def _series(metrics: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    if key == "loss":  # skipped (non-finite) steps are left out of the curve
        pts = [(r["step"], _finite_loss(r)) for r in metrics if math.isfinite(_finite_loss(r))]
    else:
        pts = [(r["step"], r[key]) for r in metrics if r.get(key) is not None]
    if not pts:
        return np.zeros(0), np.zeros(0)
    s, v = zip(*pts)
    return np.asarray(s, np.float64), np.asarray(v, np.float64)


def _warmup_end(metrics: Sequence[Mapping[str, Any]]) -> int | None:
    steps = [r["step"] for r in metrics if r.get("observe_only")]
    return int(max(steps)) if steps else None


def _plot_losses(arms: list[dict[str, Any]], path: Path, title: str = "continued pretraining on domain B",
                 ylabel: str = "training loss (nats/byte)") -> None:
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    for a in arms:
        s, v = _series(a["metrics"], "loss")
        ax.plot(s, v, lw=1, label=a["label"])
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=110)


def _plot_saturation(arms: list[dict[str, Any]], path: Path) -> bool:
    from matplotlib.figure import Figure

    shown = [a for a in arms if saturation_summary(a["metrics"])[0] is not None]
    if not shown:
        return False
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    for i, a in enumerate(shown):
        color = f"C{i}"
        s, v = _series(a["metrics"], "max_saturated_fraction")
        ax.plot(s, v, lw=1, color=color, label=f"{a['label']}: max over layers")
        s, v = _series(a["metrics"], "mean_saturated_fraction")
        ax.plot(s, v, lw=1, ls=":", color=color, label=f"{a['label']}: mean")
        end = _warmup_end(a["metrics"])
        if end is not None:
            ax.axvline(end, color=color, ls="--", lw=0.8)
    ax.set_yscale("symlog", linthresh=1e-5)  # zeros (warmup, no clipping) stay visible next to 1e-4
    ax.set_ylim(bottom=0)
    ax.set(xlabel="step (dashed: end of warmup)", ylabel="saturated (clipped) fraction",
           title="activation saturation per step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return True


def _plot_amax(arms: list[dict[str, Any]], path: Path, layer: str | None) -> bool:
    from matplotlib.figure import Figure

    shown = [a for a in arms if all(len(_series(a["metrics"], k)[0]) for k in ("amax", "amax_estimate"))]
    if not shown:
        return False
    fig = Figure(figsize=(7, 2.6 * len(shown)), layout="constrained")
    axes = np.atleast_1d(fig.subplots(len(shown), 1, sharex=True))
    for ax, a in zip(axes, shown):
        s, v = _series(a["metrics"], "amax")
        ax.plot(s, v, lw=1, color="C0", label="observed amax")
        s, v = _series(a["metrics"], "amax_estimate")
        ax.plot(s, v, lw=1, color="C3", label="amax estimate (scale source)")
        end = _warmup_end(a["metrics"])
        if end is not None:
            ax.axvline(end, color="gray", ls="--", lw=0.8)
        ax.set(ylabel="amax", title=a["label"])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1].set_xlabel("step")
    fig.suptitle(f"activation amax of {layer}" if layer else "activation amax of the watched layer")
    fig.savefig(path, dpi=110)
    return True


def write_report(
    out_dir: str | os.PathLike,
    arms: Mapping[str, Mapping[str, Any]] | Sequence[Mapping[str, Any]],
    *,
    rows: Sequence[Mapping[str, Any]] | None = None,
    baseline: str | None = "hp",
    config: Mapping[str, Any] | None = None,
    total_wall_s: float | None = None,
    amax_layer: str | None = None,
    title: str = "HiF8 W8A8 QAT: continued pretraining report",
    columns: Columns = COLUMNS,
    notes: Sequence[str] = (),
    loss_title: str = "continued pretraining on domain B",
    loss_ylabel: str = "training loss (nats/byte)",
) -> Path:
    """Write ``<out_dir>/report.md`` with the table and the plots ``loss_curves.png``, ``saturation.png`` and
    ``amax.png`` (the last two only when some arm logged them). Returns the path of ``report.md``.

    ``arms``: a dict ``name -> arm`` or a list of arms (see the module docstring). ``rows``: the table rows;
    default `summary_rows` (arms then carry the summary keys). ``columns``: the table's columns (`COLUMNS`,
    `GRID_COLUMNS`, ...); ``notes``: markdown sections placed after the table.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arm_list = _normalise_arms(arms)
    rows = summary_rows(arm_list, baseline=baseline) if rows is None else [dict(r) for r in rows]
    _plot_losses(arm_list, out / "loss_curves.png", loss_title, loss_ylabel)
    plots = ["loss_curves.png"]
    if _plot_saturation(arm_list, out / "saturation.png"):
        plots.append("saturation.png")
    if _plot_amax(arm_list, out / "amax.png", amax_layer):
        plots.append("amax.png")

    md = [f"# {title}", "", markdown_table(rows, columns), ""]
    md += [nonfinite_note(rows), ""]
    skipped = [f"{r['arm']}: {r['ape_skipped']}" for r in rows if r.get("ape_skipped")]
    if skipped:
        md += [f"Non-finite steps left out of loss APE: {', '.join(skipped)}.", ""]
    if total_wall_s is not None:
        md += [f"Total wall time: {total_wall_s:.0f} s.", ""]
    for note in notes:
        md += [note, ""]
    md += ["## Columns", ""] + [f"- **{h}**: {m}" for _, h, _, m in columns[1:]] + [""]
    captions = {
        "loss_curves.png": "Training loss of each arm (same data order and learning rate)." if columns is COLUMNS
        else "Training loss of each arm (same data order; learning rates as in the table).",
        "saturation.png": "Fraction of activations clipped at the scale's target max, per step "
        "(symlog axis). During the observe-only warmup nothing is clipped: the curve there shows what the delayed "
        "estimate would have clipped, which is how long a warmup needs to be.",
        "amax.png": "Observed activation amax of one quantized layer and the delayed estimate its scale used: "
        "where the observed amax exceeds the estimate, activations are clipped.",
    }
    md += ["## Plots", ""]
    for p in plots:
        md += [f"![{p}]({p})", "", captions[p], ""]
    if config is not None:
        md += ["## Configuration", "", "```json", json.dumps(config, indent=1, default=str), "```", ""]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path


# ---------------------------------------------------------------------------------------------------------------
# grids


def _final_losses(metrics: Sequence[Mapping[str, Any]], fraction: float) -> dict[int, float]:
    """{step: loss} of the last `fraction` of the logged steps (finite losses only)."""
    steps = sorted(int(r["step"]) for r in metrics)
    if not steps:
        return {}
    first = steps[-1] - max(1, math.ceil(fraction * len(steps))) + 1
    out = {int(r["step"]): _finite_loss(r) for r in metrics if int(r["step"]) >= first}
    return {k: v for k, v in out.items() if math.isfinite(v)}


def add_final_gaps(rows: Sequence[Mapping[str, Any]], arms: Sequence[Mapping[str, Any]], *, baseline: str = "hp",
                   reference: str = "static_6", fraction: float = 0.1) -> list[dict[str, Any]]:
    """Rows (aligned with `arms`) with the final training loss and the gaps to the `baseline` arm.

    ``final_loss``: mean training loss over the last `fraction` of the steps. ``final_gap``: the arm's final loss
    minus the baseline's, averaged over the same steps (same batches in both: the per-step difference cancels
    most batch noise), with ``final_gap_se``, the standard error of that mean. ``val_gap``: A val loss minus the
    baseline's. ``gap_closed``: ``100 (1 - final_gap / final_gap_reference)`` for arms other than the baseline
    and the `reference` arm (static_6), when the reference's gap is positive; ``vs_reference`` and its standard error
    ``vs_reference_se``: the arm's final loss minus the reference's, paired step by step.
    """
    arms = _normalise_arms(arms)
    if len(rows) != len(arms):
        raise ValueError(f"rows and arms must align; got {len(rows)} rows and {len(arms)} arms")
    finals = [_final_losses(a["metrics"], fraction) for a in arms]
    names = [a["name"] for a in arms]
    base = finals[names.index(baseline)] if baseline in names else None
    base_row = rows[names.index(baseline)] if baseline in names else None
    out = [dict(r) for r in rows]
    for row, fin in zip(out, finals):
        row["final_loss"] = float(np.mean(list(fin.values()))) if fin else None
        if base is None or fin is base:
            continue
        common = sorted(set(fin) & set(base))
        if common:
            d = np.array([fin[s] - base[s] for s in common])
            row["final_gap"] = float(d.mean())
            row["final_gap_se"] = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None
        if row.get("val_loss_a") is not None and base_row.get("val_loss_a") is not None:
            row["val_gap"] = float(row["val_loss_a"]) - float(base_row["val_loss_a"])
    if reference in names:
        ref = finals[names.index(reference)]
        ref_gap = out[names.index(reference)].get("final_gap")
        for name, row, fin in zip(names, out, finals):
            if name in (baseline, reference):
                continue
            if ref_gap and ref_gap > 0 and row.get("final_gap") is not None:
                row["gap_closed"] = 100.0 * (1.0 - row["final_gap"] / ref_gap)
            common = sorted(set(fin) & set(ref))
            if len(common) > 1:  # paired on the same batches: the batch noise both share cancels
                d = np.array([fin[s] - ref[s] for s in common])
                row["vs_reference"] = float(d.mean())
                row["vs_reference_se"] = float(d.std(ddof=1) / math.sqrt(len(d)))
    return out


def fouroversix_notes(rows: Sequence[Mapping[str, Any]], arms: Sequence[Mapping[str, Any]]) -> list[str]:
    """The report's reading of the NVFP4 pretraining grid: each rule's final gap to high precision with its standard
    error, and whether a Four Over Six rule's final training loss differs from static_6's by more than twice the
    standard error of their step-by-step difference."""
    arms = _normalise_arms(arms)
    lines = ["## Final loss gap to high precision", ""]
    for a, r in zip(arms, rows):
        gap = r.get("final_gap")
        if gap is None:
            continue
        text = f"- **{a['label']}**: {gap:+.4f} nats/byte (standard error {r.get('final_gap_se') or 0.0:.4f})"
        diff, se = r.get("vs_reference"), r.get("vs_reference_se")
        if diff is not None and se is not None:
            verdict = ("lower than static_6's" if diff < -2 * se else
                       "higher than static_6's" if diff > 2 * se else "not distinguishable from static_6's")
            text += f"; final loss {diff:+.4f} vs static_6 (standard error {se:.4f}: {verdict} at two standard errors)"
        lines.append(text)
    lines += ["", "Training losses are averaged over the last 10 % of the steps, on the same batches in every arm; "
              "the standard errors are over those steps only (one seed): they measure batch noise, not "
              "seed-to-seed variation. The A val gap column is the held-out check."]
    return ["\n".join(lines)]


BYTE_KEYS = (("val_loss_b", "B val loss"), ("val_loss_a", "A val loss"), ("acc", "MC acc"))


def grid_notes(rows: Sequence[Mapping[str, Any]], arms: Sequence[Mapping[str, Any]], specs: Sequence[Any], *,
               keys: Sequence[tuple[str, str]] = BYTE_KEYS) -> list[str]:
    """The report's reading of the paper's grid: which experiment each arm stands for, and, per quantized arm, its
    training-loss APE next to what the evaluation shows against the same matched-LR baseline and the saturation.

    `rows` starts with the starting model's row, then one per arm (aligned with `arms` and `specs`). `keys`:
    (row key, header) of the evaluation columns, adaptation first; the second is the forgetting measure (its rise
    from the starting model is shown too).
    """
    arms = _normalise_arms(arms)
    start, body = rows[0], list(rows[1:])
    by_name = {a["name"]: r for a, r in zip(arms, body)}
    roles = ["## The arms", "", "| arm | name | stands for | compared with |", "|:---|:---|:---|:---|"]
    for s, r in zip(specs, body):
        roles.append(f"| {r['arm']} | `{s.name}` | {s.role} | {'`' + s.baseline + '`' if s.baseline else '-'} |")
    roles += ["", "The paper's own table of its eight experiments was not available (only its abstract and the "
              "authors' README); these arms cover the factors the abstract names: see `train/grid.py`."]

    def delta(r: Mapping[str, Any], base: Mapping[str, Any] | None, key: str) -> str:
        if base is None or r.get(key) is None or base.get(key) is None:
            return "-"
        return f"{float(r[key]) - float(base[key]):+.4f}"

    forget, forget_name = keys[1]
    head = " | ".join(f"{h} Δ" for _, h in keys)
    table = ["## Loss vs evaluation", "",
             "Each quantized arm against the high-precision arm at its learning rate (Δ = arm minus that baseline); "
             f"forgetting is the rise of {forget_name} from the starting model's {float(start[forget]):.4f}:", "",
             f"| arm | loss APE % | {head} | {forget_name} rise | max sat | mean sat |",
             "|:---|" + "---:|" * (len(keys) + 4)]
    apes, rises = [], []
    for s, r in zip(specs, body):
        rise = float(r[forget]) - float(start[forget])
        if s.format == "none":
            table.append(f"| {r['arm']} | - | " + " | ".join("-" for _ in keys) + f" | {rise:+.4f} | - | - |")
            continue
        base = by_name.get(s.baseline) if s.baseline else None
        ape = r.get("loss_ape")
        if ape is not None:
            apes.append(float(ape))
            rises.append(rise)
        cells = " | ".join(delta(r, base, k) for k, _ in keys)
        table.append(f"| {r['arm']} | {_cell(ape, '.3f')} | {cells} | {rise:+.4f} | "
                     f"{_cell(r.get('max_saturated_fraction'), '.2e')} | "
                     f"{_cell(r.get('mean_saturated_fraction'), '.2e')} |")
    if len(apes) >= 2:
        table += ["", f"Across the quantized arms the training-loss APE spans {min(apes):.3f}-{max(apes):.3f} % "
                  f"while the {forget_name} rise (forgetting) spans {min(rises):+.4f} to {max(rises):+.4f}. The "
                  "APE compares an arm with the baseline at the same learning rate, which forgets about as much (the "
                  f"{forget_name} Δ column), so the loss curve cannot show forgetting; clipping shows only in the "
                  "saturation columns."]
    return ["\n".join(roles), "\n".join(table)]
