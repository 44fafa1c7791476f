"""Paired comparison of two evaluation arms, item by item, from lm-eval's per-sample logs: ``python -m train tasks
compare``.

Two arms (say float32 ``A`` and a quantized model ``B``) answer the same items. For item ``i`` of a task and a
per-item score ``x`` (``acc``, ``acc_norm`` where the task has it: 0 or 1; ``gold_ll``: the log-likelihood of the
gold answer, lm-eval's ``filtered_resps[target][0]``, in nats), the paired difference is ``d_i = x_B,i - x_A,i`` and

    mean  d = (1/n) sum_i d_i
    s.e.  = sqrt( sum_i (d_i - mean d)^2 / (n - 1) ) / sqrt(n)          (the s.e. of the mean of the differences)

Pairing removes the item-difficulty variance both arms share: two arms at 60 % on the same 500 items have an unpaired
s.e. of the difference of ~3.1 points, the paired s.e. is ``sqrt(discordant fraction / n)``-sized, often a third of
that. Pooled over tasks, the item-weighted mean ``sum_t n_t mean_t / N`` has ``s.e. = sqrt(sum_t n_t^2 se_t^2) / N``
(tasks independent; a stratified estimate, so that tasks with different mean differences do not inflate it).

Items are matched by ``(task, doc_id)`` and must be the same documents (lm-eval's ``doc_hash``, else the ``doc``
itself); an item missing from one arm, or a different document under the same id, is an error. Any other per-item
metric lm-eval logs as a number (``exact_match`` of a generation task, ...) is compared the same way, after the
three above; metrics logged as ``[prediction, gold]`` pairs (``f1``, ``mcc``: corpus-level aggregates) are not
per-item scores and are left out. Where the choices share one continuation and differ in their contexts
(WinoGrande's partial scoring), lm-eval logs no gold index; with two choices ``acc`` gives it (the argmax if right,
the other choice if wrong), with more the item has no ``gold_ll``.

Samples come from lm-eval's ``--output_path ... --log_samples`` (files ``samples_<task>_<date>.jsonl``, found under a
directory, the newest per task), or a results dict with ``"samples"`` (``lm_eval.simple_evaluate(log_samples=True)``,
`jaxlowfp.harness.evaluate`).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["PairedRow", "item_scores", "load_samples", "markdown", "overall", "paired", "paired_se"]

SCORES = ("acc", "acc_norm", "gold_ll")
_SAMPLES = re.compile(r"samples_(?P<task>.+)_(?P<date>\d{4}-\d{2}-\d{2}T[\d\-.]+)\.jsonl$")


def paired_se(d: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """Mean and standard error of the mean of paired differences ``d`` (sample s.d. with ``n - 1``, over
    ``sqrt(n)``); the s.e. of one item is nan."""
    x = np.asarray(d, np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"paired differences must be a non-empty 1-D sequence; got shape {x.shape}")
    if x.size == 1:
        return float(x[0]), math.nan
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))


def load_samples(source: str | Path | Mapping[str, Any]) -> dict[str, list[dict]]:
    """Per task, lm-eval's logged samples: from a results dict with ``"samples"``, a ``samples_*.jsonl`` file, a
    results JSON holding ``"samples"``, or a directory (searched recursively; the newest file per task)."""
    if isinstance(source, Mapping):
        if "samples" not in source:
            raise ValueError("the results dict has no 'samples': evaluate with log_samples=True")
        return {t: list(v) for t, v in source["samples"].items()}
    path = Path(source)
    if path.is_file():
        m = _SAMPLES.search(path.name)
        if m:
            return {m["task"]: _read_jsonl(path)}
        data = json.loads(path.read_text(encoding="utf-8"))
        return load_samples(data)
    if not path.is_dir():
        raise ValueError(f"{source}: not a samples file, results JSON or directory")
    newest: dict[str, tuple[str, Path]] = {}
    for f in path.rglob("samples_*.jsonl"):
        m = _SAMPLES.search(f.name)
        if m and (m["task"] not in newest or m["date"] > newest[m["task"]][0]):
            newest[m["task"]] = (m["date"], f)
    if not newest:
        raise ValueError(f"{source} holds no lm-eval samples_<task>_<date>.jsonl file (run with --log_samples)")
    return {t: _read_jsonl(f) for t, (_, f) in sorted(newest.items())}


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _doc_key(s: Mapping[str, Any]) -> str:
    if s.get("doc_hash"):
        return str(s["doc_hash"])
    return hashlib.sha256(json.dumps(s.get("doc"), sort_keys=True, default=str).encode()).hexdigest()


def _arguments(s: Mapping[str, Any]) -> list:
    """A sample's request arguments as a list of argument lists: ``simple_evaluate`` logs ``[[context,
    continuation], ...]``, lm-eval's command line (``--output_path``) ``{"gen_args_0": {"arg_0": context, "arg_1":
    continuation}, ...}``."""
    args = s.get("arguments") or []
    if isinstance(args, Mapping):
        def index(key: str) -> int:
            tail = key.rsplit("_", 1)[-1]
            return int(tail) if tail.isdigit() else -1

        return [[v[k] for k in sorted(v, key=index)] if isinstance(v, Mapping) else v
                for _, v in sorted(args.items(), key=lambda kv: index(kv[0]))]
    return list(args)


def _gold_ll(s: Mapping[str, Any]) -> float | None:
    """Log-likelihood of the gold answer of a multiple-choice sample (None where there is none to read)."""
    resps, target = s.get("filtered_resps"), s.get("target")
    if not isinstance(resps, list) or not resps:
        return None
    if isinstance(target, str) and target.strip().lstrip("-").isdigit():
        target = int(target)
    elif isinstance(target, str):  # a target given as the gold choice's text (COPA): its index among the choices
        conts = [a[1].strip() if isinstance(a, (list, tuple)) and len(a) > 1 and isinstance(a[1], str) else None
                 for a in _arguments(s)]
        if conts.count(target.strip()) == 1:
            target = conts.index(target.strip())
        elif len(conts) == len(resps) == 2 and conts.count(target.strip()) == 2 and s.get("acc") in (0, 1):
            # one continuation after two contexts (WinoGrande): acc says whether the argmax was the gold
            lls = [r[0] if isinstance(r, (list, tuple)) else r for r in resps]
            best = int(np.argmax(np.asarray(lls, np.float64)))
            target = best if s["acc"] == 1 else 1 - best
        else:
            target = None
    if isinstance(target, list):
        if len(target) != 1:
            return None
        target = target[0]
    if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < len(resps):
        return None
    r = resps[target]
    r = r[0] if isinstance(r, (list, tuple)) else r
    try:
        return float(r)
    except (TypeError, ValueError):
        return None


def _number(v: Any) -> float | None:
    if isinstance(v, (bool, int, float, np.integer, np.floating)) and math.isfinite(float(v)):
        return float(v)
    return None


def item_scores(samples: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per ``doc_id``: ``{"doc": key, <score>: value}`` for the scores of `SCORES` the sample has and its other
    per-item metrics logged as numbers (lm-eval's ``metrics`` list)."""
    out: dict[int, dict[str, Any]] = {}
    for s in samples:
        i = int(s["doc_id"])
        if i in out:
            raise ValueError(f"doc_id {i} appears twice in one arm's samples")
        row: dict[str, Any] = {"doc": _doc_key(s)}
        names = ["acc", "acc_norm"] + [m for m in s.get("metrics") or [] if isinstance(m, str) and m not in SCORES]
        for k in names:
            v = _number(s.get(k))
            if v is not None:
                row[k] = v
        ll = _gold_ll(s)
        if ll is not None:
            row["gold_ll"] = ll
        out[i] = row
    return out


@dataclass(frozen=True)
class PairedRow:
    """One task's (or the pool's) paired comparison of one score: means of both arms, the mean difference ``B - A``
    and its paired s.e.; for 0/1 scores also the discordant items (``b_only``: right in B only)."""

    task: str
    score: str
    n: int
    mean_a: float
    mean_b: float
    diff: float
    se: float
    b_only: int | None = None
    a_only: int | None = None

    @property
    def z(self) -> float:
        return self.diff / self.se if self.se and math.isfinite(self.se) and self.se > 0 else math.nan


def paired(a: Any, b: Any, *, scores: Sequence[str] | None = None) -> list[PairedRow]:
    """Rows per task and score, then ``pooled`` per score over the tasks (module docstring). ``a`` and ``b``: what
    `load_samples` reads. The tasks of ``a`` and ``b`` must be the same, with the same items. ``scores``: which
    (default: `SCORES`, then every other per-item metric both arms logged as a number, by name)."""
    sa, sb = load_samples(a), load_samples(b)
    if set(sa) != set(sb):
        raise ValueError(f"the arms evaluated different tasks: {sorted(sa)} vs {sorted(sb)}")
    items = {t: (item_scores(sa[t]), item_scores(sb[t])) for t in sorted(sa)}
    found = {k for ia, ib in items.values() for arm in (ia, ib) for row in arm.values() for k in row} - {"doc"}
    if scores is None:
        scores = [*SCORES, *sorted(found - set(SCORES))]
    elif isinstance(scores, str) or not scores:
        raise ValueError(f"scores must be a non-empty sequence of names; got {scores!r}")
    bad = [s for s in scores if s not in SCORES and s not in found]
    if bad:
        raise ValueError(f"scores {bad}: neither of {', '.join(SCORES)} nor a per-item metric of these samples "
                         f"({', '.join(sorted(found - set(SCORES))) or 'none'})")
    rows: list[PairedRow] = []
    for task, (ia, ib) in items.items():
        if set(ia) != set(ib):
            only = sorted(set(ia) ^ set(ib))
            raise ValueError(f"task {task}: the arms scored different items (doc_id only in one: {only[:8]}"
                             f"{' ...' if len(only) > 8 else ''}); prepare the tasks once and give both the same "
                             "directory and limit")
        ids = sorted(ia)
        diff_docs = [i for i in ids if ia[i]["doc"] != ib[i]["doc"]]
        if diff_docs:
            raise ValueError(f"task {task}: doc_id {diff_docs[:5]} hold different documents in the two arms")
        for score in scores:
            have = [i for i in ids if score in ia[i] and score in ib[i]]
            if not have:
                continue
            xa = np.asarray([ia[i][score] for i in have])
            xb = np.asarray([ib[i][score] for i in have])
            mean, se = paired_se(xb - xa)
            binary = score != "gold_ll" and bool(np.isin(np.concatenate([xa, xb]), (0.0, 1.0)).all())
            rows.append(PairedRow(task, score, len(have), float(xa.mean()), float(xb.mean()), mean, se,
                                  int(np.sum((xb > xa))) if binary else None,
                                  int(np.sum((xa > xb))) if binary else None))
    for score in scores:
        per = [r for r in rows if r.score == score]
        if len(per) < 2:
            continue
        n = sum(r.n for r in per)
        se = math.sqrt(sum(r.n ** 2 * r.se ** 2 for r in per)) / n
        binary = all(r.b_only is not None for r in per)
        rows.append(PairedRow("pooled", score, n, sum(r.n * r.mean_a for r in per) / n,
                              sum(r.n * r.mean_b for r in per) / n, sum(r.n * r.diff for r in per) / n, se,
                              sum(r.b_only for r in per) if binary else None,
                              sum(r.a_only for r in per) if binary else None))
    return rows


def overall(rows: Sequence[PairedRow]) -> dict[str, PairedRow]:
    """Per score, the row over every item: ``pooled`` where `paired` pooled several tasks, else the one task's."""
    out: dict[str, PairedRow] = {}
    for r in rows:
        if r.task == "pooled" or r.score not in out:
            out[r.score] = r
    return out


def markdown(rows: Sequence[PairedRow], *, name_a: str = "A", name_b: str = "B") -> str:
    """The rows as a markdown table: 0/1 scores (accuracies) in percent and their differences in percentage points
    (pp), the gold log-likelihood in nats, other scores as they are; ``B - A`` with its paired s.e. and their
    ratio."""
    head = ["task", "score", "n", name_a, name_b, f"{name_b} - {name_a}", "paired s.e.", "z",
            f"right only in {name_b} / {name_a}"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if r.b_only is None:
            unit = " nats" if r.score == "gold_ll" else ""
            cells = [f"{r.mean_a:.3f}", f"{r.mean_b:.3f}", f"{r.diff:+.3f}{unit}", f"{r.se:.3f}"]
        else:
            cells = [f"{100 * r.mean_a:.1f} %", f"{100 * r.mean_b:.1f} %", f"{100 * r.diff:+.1f} pp",
                     f"{100 * r.se:.1f} pp"]
        disc = "" if r.b_only is None else f"{r.b_only} / {r.a_only}"
        z = "" if math.isnan(r.z) else f"{r.z:+.2f}"
        task = f"**{r.task}**" if r.task == "pooled" else r.task
        out.append("| " + " | ".join([task, r.score, str(r.n), *cells, z, disc]) + " |")
    return "\n".join(out)
