"""Continued pretraining of a real checkpoint with HiF8 W8A8 QAT: ``python -m train --model smollm2-135m``.

1. Load the checkpoint and its tokenizer (`jaxlowfp.models.load`: a registry name, a ``.gguf`` file or a Hugging Face
   directory); the compute dtype is ``--dtype`` (auto: bfloat16 on GPU, float32 on CPU), parameters float32.
2. Tokenize the training part of the Python standard library domain (`train.data`, documents ended by the EOS
   token) and draw batches of ``seq_len + 1`` tokens from it (`TokenStream`: `train.data.BatchStream`'s order,
   so resume and the ``data x fsdp`` mesh work as for the byte model).
3. Train every arm (`train.grid`: the default three, or ``--grid paper``) from the loaded weights with a constant
   learning rate: the MLP gate/up/down projections of blocks keep_first .. n-keep_last-1 quantized
   (`jaxlowfp.qnnx.paper_rules`, SmolLM2: blocks 3..27 of 30), attention, embeddings, norms and the first 3 and
   last 2 blocks in high precision; the quantized arms with a high-precision warmup where the arm has one.
   ``--microbatches`` accumulates gradients (amax histories merged by max), ``--remat`` rematerialises.
4. Evaluate every arm and the loaded model (`train.text_eval`, through lm-eval with the library's backend
   `jaxlowfp.harness`): adaptation is the word perplexity of held-out
   Python, retention the word perplexity of held-out Shakespeare and English prose and the multiple-choice task on
   held-out Shakespeare; print the table and write ``<run_dir>/report.md``.
5. With ``--downstream DIR`` (a ``python -m train tasks prepare`` directory, checked before anything loads): the
   loaded model and every arm, as trained, on DIR's lm-eval tasks (`downstream_eval`: the same
   `train.tasks_cli.evaluate_arm` as ``tasks run``, with the in-process model), lm-eval's per-sample logs in
   ``<run_dir>/<arm>/downstream/``; then each quantized arm paired item by item (`train.paired`) with its
   high-precision baseline at the same learning rate, each baseline with the loaded model: accuracy, acc_norm and
   the gold answer's log-likelihood differences with paired s.e., next to the loss APE (`downstream_rows`), in the
   printed table, ``report.md`` (and ``downstream.md``: every pair per task) and ``results.json``. A quantized
   arm is scored with the scales it serves with: HiF8 W8A8 on its MLP projections, weights and activations each
   scaled per tensor by its delayed-scaling state as training left it (`most_recent`: the last step's amax,
   `max_window`: the max over the last 64 steps' amaxes), frozen during evaluation (the scorer drops state
   the forward writes), so every request's score is independent of the batch it is in.

The defaults are a CPU smoke run (8 steps of 4 x 128 tokens per arm); ``scripts/gpu_grid.py`` runs GPU sizes.
"""
from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from . import evaluate as ev
from . import mesh as mesh_lib
from .arms import RuleError, finished_arm, quantize_arm, record_arm, stats_layer, train_arm
from .config import TrainConfig, arm_specs
from .data import DOC_SEP, BatchStream, DataError, eval_batches, load_domain
from .report import REAL_COLUMNS, format_table, grid_notes, summary_rows, write_report

__all__ = ["TokenStream", "token_eval_batches", "tokenize_domain", "load_model", "evaluate_model", "downstream_eval",
           "downstream_rows", "run"]

log = logging.getLogger(__package__)

RETENTION = ("shakespeare", "prose")
ADAPTATION = "python"
EVAL_BATCH = 8  # sequences per evaluation forward pass (one shape per window length: few compilations)
DOWNSTREAM = "downstream"  # <run_dir>/<arm>/downstream/: lm-eval's per-sample logs and results of the tasks
START = "start"  # <run_dir>/start/downstream/: the loaded model's


class TokenStream:
    """`train.data.BatchStream` over token ids below ``2**(8 * planes)``.

    `BatchStream` draws windows of a uint8 array in an order that depends only on the seed, the stream state and
    the array's length. Token ids are split into byte planes (``ids = sum_k plane_k << 8k``), one `BatchStream`
    per plane with the same seed: every plane yields the same windows, and the batch is reassembled from them.
    Sharding over processes, the state (for checkpoints) and resuming are `BatchStream`'s.
    """

    def __init__(self, ids: np.ndarray, *, batch_size: int, seq_len: int, seed: int, process_index: int = 0,
                 process_count: int = 1) -> None:
        kw = dict(batch_size=batch_size, seq_len=seq_len, seed=seed, process_index=process_index,
                  process_count=process_count)
        self.planes = [BatchStream(p, **kw) for p in _planes(ids)]
        self.batch_size, self.seq_len = batch_size, seq_len
        self.steps_per_epoch = self.planes[0].steps_per_epoch

    def init(self) -> Any:
        return self.planes[0].init()

    def next(self, state: Any) -> tuple[np.ndarray, Any]:
        """This process's rows (int32 [local_batch, seq_len + 1]) and the next state."""
        parts, new = [], None
        for plane in self.planes:
            part, new = plane.next(state)
            parts.append(part)
        return _join(parts), new


def _planes(ids: np.ndarray) -> list[np.ndarray]:
    """uint8 byte planes of non-negative token ids: ``ids = sum_k planes[k] << 8k``."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or ids.size == 0:
        raise TypeError(f"ids must be a non-empty 1-D integer array; got shape {ids.shape} dtype {ids.dtype}")
    if ids.min() < 0:
        raise ValueError(f"token ids must be >= 0; got {ids.min()}")
    n = max(1, math.ceil(int(ids.max()).bit_length() / 8))
    return [((ids >> (8 * k)) & 0xFF).astype(np.uint8) for k in range(n)]


def _join(parts: list[np.ndarray]) -> np.ndarray:
    out = np.zeros(parts[0].shape, np.int64)
    for k, part in enumerate(parts):
        out |= part.astype(np.int64) << (8 * k)
    return out.astype(np.int32)


def token_eval_batches(ids: np.ndarray, *, batch_size: int, seq_len: int, max_batches: int | None = None
                       ) -> list[np.ndarray]:
    """`train.data.eval_batches` (evenly spread windows of ``seq_len + 1``) over token ids: int32 batches."""
    per_plane = [eval_batches(p, batch_size=batch_size, seq_len=seq_len, max_batches=max_batches)
                 for p in _planes(ids)]
    return [_join(list(parts)) for parts in zip(*per_plane)]


def tokenize_domain(tokens: np.ndarray, tokenizer: Any) -> np.ndarray:
    """The documents of a byte-level domain split (`train.data`: each ended by DOC_SEP) as one token stream, each
    document's tokens followed by the tokenizer's EOS token (int32)."""
    docs = [d.decode("utf-8", errors="replace") for d in bytes(np.asarray(tokens)).split(bytes([DOC_SEP])) if d]
    if not docs:
        raise DataError("the domain has no documents to tokenize")
    sep = [] if tokenizer.eos_id is None else [int(tokenizer.eos_id)]
    out = [np.asarray(ids + sep, np.int32) for ids in tokenizer.encode_batch(docs)]
    return np.concatenate(out)


def load_model(cfg: TrainConfig) -> tuple[nnx.Module, Any, float]:
    """(model, tokenizer, seconds) of ``cfg.model``; a bad name or file exits with the loader's message."""
    from jaxlowfp.models.llama import compute_dtype_for_backend
    from jaxlowfp.models import CheckpointError, load

    dtype = cfg.dtype if cfg.dtype != "auto" else np.dtype(compute_dtype_for_backend()).name
    if dtype == "bfloat16" and np.dtype(compute_dtype_for_backend()).name == "float32":
        log.warning("bfloat16 compute on %s is emulated and slow", jax.default_backend())
    t0 = time.perf_counter()
    try:
        model, tok = load(cfg.model, dtype=dtype)
    except CheckpointError as e:
        raise SystemExit(f"error: --model {cfg.model!r}: {e}") from e
    return model, tok, time.perf_counter() - t0


def _check_sizes(cfg: TrainConfig, model: nnx.Module) -> None:
    c = model.config
    for name, v in (("seq_len", cfg.seq_len), ("eval_length", cfg.eval_length)):
        if v > c.max_seq_len:
            raise SystemExit(f"error: --{name.replace('_', '-')} {v} exceeds the model's max_seq_len {c.max_seq_len}")


def evaluate_model(model: nnx.Module, tokenizer: Any, texts: dict[str, list[str]], task: ev.ChoiceTask,
                   cfg: TrainConfig) -> dict[str, float]:
    """Word perplexity of every text (``ppl_<name>``, and ``bpb_<name>``, bits per byte), and the multiple-choice
    accuracy with the real tokenizer (``acc``, ``acc_norm``)."""
    from .text_eval import perplexity, score_choices_tokens

    out: dict[str, float] = {}
    for name, docs in texts.items():
        s = perplexity(model, tokenizer, docs, name=name, max_tokens=cfg.eval_tokens, max_length=cfg.eval_length,
                       stride=cfg.eval_length, batch_size=EVAL_BATCH, progress=False)
        out[f"ppl_{name}"], out[f"bpb_{name}"] = s.word_perplexity, s.bits_per_byte
    mc = score_choices_tokens(model, tokenizer, task, max_length=cfg.eval_length, batch_size=EVAL_BATCH,
                              progress=False)
    out["acc"], out["acc_norm"] = mc["acc"], mc["acc_norm"]
    return out


def _tasks_key(manifest: dict[str, Any]) -> str:
    """What identifies a prepared task set: the hash of its manifest (wheel, seed, kept rows per task)."""
    import hashlib

    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]


def _done_downstream(out: Path, key: str, ident: dict[str, Any] | None = None) -> dict[str, Any] | None:
    marker = out / "done.json"
    if not marker.is_file():
        return None
    done = json.loads(marker.read_text())
    return done if done.get("tasks") == key and all(done.get(k) == v for k, v in (ident or {}).items()) else None


def downstream_eval(model: nnx.Module, tokenizer: Any, tasks_dir: str | Path, out: str | Path, *, key: str,
                    ident: dict[str, Any] | None = None, batch_size: int = EVAL_BATCH) -> dict[str, Any]:
    """Evaluate ``model`` as it is (quantized ops and their amax states as training left them) on the lm-eval
    tasks of a prepared directory, through `train.tasks_cli.evaluate_arm` (what ``tasks run`` runs per arm) with an
    in-process `jaxlowfp.harness.JaxLowFPLM`; per-sample logs and ``results.json`` in ``out`` (cleared first), then
    ``done.json``: the summary returned (per-task acc, wall time, quantization record) with the task set's ``key``
    and ``ident``."""
    import shutil

    from jaxlowfp.harness import JaxLowFPLM
    from jaxlowfp.qnnx import set_observe_only
    from .tasks_cli import evaluate_arm

    out = Path(out)
    if jax.process_index() == 0 and out.exists():
        shutil.rmtree(out)
    set_observe_only(model, False)  # served quantized, also when an arm ended inside its warmup
    lm = JaxLowFPLM(model=model, tokenizer=tokenizer, batch_size=batch_size)
    res = evaluate_arm(lm, [str(tasks_dir)], out)
    q = res.get("config", {}).get("quantization", {})
    summary = {"tasks": key, **(ident or {}), "dir": str(out), "wall_s": res["wall_seconds"],
               "acc": {t: r.get("acc,none") for t, r in res["results"].items()},
               "quantization": {k: q.get(k) for k in ("kind", "scheme", "activation_scale", "gemm")}
               | {"ops": q.get("executed", {}).get("ops"), "ran": q.get("executed", {}).get("ran")}}
    if jax.process_index() == 0:
        (out / "done.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def downstream_rows(arms: list[dict[str, Any]], rows: list[dict[str, Any]], start: dict[str, Any] | None
                    ) -> tuple[list[dict[str, Any]], list[str]]:
    """Per arm with downstream results, its paired comparison (`train.paired`, over every item of every task) with
    its reference: a quantized arm's baseline (the high-precision arm at its learning rate), a high-precision arm's
    the loaded model (``start``). ``rows``: the summary rows of the arms (their loss APE). Returns the table rows
    and, per pair, the full per-task markdown table (for ``downstream.md``)."""
    from .paired import markdown, overall, paired

    by_name = {a["name"]: a for a in arms}
    ape = {r["arm"]: r.get("loss_ape") for r in rows}
    out, sections = [], []
    for a in arms:
        ds = a.get("downstream")
        if ds is None:
            continue
        ref_name = a.get("baseline")
        ref = by_name.get(ref_name, {}).get("downstream") if ref_name else None
        ref_label = str(by_name[ref_name]["label"]) if ref is not None else None
        if ref is None and a.get("baseline") is None:
            ref, ref_label = start, "pretrained (start)"
        row: dict[str, Any] = {"arm": a["label"], "name": a["name"], "lr": a.get("lr"), "vs": ref_label,
                               "loss_ape": ape.get(a["label"]), "acc": _pooled_acc(ds)}
        if ref is not None:
            pr = paired(ref["dir"], ds["dir"])
            for score, r in overall(pr).items():
                row |= {f"d_{score}": r.diff, f"se_{score}": r.se, "n": r.n}
            sections += [f"## {a['label']} vs {ref_label}", "", markdown(pr, name_a=str(ref_label), name_b=a["name"]),
                         ""]
        out.append(row)
    return out, sections


def _pooled_acc(ds: dict[str, Any]) -> float | None:
    """Item-weighted accuracy over the tasks of a downstream summary (per-task acc weighted by items)."""
    from .paired import load_samples

    samples = load_samples(ds["dir"])
    right = [float(s["acc"]) for v in samples.values() for s in v if "acc" in s]
    return sum(right) / len(right) if right else None


def _pm(row: dict[str, Any], score: str, scale: float, unit: str) -> str:
    d, se = row.get(f"d_{score}"), row.get(f"se_{score}")
    if d is None or se is None:
        return "-"
    return f"{scale * d:+.2f} +- {scale * se:.2f}{unit}" if math.isfinite(se) else f"{scale * d:+.2f}{unit}"


def downstream_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of `downstream_rows`: loss APE and the paired differences (B - reference) with s.e."""
    head = ["arm", "LR", "vs", "loss APE %", "acc", "d acc (pp)", "d acc_norm (pp)", "d gold LL (nats)", "n"]
    lines = ["| " + " | ".join(head) + " |", "|:---|---:|:---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ape = "-" if r.get("loss_ape") is None else f"{r['loss_ape']:.3f}"
        acc = "-" if r.get("acc") is None else f"{r['acc']:.3f}"
        lr = "-" if r.get("lr") is None else f"{r['lr']:.0e}"
        lines.append("| " + " | ".join([r["arm"], lr, r.get("vs") or "-", ape, acc, _pm(r, "acc", 100, ""),
                                        _pm(r, "acc_norm", 100, ""), _pm(r, "gold_ll", 1, ""),
                                        str(r.get("n", "-"))]) + " |")
    return "\n".join(lines)


def _preflight(cfg: TrainConfig, graphdef: nnx.GraphDef, state: nnx.State, specs: list[Any]) -> None:
    """Quantize a view of the model for every distinct quantized arm before any training: an incompatible rule
    set fails here, with its reason, and not after the high-precision arm has run."""
    seen = set()
    for arm in specs:
        key = (arm.format, arm.algorithm, arm.rule, arm.training)
        if arm.format == "none" or key in seen:
            continue
        seen.add(key)
        try:
            quantize_arm(nnx.merge(graphdef, state), arm, keep_first=cfg.keep_first, keep_last=cfg.keep_last,
                         seed=cfg.seed)
        except RuleError as e:
            raise SystemExit(f"error: --model {cfg.model!r}: {e}") from e


def run(cfg: TrainConfig) -> list[dict[str, Any]]:
    """Load, tokenize, train every arm, evaluate, print the table and write the report (module docstring)."""
    from .text_eval import CHOICE_TASK, lm_eval_note, load_texts, text_task

    t0 = time.perf_counter()
    tasks_key, tasks_dir = None, str(cfg.downstream)
    if cfg.downstream is not None:
        from .downstream_tasks import prepared
        from .tasks_cli import offline_env

        try:
            tasks_key = _tasks_key(prepared(cfg.downstream))
        except ValueError as e:
            raise SystemExit(f"error: --downstream: {e}") from e
        offline_env()
    mesh = mesh_lib.make_mesh(cfg.mesh)
    if cfg.batch_size % (mesh.shape["data"] * mesh.shape["fsdp"]):
        raise SystemExit(f"--batch-size {cfg.batch_size} is not divisible by the {mesh.size} devices of the mesh")
    model, tok, load_s = load_model(cfg)
    _check_sizes(cfg, model)
    graphdef, state = nnx.split(model)
    specs = arm_specs(cfg)
    _preflight(cfg, graphdef, state, specs)
    n, n_params = model.config.n_layers, model.config.num_params()
    log.info("model %s: %.1f M parameters, %d blocks, vocab %d, compute %s; loaded in %.0f s; quantized blocks "
             "%d..%d", cfg.model, n_params / 1e6, n, model.config.vocab, np.dtype(model.dtype).name, load_s,
             cfg.keep_first, n - cfg.keep_last - 1)
    try:
        domain_b = load_domain("python", max_bytes=cfg.max_bytes)
        texts = load_texts((ADAPTATION, *RETENTION))
        task = ev.build_choice_task(load_domain("shakespeare").val, n_items=cfg.mc_items, seed=cfg.seed)
    except DataError as e:
        raise SystemExit(f"data: {e}") from e
    t_tok = time.perf_counter()
    ids = tokenize_domain(domain_b.train, tok)
    log.info("domain B: %d bytes -> %d tokens (%.0f s)", len(domain_b.train), len(ids), time.perf_counter() - t_tok)
    stream = TokenStream(ids, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed + 1,
                         process_index=jax.process_index(), process_count=jax.process_count())
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_json(), indent=1))

    t_eval = time.perf_counter()
    start_row = {"arm": "pretrained (start)", **evaluate_model(model, tok, texts, task, cfg),
                 "wall_s": time.perf_counter() - t_eval}
    log.info("loaded model: %s", ", ".join(f"{k} {v:.3f}" for k, v in start_row.items() if k.startswith("ppl_")))
    start_ds = None
    if tasks_key is not None:
        ident = {"model": cfg.model, "dtype": cfg.dtype}
        start_ds = _done_downstream(run_dir / START / DOWNSTREAM, tasks_key, ident)
        if start_ds is None:
            start_ds = downstream_eval(model, tok, tasks_dir, run_dir / START / DOWNSTREAM, key=tasks_key,
                                       ident=ident)
        log.info("loaded model on %s: acc %s (%.0f s)", cfg.downstream, start_ds["acc"], start_ds["wall_s"])
    del model
    arms = []
    for arm in specs:
        done = finished_arm(run_dir / arm.name, cfg) if cfg.resume else None
        if done is not None and tasks_key is not None:  # reused only with its downstream results for these tasks
            ds = _done_downstream(run_dir / arm.name / DOWNSTREAM, tasks_key)
            done = None if ds is None or done.get("downstream", {}).get("tasks") != tasks_key else done | {
                "downstream": ds}
        if done is not None:
            log.info("arm %s finished earlier: reused (%s)", arm.name, run_dir / arm.name)
            arms.append(done)
            continue
        t_arm = time.perf_counter()
        log.info("arm %s (%s): %d steps of %d x %d tokens on Python", arm.name, arm.label, cfg.steps,
                 cfg.batch_size, cfg.seq_len)
        m = nnx.merge(graphdef, state, copy=True)
        try:
            report = quantize_arm(m, arm, keep_first=cfg.keep_first, keep_last=cfg.keep_last, seed=cfg.seed)
        except RuleError as e:
            raise SystemExit(f"error: --model {cfg.model!r}: {e}") from e
        if report is not None:
            log.info("arm %s: %s", arm.name, "; ".join(str(report).splitlines()[-2:]))
        res = train_arm(m, arm, stream, cfg, steps=cfg.steps, lr=arm.lr, schedule=cfg.schedule,
                        out_dir=run_dir / arm.name, mesh=mesh, stats=stats_layer(arm, cfg.keep_first),
                        meta={"config": cfg.to_json()}, cached_optimizer=True)
        metrics = evaluate_model(m, tok, texts, task, cfg)
        ds = None
        if tasks_key is not None:
            ds = downstream_eval(m, tok, tasks_dir, run_dir / arm.name / DOWNSTREAM, key=tasks_key)
            log.info("arm %s on %s: acc %s (%.0f s)", arm.name, cfg.downstream, ds["acc"], ds["wall_s"])
        wall = time.perf_counter() - t_arm
        log.info("arm %s done in %.0f s (training %.0f s, %d skipped steps): %s", arm.name, wall, res.wall_s,
                 int(res.state.skipped), ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("ppl_")))
        entry: dict[str, Any] = {"name": arm.name, "label": arm.label, "dir": str(run_dir / arm.name), **metrics,
                                 "wall_s": wall, "lr": arm.lr, "baseline": arm.baseline, "role": arm.role}
        if ds is not None:
            entry["downstream"] = ds
        record_arm(run_dir / arm.name, cfg, entry)
        arms.append(entry)
        del m, res
    rows = [start_row, *summary_rows(arms, baseline="hp" if "hp" in cfg.arms else None)]
    ds_rows, ds_sections = downstream_rows(arms, rows, start_ds) if tasks_key is not None else ([], [])
    total = time.perf_counter() - t0
    print(format_table(rows, columns=REAL_COLUMNS))
    if ds_rows:
        print(f"\ndownstream ({cfg.downstream}; paired differences arm - reference, with paired s.e.)")
        print(downstream_table(ds_rows))
    print(f"total wall time {total:.0f} s (loading {load_s:.0f} s)")
    if jax.process_index() == 0:
        notes = [f"Model `{cfg.model}` ({n_params / 1e6:.1f} M parameters), {cfg.steps} steps of "
                 f"{cfg.batch_size} x {cfg.seq_len} tokens per arm ({cfg.microbatches} microbatch(es)); perplexity "
                 f"on {cfg.eval_tokens} tokens per text in disjoint windows of {cfg.eval_length} tokens; "
                 f"{cfg.mc_items} multiple-choice items.",
                 lm_eval_note([text_task(t) for t in texts] + [CHOICE_TASK]) + "."]
        if cfg.grid is not None:
            notes += grid_notes(rows, arms, specs, keys=REAL_KEYS)
        path = write_report(run_dir, arms, rows=rows, baseline="hp" if "hp" in cfg.arms else None,
                            config=cfg.to_json(), total_wall_s=total,
                            amax_layer=f"blocks/{cfg.keep_first}/mlp/down_proj",
                            columns=REAL_COLUMNS, notes=notes, loss_ylabel="training loss (nats/token)",
                            loss_title=f"continued pretraining of {cfg.model} on Python",
                            title=f"HiF8 W8A8 QAT of {cfg.model}: continued pretraining on Python")
        result: dict[str, Any] = {"rows": rows, "total_wall_s": total}
        if ds_rows:
            result["downstream"] = {"tasks_dir": str(cfg.downstream), "tasks": tasks_key, "start": start_ds,
                                    "rows": ds_rows}
            _append_downstream(Path(path), run_dir, cfg, ds_rows, ds_sections)
        (run_dir / "results.json").write_text(json.dumps(result, indent=1, default=str))
        print(f"report: {path}")
    return rows


def _append_downstream(report: Path, run_dir: Path, cfg: TrainConfig, ds_rows: list[dict[str, Any]],
                       sections: list[str]) -> None:
    """The downstream table at the end of ``report.md``; every pair per task in ``downstream.md``."""
    from .downstream_tasks import prepared

    manifest = prepared(str(cfg.downstream))
    items = ", ".join(f"{t} {v['kept']} of {v['rows']}" for t, v in manifest["tasks"].items())
    text = [
        "", "## Downstream tasks, paired with the baseline at the same learning rate", "",
        f"lm-eval tasks of `{cfg.downstream}` ({items} validation items, seed {manifest.get('seed')}, "
        f"{manifest.get('source')}), zero-shot, each arm as trained (quantized arms with their HiF8 W8A8 ops and "
        f"delayed-scaling states as training left them), batch size {EVAL_BATCH}. `d` = arm - reference, item by "
        "item, over every item of every task, with its paired s.e. (`train.paired`); a quantized arm's reference is "
        "its high-precision baseline at the same LR, a baseline's the loaded model. Per task: `downstream.md`; "
        "per-sample logs: `<arm>/downstream/`.", "", downstream_table(ds_rows), ""]
    with open(report, "a", encoding="utf-8") as f:
        f.write("\n".join(text))
    (run_dir / "downstream.md").write_text("\n".join(["# Paired comparisons per task", "", *sections]),
                                           encoding="utf-8")


# (key, header) of the grid notes: adaptation first, then retention; the forgetting measure is the first retention key
REAL_KEYS = (("ppl_python", "Python ppl"), ("ppl_shakespeare", "Shakespeare ppl"), ("ppl_prose", "prose ppl"),
             ("acc", "MC acc"))

