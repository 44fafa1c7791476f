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

__all__ = ["TokenStream", "token_eval_batches", "tokenize_domain", "load_model", "evaluate_model", "run"]

log = logging.getLogger(__package__)

RETENTION = ("shakespeare", "prose")
ADAPTATION = "python"
EVAL_BATCH = 8  # sequences per evaluation forward pass (one shape per window length: few compilations)


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
    del model
    arms = []
    for arm in specs:
        done = finished_arm(run_dir / arm.name, cfg) if cfg.resume else None
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
        wall = time.perf_counter() - t_arm
        log.info("arm %s done in %.0f s (training %.0f s, %d skipped steps): %s", arm.name, wall, res.wall_s,
                 int(res.state.skipped), ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("ppl_")))
        entry = {"name": arm.name, "label": arm.label, "dir": str(run_dir / arm.name), **metrics, "wall_s": wall,
                 "lr": arm.lr, "baseline": arm.baseline, "role": arm.role}
        record_arm(run_dir / arm.name, cfg, entry)
        arms.append(entry)
        del m, res
    rows = [start_row, *summary_rows(arms, baseline="hp" if "hp" in cfg.arms else None)]
    total = time.perf_counter() - t0
    print(format_table(rows, columns=REAL_COLUMNS))
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
        (run_dir / "results.json").write_text(json.dumps({"rows": rows, "total_wall_s": total}, indent=1))
        print(f"report: {path}")
    return rows


# (key, header) of the grid notes: adaptation first, then retention; the forgetting measure is the first retention key
REAL_KEYS = (("ppl_python", "Python ppl"), ("ppl_shakespeare", "Shakespeare ppl"), ("ppl_prose", "prose ppl"),
             ("acc", "MC acc"))

