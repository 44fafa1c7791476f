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

from train.evaluate import loss_ape

__all__ = [
    "COLUMNS",
    "format_table",
    "markdown_table",
    "read_metrics",
    "saturation_summary",
    "summary_rows",
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


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if fmt == "s":
        return str(value)
    return format(float(value), fmt)


def _cells(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = [h for _, h, _, _ in COLUMNS]
    return headers, [[_cell(r.get(k), f) for k, _, f, _ in COLUMNS] for r in rows]


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A fixed-width table for the terminal: text left-aligned, numbers right-aligned."""
    headers, body = _cells(rows)
    widths = [max(len(x) for x in col) for col in zip(headers, *body)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule] + [line(r) for r in body])


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    headers, body = _cells(rows)
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join([":---"] + ["---:"] * (len(headers) - 1)) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in body])


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
    ``baseline`` arm on the steps both logged (non-finite steps left out, their count in ``ape_skipped``)."""
    arms = _normalise_arms(arms)
    base = next((a for a in arms if a["name"] == baseline), None)
    rows = []
    for a in arms:
        row = {k: a.get(k) for k, *_ in COLUMNS}
        row["arm"] = a["label"]
        if row["max_saturated_fraction"] is None:
            row["max_saturated_fraction"], row["mean_saturated_fraction"] = saturation_summary(a["metrics"])
        if row["loss_ape"] is None and base is not None and a is not base:
            q, b = _aligned_losses(a["metrics"], base["metrics"])
            ok = np.isfinite(q) & np.isfinite(b)
            if ok.any():
                row["loss_ape"] = loss_ape(q, b, nonfinite="skip")
                row["ape_skipped"] = int((~ok).sum())
        rows.append(row)
    return rows


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


def _plot_losses(arms: list[dict[str, Any]], path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    for a in arms:
        s, v = _series(a["metrics"], "loss")
        ax.plot(s, v, lw=1, label=a["label"])
    ax.set(xlabel="step", ylabel="training loss (nats/byte)", title="continued pretraining on domain B")
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
) -> Path:
    """Write ``<out_dir>/report.md`` with the table and the plots ``loss_curves.png``, ``saturation.png`` and
    ``amax.png`` (the last two only when some arm logged them). Returns the path of ``report.md``.

    ``arms``: a dict ``name -> arm`` or a list of arms (see the module docstring). ``rows``: the table rows;
    default `summary_rows` (arms then carry the summary keys).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arm_list = _normalise_arms(arms)
    rows = summary_rows(arm_list, baseline=baseline) if rows is None else [dict(r) for r in rows]
    _plot_losses(arm_list, out / "loss_curves.png")
    plots = ["loss_curves.png"]
    if _plot_saturation(arm_list, out / "saturation.png"):
        plots.append("saturation.png")
    if _plot_amax(arm_list, out / "amax.png", amax_layer):
        plots.append("amax.png")

    md = [f"# {title}", "", markdown_table(rows), ""]
    skipped = [f"{r['arm']}: {r['ape_skipped']}" for r in rows if r.get("ape_skipped")]
    if skipped:
        md += [f"Non-finite steps left out of loss APE: {', '.join(skipped)}.", ""]
    if total_wall_s is not None:
        md += [f"Total wall time: {total_wall_s:.0f} s.", ""]
    md += ["## Columns", ""] + [f"- **{h}**: {m}" for _, h, _, m in COLUMNS[1:]] + [""]
    captions = {
        "loss_curves.png": "Training loss of each arm (same data order and learning rate).",
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
