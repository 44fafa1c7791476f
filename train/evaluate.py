"""Evaluation: validation loss, a HellaSwag-style multiple-choice task from held-out text, and loss APE.

Evaluation never changes the model: it runs on ``nnx.split`` state inside ``jax.jit`` and drops any state the
forward pass writes (for example the amax histories of quantized layers).
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlowfp._core.checks import one_of
from .data import DOC_SEP, eval_batches
from jaxlowfp.models.llama import token_log_likelihood

__all__ = [
    "ChoiceTask",
    "build_choice_task",
    "choice_log_likelihoods",
    "loss_ape",
    "score_choices",
    "validation_loss",
]

_WHITESPACE = np.zeros(256, bool)
_WHITESPACE[list(b" \t\r\n")] = True


@functools.partial(jax.jit, static_argnums=0)
def _masked_ll_sum(graphdef: nnx.GraphDef, state: nnx.State, batch: jax.Array, mask: jax.Array) -> jax.Array:
    """Per row: sum over positions with ``mask`` of ``log p(batch[:, t+1] | batch[:, :t+1])`` (float32 [B])."""
    model = nnx.merge(graphdef, state)
    return jnp.sum(jnp.where(mask, token_log_likelihood(model, batch), 0.0), axis=-1)


def validation_loss(
    model: nnx.Module, tokens: np.ndarray, *, batch_size: int, seq_len: int, max_batches: int | None = None
) -> dict[str, float]:
    """Mean next-byte cross-entropy over `eval_batches` windows, ``{"loss": nats/byte, "ppl": exp(loss)}``."""
    graphdef, state = nnx.split(model)
    total, count = 0.0, 0
    for batch in eval_batches(tokens, batch_size=batch_size, seq_len=seq_len, max_batches=max_batches):
        mask = np.ones((batch.shape[0], seq_len), bool)
        total -= float(jnp.sum(_masked_ll_sum(graphdef, state, batch, mask), dtype=jnp.float32))
        count += mask.size
    loss = total / count
    return {"loss": loss, "ppl": math.exp(loss) if loss < 700 else math.inf}


class ChoiceTask(NamedTuple):
    """Multiple-choice items: pick the true continuation of ``context`` among ``choices``.

    ``choices[i, j, :lengths[i, j]]`` are the bytes of choice ``j`` of item ``i`` (zero padded);
    ``choices[i, label[i]]`` is the true continuation.
    """

    context: np.ndarray  # int32 [n_items, context_len]
    choices: np.ndarray  # int32 [n_items, n_choices, continuation_len]
    lengths: np.ndarray  # int32 [n_items, n_choices], in [continuation_len // 2, continuation_len]
    label: np.ndarray  # int32 [n_items]


def _positive(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{what} must be a positive int; got {v!r}")
    return int(v)


def build_choice_task(
    val_tokens: np.ndarray,
    *,
    n_items: int,
    context_len: int = 96,
    continuation_len: int = 32,
    seed: int = 0,
    n_choices: int = 4,
) -> ChoiceTask:
    """A HellaSwag-style task from held-out text: a context, its true continuation, and distractors.

    Items start at word starts (a non-whitespace byte after whitespace) whose window of ``context_len`` bytes
    before and ``continuation_len + 1`` bytes after holds no document boundary. A continuation is the bytes
    from such a start up to the last whitespace in ``[continuation_len // 2, continuation_len)`` (it ends at
    the end of a word; ``continuation_len`` bytes if there is none), so lengths vary like sentence endings do.
    Distractors are continuations at other word starts at least ``context_len + continuation_len`` bytes
    away, different from the true one and from each other. The true choice's position is random.
    Scoring feeds ``context_len + continuation_len - 1`` tokens (127 by default: fits ``max_seq_len`` 128).
    """
    tokens = np.asarray(val_tokens)
    if tokens.ndim != 1 or tokens.dtype != np.uint8:
        raise TypeError(f"val_tokens must be a 1-D uint8 byte array; got shape {tokens.shape} dtype {tokens.dtype}")
    n_items, context_len = _positive(n_items, "n_items"), _positive(context_len, "context_len")
    k = _positive(continuation_len, "continuation_len")
    n_choices = _positive(n_choices, "n_choices")
    if k < 2 or n_choices < 2:
        raise ValueError(f"need continuation_len >= 2 and n_choices >= 2; got {k} and {n_choices}")
    n = len(tokens)
    ws = _WHITESPACE[tokens]
    seps = np.concatenate([[0], np.cumsum(tokens == DOC_SEP)])
    starts = np.arange(context_len, n - k)  # a start needs context before and k + 1 bytes after it
    starts = starts[ws[starts - 1] & ~ws[starts] & (tokens[starts] != DOC_SEP)]
    starts = starts[seps[starts + k + 1] == seps[starts - context_len]]
    if len(starts) < n_items + n_choices:
        raise ValueError(
            f"{n} validation bytes give {len(starts)} usable item starts, too few for n_items={n_items}; "
            "use fewer items or shorter contexts"
        )
    min_len = k // 2
    # end of continuation at offset j: the last whitespace in [k // 2, k)
    win = ws[starts[:, None] + np.arange(k)]
    win[:, :min_len] = False
    lens = np.where(win.any(1), k - 1 - np.argmax(win[:, ::-1], axis=1), k)

    rng = np.random.default_rng(seed)
    items = rng.choice(len(starts), n_items, replace=False)
    away = context_len + k
    context = np.empty((n_items, context_len), np.int32)
    choices = np.zeros((n_items, n_choices, k), np.int32)
    lengths = np.empty((n_items, n_choices), np.int32)
    label = rng.integers(n_choices, size=n_items).astype(np.int32)
    for i, item in enumerate(items):
        s = starts[item]
        context[i] = tokens[s - context_len : s]
        picked = [item]
        seen = {tokens[s : s + lens[item]].tobytes()}
        for _ in range(1000 * n_choices):
            if len(picked) == n_choices:
                break
            j = int(rng.integers(len(starts)))
            text = tokens[starts[j] : starts[j] + lens[j]].tobytes()
            if abs(int(starts[j]) - int(s)) >= away and text not in seen:
                picked.append(j)
                seen.add(text)
        if len(picked) < n_choices:
            raise ValueError(f"could not draw {n_choices - 1} distinct distractors; the validation text is too small")
        order = picked[1:]
        order.insert(int(label[i]), item)
        for c, j in enumerate(order):
            lengths[i, c] = lens[j]
            choices[i, c, : lens[j]] = tokens[starts[j] : starts[j] + lens[j]]
    return ChoiceTask(context, choices, lengths, label)


def choice_log_likelihoods(model: nnx.Module, task: ChoiceTask, *, batch_size: int = 64) -> np.ndarray:
    """``log p(choice | context)`` summed over the choice's bytes: float32 [n_items, n_choices]."""
    batch_size = _positive(batch_size, "batch_size")
    n, c, k = task.choices.shape
    ctx = task.context.shape[1]
    seqs = np.concatenate([np.repeat(task.context[:, None], c, axis=1), task.choices], axis=2).reshape(n * c, -1)
    # target t of a row is seqs[t + 1]: choice byte m is target ctx - 1 + m
    pos = np.arange(ctx + k - 1) - (ctx - 1)
    mask = (pos[None, :] >= 0) & (pos[None, :] < task.lengths.reshape(-1, 1))
    pad = -len(seqs) % batch_size  # full batches only: one trace
    seqs = np.concatenate([seqs, np.zeros((pad, seqs.shape[1]), np.int32)])
    mask = np.concatenate([mask, np.zeros((pad, mask.shape[1]), bool)])
    graphdef, state = nnx.split(model)
    out = [
        np.asarray(_masked_ll_sum(graphdef, state, seqs[i : i + batch_size], mask[i : i + batch_size]))
        for i in range(0, len(seqs), batch_size)
    ]
    return np.concatenate(out)[: n * c].reshape(n, c)


def score_choices(model: nnx.Module, task: ChoiceTask, *, batch_size: int = 64) -> dict[str, float]:
    """Accuracy of picking the most likely choice: ``acc`` by total log-likelihood, ``acc_norm`` by
    log-likelihood per byte of the choice (lm-eval's length normalisation). Ties go to the first choice."""
    ll = choice_log_likelihoods(model, task, batch_size=batch_size)
    acc = np.mean(np.argmax(ll, axis=1) == task.label)
    acc_norm = np.mean(np.argmax(ll / task.lengths, axis=1) == task.label)
    return {"acc": float(acc), "acc_norm": float(acc_norm)}


def loss_ape(
    qat_losses: Sequence[float] | np.ndarray,
    baseline_losses: Sequence[float] | np.ndarray,
    *,
    nonfinite: str = "raise",
) -> float:
    """Loss APE in percent: the mean absolute percentage error of a QAT loss curve against its baseline.

    ``APE = 100 / T * sum_t |L_qat(t) - L_base(t)| / |L_base(t)|`` over the T aligned steps
    (same data order, so step t saw the same batch in both runs).

    ``nonfinite="raise"`` refuses curves with NaN/Inf (a skipped step); ``"skip"`` leaves out the steps where
    either curve is non-finite (report how many were skipped next to the number).
    """
    one_of(nonfinite, ("raise", "skip"), "nonfinite")
    q = np.asarray(qat_losses, np.float64)
    b = np.asarray(baseline_losses, np.float64)
    if q.ndim != 1 or b.ndim != 1 or q.shape != b.shape or q.size == 0:
        raise ValueError(f"loss curves must be non-empty 1-D and aligned; got shapes {q.shape} and {b.shape}")
    ok = np.isfinite(q) & np.isfinite(b)
    if not ok.all():
        if nonfinite == "raise":
            raise ValueError(
                f"loss curves have {int((~ok).sum())} non-finite step(s); pass nonfinite='skip' to leave them out"
            )
        if not ok.any():
            raise ValueError("loss curves have no step where both losses are finite")
        q, b = q[ok], b[ok]
    if np.any(b == 0):
        raise ValueError("baseline loss is 0 at some step; APE is undefined there")
    return float(100.0 * np.mean(np.abs(q - b) / np.abs(b)))
