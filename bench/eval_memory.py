"""Peak memory of lm-eval evaluation on SmolLM2-135M: float32, HiF8 W8A8 and NVFP4 4/6 (MSE) W4A4 on every projection.

    .venv/bin/python bench/eval_memory.py [--configs none,hif8,nvfp4] [--limit-gb 8] [--no-write]

Each configuration is the README's command, ``python -m jaxlowfp.harness --model jaxlowfp --model_args
pretrained=smollm2-135m,quantize=<q>,layers=all --batch_size 8``, on the local tasks ``tests/lm_eval_tasks``
(multiple choice: 8 questions x 4 choices; rolling perplexity: 4 short documents; ``--gen`` adds the 6 greedy
completions), in a fresh interpreter. A watchdog polls the resident set (VmRSS of the process tree, every 0.2 s),
keeps the peak and kills the run above ``--limit-gb`` (the machine is shared), so a row says "killed at" rather than
taking the machine down. The float32 weights are 0.54 GB.

Why it grew (issue 32): the scoring forward pass was one XLA program for the whole model, and a fake-quantized
layer is thousands of HLO ops (an NVFP4 Four Over Six quantizer ~2,300: the 4/6 errors unrolled over the 16 block
columns for both candidates; two quantizers per layer). XLA's compilation memory grows with the program, and the
process keeps what the allocator got: with every one of SmolLM2's 210 projections quantized, compiling that program
for one padded shape took more than 7.5 GB (killed), before any request ran; each further padded shape compiled it
again. `jaxlowfp.evaluation.score_requests` now runs a model with ``ptq_blocks()`` block by block: one program per
distinct block structure, compiled once and shared by the identical blocks (log-likelihoods bitwise unchanged).

Writes the ``## Evaluation peak memory (SmolLM2-135M, lm-eval backend)`` section of bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "lm_eval_tasks"
LABELS = {"none": "float32", "hif8": "HiF8 W8A8", "nvfp4": "NVFP4 4/6 (MSE) W4A4"}


def _tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and its descendants (the lm-eval command line runs in one process)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(root)], capture_output=True, text=True).stdout
    total = 0
    for pid in [root, *(int(p) for p in out.split())]:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024
        except (OSError, StopIteration):
            pass
    return total


def run(quantize: str, tasks: list[str], limit: float) -> dict:
    """One evaluation under the watchdog: peak RSS (GiB), seconds, killed, and lm-eval's metrics."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "jaxlowfp.harness", "--model", "jaxlowfp", "--model_args",
               f"pretrained=smollm2-135m,quantize={quantize},layers=all", "--tasks", ",".join(tasks),
               "--batch_size", "8", "--output_path", out]
        env = dict(os.environ, PYTHONPATH=str(ROOT), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
        t0, peak, killed = time.perf_counter(), 0, False
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True)
        while p.poll() is None:
            peak = max(peak, _tree_rss(p.pid))
            if peak > limit * 2**30:
                os.killpg(p.pid, signal.SIGKILL)
                killed = True
                break
            time.sleep(0.2)
        err = p.communicate()[1].decode(errors="replace")
        seconds = time.perf_counter() - t0
        metrics = {}
        for f in Path(out).rglob("results_*.json"):
            for task, vals in json.loads(f.read_text())["results"].items():
                metrics.update({f"{task}/{k.split(',')[0]}": v for k, v in vals.items()
                                if isinstance(v, float) and "stderr" not in k})
        if p.returncode not in (0, None) and not killed:
            raise RuntimeError(f"quantize={quantize} failed:\n{err[-3000:]}")
    return {"quantize": quantize, "peak_gib": peak / 2**30, "seconds": seconds, "killed": killed, "metrics": metrics}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _results import machine, markdown_table, write_section

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="none,hif8,nvfp4")
    ap.add_argument("--limit-gb", type=float, default=8.0)
    ap.add_argument("--gen", action="store_true", help="add the generation task (greedy decoding)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    tasks = [str(TASKS / "jaxlowfp_local_mc.yaml"), str(TASKS / "jaxlowfp_local_rolling.yaml")]
    if args.gen:
        tasks.append(str(TASKS / "jaxlowfp_local_gen.yaml"))
    rows = []
    for q in args.configs.split(","):
        r = run(q, tasks, args.limit_gb)
        print(json.dumps(r), flush=True)
        m = r["metrics"]
        peak = f"killed at {r['peak_gib']:.2f}" if r["killed"] else f"{r['peak_gib']:.2f}"
        rows.append([LABELS.get(q, q) + (" (every projection)" if q != "none" else ""), peak, f"{r['seconds']:.0f}",
                     f"{m.get('jaxlowfp_local_mc/acc', float('nan')):.3f}",
                     f"{m.get('jaxlowfp_local_rolling/word_perplexity', float('nan')):.2f}"])
    if args.no_write:
        return
    cmd = ("python -m jaxlowfp.harness --model jaxlowfp --model_args pretrained=smollm2-135m,quantize=<q>,layers=all "
           "--tasks tests/lm_eval_tasks/jaxlowfp_local_mc.yaml,tests/lm_eval_tasks/jaxlowfp_local_rolling.yaml"
           + (",tests/lm_eval_tasks/jaxlowfp_local_gen.yaml" if args.gen else "") + " --batch_size 8")
    body = (f"`bench/eval_memory.py{' --gen' if args.gen else ''}` on {machine()} (2 cores shared with other jobs, "
            f"so seconds are loose): each row is `{cmd}` in a fresh interpreter; peak RSS of the process polled "
            f"every 0.2 s (GiB; killed above {args.limit_gb:g} GiB). Multiple choice: 8 questions x 4 choices; "
            f"rolling perplexity: 4 short documents{'; generation: 6 completions' if args.gen else ''}. Before the "
            "fix (the whole forward pass as one XLA program) NVFP4 on every projection was killed at 7.5 GiB while "
            "compiling that program for the first padded shape; the issue's report saw 20.6 GB. Measured once the same "
            "way with `quantize=nvfp4,layers=paper` (the default layers, 75 projections): 6.25 GiB before (commit "
            "292a06d), 1.47 GiB after, with the same scores (MC acc 0.500, word ppl 83.4812) from both. Generation "
            "(`jaxlowfp.models.generate`, the `--gen` task) compiled its step as one program for the whole model too "
            "(7.6 GB with NVFP4 on every projection); it now runs block by block as well (`blockwise=`).\n\n"
            + markdown_table(["SmolLM2-135M, lm-eval backend", "peak RSS (GiB)", "seconds", "MC acc", "word ppl"],
                             rows))
    write_section("Evaluation peak memory (SmolLM2-135M, lm-eval backend)", body)


if __name__ == "__main__":
    main()
