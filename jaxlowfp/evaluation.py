"""Evaluation of a tokenized causal language model: rolling-window perplexity and multiple-choice scoring, with the
conventions of EleutherAI's lm-evaluation-harness (lm-eval) so that the numbers compare with published ones.

Perplexity follows lm-eval's ``loglikelihood_rolling``: a document's tokens ``x_1..x_n`` are cut into windows of at
most ``max_length`` model inputs; the first window predicts ``x_1..x_W`` from ``[prefix] + x_1..x_{W-1}`` (the
prefix token is the BOS token, or EOS when there is none, as in lm-eval), every later window predicts the next
``stride`` tokens with the ``max_length - stride`` tokens before them as extra context. Every token is scored exactly
once, with as much context as the window allows (``stride == max_length`` is lm-eval's default of disjoint windows).
From the total log-likelihood ``LL`` of a text::

    token perplexity = exp(-LL / tokens)
    word perplexity  = exp(-LL / words)      words = len(re.split(r"\\s+", doc)) summed over documents
    byte perplexity  = exp(-LL / bytes)      bytes of the UTF-8 text; bits per byte = -LL / (bytes ln 2)

Multiple choice (`score_choices`) tokenizes as lm-eval does (trailing whitespace of the context moves to the
continuation; the continuation's tokens are those of ``context + continuation`` after the context's) and reports
``acc`` (argmax of the choice's total log-likelihood) and ``acc_norm`` (of the log-likelihood per byte of the choice).

The model is any Flax NNX module called as ``model(tokens) -> logits [B, T, vocab]`` with a ``config`` that has
``vocab`` and ``max_seq_len`` (`jaxlowfp.models.Llama`); the tokenizer has ``encode``, ``decode``, ``bos_id`` and
``eos_id`` (`jaxlowfp.models.Tokenizer`). Progress bars are off unless ``progress=True`` (needs ``tqdm``, in the
``jaxlowfp[models]`` extra).
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import dataclasses
import functools
import math
import re
import time
from typing import Any, Iterable, Literal, Sequence, cast, overload

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlowfp import sharding
from jaxlowfp.execution import (SharedPrograms, batch_scaled_ops, check_executed, per_request_model, records,
                                update_records)
from jaxlowfp._core.placement import commit_tree
from jaxlowfp._core.progress import progress_bar

__all__ = [
    "ChoiceItem",
    "Request",
    "TextScore",
    "batch_scaled_ops",
    "budget_docs",
    "choice_requests",
    "encode_pair",
    "pair_request",
    "perplexity",
    "rolling_requests",
    "score_choices",
    "score_requests",
]


@dataclasses.dataclass(frozen=True)
class Request:
    """Score the last ``n_pred`` next-token predictions of ``tokens``: ``log p(tokens[t] | tokens[:t])`` for
    ``t = len - n_pred .. len - 1``."""

    tokens: tuple[int, ...]
    n_pred: int


def rolling_requests(tokens: Sequence[int], *, prefix_token: int, max_length: int, stride: int) -> list[Request]:
    """lm-eval's rolling windows (``get_rolling_token_windows`` with ``context_len = max_length - stride + 1``)."""
    if not 1 <= stride <= max_length:
        raise ValueError(f"need 1 <= stride <= max_length; got stride={stride}, max_length={max_length}")
    toks = [int(t) for t in tokens]
    if not toks:
        return []
    first = min(max_length, len(toks))
    out = [Request((prefix_token, *toks[:first]), first)]
    done = first
    while done < len(toks):
        n = min(len(toks) - done, stride)
        end = done + n
        out.append(Request(tuple(toks[end - max_length - 1: end]), n))
        done = end
    return out


BUCKET_MIN, BUCKET_STEPS = 16, 4


def _bucket(n: int) -> int:
    """Padded sequence length: ``BUCKET_STEPS`` (4) lengths per octave above ``BUCKET_MIN`` (16), multiples of 8:
    16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, ... A sequence is padded by less than a quarter of its
    length (a power of two wastes up to half, and short multiple-choice requests then cost twice their tokens), with
    few distinct shapes (one compilation each): 4 per doubling of the length."""
    if n <= BUCKET_MIN:
        return BUCKET_MIN
    half = 1 << ((n - 1).bit_length() - 1)  # the largest power of two < n
    step = max(half // BUCKET_STEPS, 8)
    return half + -(-(n - half) // step) * step


def _sums(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row: sum over ``weights`` of ``log softmax(logits)[targets]`` (float32 [B]), and whether every
    weighted target is the argmax of its logits (bool [B]; ties count as greedy only for the first maximum)."""
    ll = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(logits, axis=-1)
    greedy = jnp.all((jnp.argmax(logits, axis=-1) == targets) | ~weights, axis=-1)
    return jnp.sum(jnp.where(weights, ll, 0.0), axis=-1), greedy


@functools.partial(jax.jit, static_argnums=0)
def _ll_sums(graphdef: nnx.GraphDef, state: nnx.State, inputs: jax.Array, targets: jax.Array,
             weights: jax.Array) -> tuple[tuple[jax.Array, jax.Array], nnx.State]:
    """`_sums` of ``model(inputs)``: the whole forward pass as one program (models without ``ptq_blocks()``); and
    the execution records it wrote (`jaxlowfp.execution.records`: the only state that comes back)."""
    model = nnx.merge(graphdef, state)
    return _sums(model(inputs), targets, weights), records(model, written=True)


# Block by block (models with ``ptq_blocks()``): one program for the embedding, one per distinct block structure
# (shared by every block that has it), one for the head and the sums. A fake-quantized layer is thousands of HLO
# ops (an NVFP4 Four Over Six quantizer: ~2,300, two per layer), and XLA's compilation memory grows with the size of
# the program: the whole forward of SmolLM2 with every projection quantized as one program took more than 7.5 GB
# to compile (bench/eval_memory.py); one block takes a thirtieth of that, and its program is compiled once.
@functools.partial(jax.jit, static_argnums=(0, 1))
def _embed(fn: Any, graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array) -> tuple[jax.Array, nnx.State]:
    model = nnx.merge(graphdef, state)
    return fn(model, tokens), records(model, written=True)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _block(fn: Any, graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array) -> tuple[jax.Array, nnx.State]:
    block = nnx.merge(graphdef, state)
    return fn(block, x), records(block)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _head_sums(fn: Any, graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, targets: jax.Array,
               weights: jax.Array) -> tuple[tuple[jax.Array, jax.Array], nnx.State]:
    model = nnx.merge(graphdef, state)
    return _sums(fn(model, x), targets, weights), records(model, written=True)


# Scored positions only (issue 46, item 5): a multiple-choice request scores its continuation, a few tokens of a
# padded row of tens, yet the log-softmax over the vocabulary (49,152 columns for SmolLM2) at every position of the
# batch cost more than the head's matrix product. When a batch's longest continuation pads to fewer positions than
# the row (`_gather_len`), the programs below take the final hidden states (block by block: before the head) or the
# logits (a whole-forward model) at the scored positions ``pos`` [B, K] only, and the head and the sums run on
# [B, K] instead of [B, T]. A row's values are its own either way (the head is per token; models whose activation
# scales span the batch keep the full path, `_Forward`).
@functools.partial(jax.jit, static_argnums=0)
def _ll_sums_at(graphdef: nnx.GraphDef, state: nnx.State, inputs: jax.Array, pos: jax.Array, targets: jax.Array,
                weights: jax.Array) -> tuple[tuple[jax.Array, jax.Array], nnx.State]:
    """`_ll_sums` with the logits taken at the positions ``pos`` [B, K] (targets and weights [B, K])."""
    model = nnx.merge(graphdef, state)
    logits = jnp.take_along_axis(model(inputs), pos[..., None], axis=1)
    return _sums(logits, targets, weights), records(model, written=True)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _head_sums_at(fn: Any, graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, pos: jax.Array,
                  targets: jax.Array, weights: jax.Array) -> tuple[tuple[jax.Array, jax.Array], nnx.State]:
    """`_head_sums` of the hidden states at the positions ``pos`` [B, K] only (targets and weights [B, K])."""
    model = nnx.merge(graphdef, state)
    return _sums(fn(model, jnp.take_along_axis(x, pos[..., None], axis=1)), targets, weights), \
        records(model, written=True)


def _gather_len(n_pred: int, length: int) -> int:
    """How many positions a batch whose longest continuation scores ``n_pred`` tokens keeps (padded as lengths
    are, `_bucket`); ``length`` (no gathering) when that is not fewer than the row's."""
    return min(_bucket(n_pred), length)


class _Forward:
    """``(sums, greedy)`` of a batch: block by block for a model with ``ptq_blocks()``, else `_ll_sums`. ``run``: the
    module that runs (default `model`; a copy of it with the same structure, `execution.per_request_model`), whose
    execution records are written into `model`."""

    def __init__(self, model: nnx.Module, run: nnx.Module | None = None):
        self.model = model  # its execution records are written back after the first call
        self.recorded = False
        model = model if run is None else run
        # scored positions only (`_head_sums_at`) unless an activation scale spans the batch: gathering rows would
        # change which values such a scale sees
        self.gather = not batch_scaled_ops(model)
        self.graphdef, self.state = nnx.split(model)
        self.blocks = None
        own = getattr(model, "ptq_blocks", None)
        if callable(own):  # (embed, [(path, call)], head), the protocol `jaxlowfp.ptq.sequential` reads
            embed, blocks, head = own()
            mods = {"/".join(map(str, p)): m for p, m in nnx.iter_modules(model)}
            bad = [p for p, _ in blocks if not isinstance(mods.get(p), nnx.Module)]
            if bad or not callable(embed) or not callable(head):
                raise TypeError(f"{type(model).__name__}.ptq_blocks() must give callables embed and head and the paths "
                                f"of blocks; got embed={embed!r}, head={head!r}, no module at {bad[:3]}")
            self.programs = SharedPrograms([mods[path] for path, _ in blocks])
            # committed where the model is (`placement.commit_tree`): a block program is shared by the blocks of
            # every model of its structure, and an uncommitted model's would be lowered (compiled) apart
            self.state, states = commit_tree((self.state, [s for _, s in self.programs.split]))
            self.blocks = [(call, g, s) for (_, call), (g, _), s in zip(blocks, self.programs.split, states)]
            self.embed, self.head = embed, head

    def __call__(self, inputs: jax.Array, targets: jax.Array, weights: jax.Array,
                 pos: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """``targets`` and ``weights`` [B, T], or with ``pos`` [B, K] (the scored positions) [B, K]."""
        recs = []
        if self.blocks is None:
            if pos is None:
                out, r = _ll_sums(self.graphdef, self.state, inputs, targets, weights)
            else:
                out, r = _ll_sums_at(self.graphdef, self.state, inputs, pos, targets, weights)
            recs.append(r)
        else:
            x, r = _embed(self.embed, self.graphdef, self.state, inputs)
            recs.append(r)
            # committed, as every block's output is (its parameters are): else the first block's x (the embedding
            # of uncommitted tokens) is lowered apart from the others', and each block program compiles twice
            x = jax.device_put(x, x.sharding)
            for i, (call, g, s) in enumerate(self.blocks):
                x, r = _block(call, g, s, x)
                self.programs.record(i, r)
            if pos is None:
                out, r = _head_sums(self.head, self.graphdef, self.state, x, targets, weights)
            else:
                out, r = _head_sums_at(self.head, self.graphdef, self.state, x, pos, targets, weights)
            recs.append(r)
        if not self.recorded:  # a program's records are the same at every call
            for r in recs:
                update_records(self.model, r)
            self.recorded = True
        return out


@overload
def score_requests(model: nnx.Module, requests: Sequence[Request], *, batch_size: int = 8, progress: bool = False,
                   desc: str = "score", greedy: Literal[False] = False, max_batch_tokens: int | None = None,
                   mesh: jax.sharding.Mesh | None = None, batch_scales: str = "warn"
                   ) -> tuple[np.ndarray, dict[str, float]]: ...


@overload
def score_requests(model: nnx.Module, requests: Sequence[Request], *, batch_size: int = 8, progress: bool = False,
                   desc: str = "score", greedy: Literal[True], max_batch_tokens: int | None = None,
                   mesh: jax.sharding.Mesh | None = None, batch_scales: str = "warn"
                   ) -> tuple[np.ndarray, np.ndarray, dict[str, float]]: ...


@overload
def score_requests(model: nnx.Module, requests: Sequence[Request], *, batch_size: int = 8, progress: bool = False,
                   desc: str = "score", greedy: bool = False, max_batch_tokens: int | None = None,
                   mesh: jax.sharding.Mesh | None = None, batch_scales: str = "warn"
                   ) -> tuple[np.ndarray, dict[str, float]] | tuple[np.ndarray, np.ndarray, dict[str, float]]: ...


def score_requests(model: nnx.Module, requests: Sequence[Request], *, batch_size: int = 8, progress: bool = False,
                   desc: str = "score", greedy: bool = False, max_batch_tokens: int | None = None,
                   mesh: jax.sharding.Mesh | None = None, batch_scales: str = "warn"
                   ) -> tuple[np.ndarray, dict[str, float]] | tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """Log-likelihood (float64 [n]) of every request, and throughput stats.

    Requests are sorted by length and batched with right padding (a causal model never looks right, so padding
    needs no attention mask) to one of 4 lengths per octave (`_bucket`: 16, 24, 32, ..., 64, 80, 96, 112, 128, 160,
    ...), capped at ``max_seq_len``; every batch has ``batch_size``
    rows (fewer for long sequences when ``max_batch_tokens`` caps rows x padded length, the logits' memory), so the
    forward pass compiles once per padded length. A model with ``ptq_blocks()`` (`jaxlowfp.models.Llama`) runs
    block by block, one compiled program per distinct block structure shared by the identical blocks (the
    log-likelihoods are bitwise those of the whole forward pass as one program, whose size, and XLA's compilation
    memory, grew with every fake-quantized layer). When a batch's longest continuation pads (`_bucket`) to fewer
    positions than its rows, the head and the log-softmax run on the scored positions only (`_head_sums_at`: a
    multiple-choice batch computes the vocabulary's log-softmax at its continuations' tokens, not at every
    position); not for a model whose activation scales span the batch (`batch_scaled_ops`). Stats: ``tokens``
    (model inputs, padding excluded), ``scored`` tokens, ``seconds`` and ``tokens_per_s`` (inputs per wall second,
    compilation included).
    ``greedy=True`` returns ``(ll, is_greedy, stats)``: ``is_greedy`` (bool [n]) says whether greedy decoding
    would produce every scored token (lm-eval's ``is_greedy``: ``argmax logits[t-1] == tokens[t]`` for each).
    The model is not changed (state written by the forward pass, e.g. amax histories, is dropped).
    ``mesh``: the model's parameters are on it (`jaxlowfp.models.load(..., mesh=...)`,
    `jaxlowfp.sharding.shard_model`) and every batch's rows are split over its data axes when they divide
    ``batch_size`` (`jaxlowfp.sharding.put_batch`; else replicated).
    ``batch_scales``: what to do with quantized ops whose activation scale spans the batch (`batch_scaled_ops`,
    e.g. ``qat.nvfp4_w4a4()``'s current per-tensor scaling), which make a request's score depend on the requests
    batched with it and on the padding: "warn" (default: score the model as it is, with a warning naming them),
    "error" (refuse before anything runs) or "token" (score with those activations scaled per token, each row's
    own amax: a score is then the same alone and batched; the model itself is not changed).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
    if max_batch_tokens is not None and (isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int)
                                         or max_batch_tokens < 1):
        raise ValueError(f"max_batch_tokens must be a positive int or None; got {max_batch_tokens!r}")
    config = cast(Any, model).config  # any module with a config (module docstring); nnx.Module declares none
    vocab, max_len = config.vocab, config.max_seq_len
    for i, r in enumerate(requests):
        if not 1 <= r.n_pred < len(r.tokens):
            raise ValueError(f"a request needs 1 <= n_pred < len(tokens); got n_pred={r.n_pred}, "
                             f"len={len(r.tokens)}")
        if len(r.tokens) - 1 > max_len:
            raise ValueError(f"a request of {len(r.tokens) - 1} model inputs exceeds max_seq_len={max_len}")
        t = np.asarray(r.tokens)
        if not np.issubdtype(t.dtype, np.integer):
            raise TypeError(f"request {i}: tokens must be integer token ids; got dtype {t.dtype}")
        if t.min() < 0 or t.max() >= vocab:  # checked before any batch runs: a refusal scores nothing
            raise ValueError(f"token ids must be in [0, {vocab}) (model.config.vocab = {vocab}); request {i} has "
                             f"{t.min()}..{t.max()}")
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].tokens))
    sharding.check_on_mesh(nnx.state(model), mesh)
    forward = _Forward(model, per_request_model(model, batch_scales))
    out = np.zeros(len(requests), np.float64)
    is_greedy = np.zeros(len(requests), bool)
    n_in = sum(len(r.tokens) - 1 for r in requests)
    n_scored = sum(r.n_pred for r in requests)
    batches, start = [], 0
    while start < len(order):  # longest first: a batch's first request sets its padded length and its rows
        length = min(_bucket(len(requests[order[start]].tokens) - 1), max_len)
        rows = batch_size if max_batch_tokens is None else max(1, min(batch_size, max_batch_tokens // length))
        idx = order[start:start + rows]
        keep = _gather_len(max(requests[i].n_pred for i in idx), length) if forward.gather else length
        batches.append((idx, length, rows, keep))
        start += rows
    t0 = time.perf_counter()
    bar = progress_bar(total=n_in, desc=desc, unit="tok", enabled=progress)
    for idx, length, rows, keep in batches:
        inputs = np.zeros((rows, length), np.int32)
        targets = np.zeros((rows, length), np.int32)
        weights = np.zeros((rows, length), bool)
        # keep < length: the scored positions only, right-aligned as the rows' predictions are ([rows, keep])
        pos = np.zeros((rows, keep), np.int32) if keep < length else None
        for row, i in enumerate(idx):
            t = np.asarray(requests[i].tokens, np.int64)
            if t.min() < 0 or t.max() >= vocab:
                raise ValueError(f"token ids must be in [0, {vocab}); request {i} has {t.min()}..{t.max()}")
            n, p = len(t) - 1, requests[i].n_pred
            inputs[row, :n], targets[row, :n] = t[:-1], t[1:]
            weights[row, n - p: n] = True
            if pos is not None:
                pos[row, :p] = np.arange(n - p, n)
        if pos is not None:
            targets, weights = np.take_along_axis(targets, pos, 1), np.take_along_axis(weights, pos, 1)
            weights[:, :] &= np.arange(keep)[None, :] < np.array(
                [requests[i].n_pred for i in idx] + [0] * (rows - len(idx)))[:, None]
        arrays = (inputs, targets, weights) if pos is None else (inputs, targets, weights, pos)
        sums, top = forward(*(sharding.put_batch(a, mesh) for a in arrays))
        if idx is batches[0][0]:  # traced once: a layer reported quantized whose op never ran is named now
            check_executed(model)
        out[idx] = sharding.to_host(sums)[: len(idx)]
        is_greedy[idx] = sharding.to_host(top)[: len(idx)]
        if bar is not None:
            bar.update(sum(len(requests[i].tokens) - 1 for i in idx))
            bar.set_postfix_str(f"{bar.n / (time.perf_counter() - t0):.0f} tok/s")
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    stats = {"tokens": float(n_in), "scored": float(n_scored), "seconds": seconds,
             "tokens_per_s": n_in / seconds if seconds > 0 else math.nan}
    return (out, is_greedy, stats) if greedy else (out, stats)




@dataclasses.dataclass(frozen=True)
class TextScore:
    """Perplexities of one text (see the module docstring for the definitions)."""

    name: str
    docs: int
    tokens: int
    words: int
    bytes: int
    log_likelihood: float
    seconds: float
    tokens_per_s: float

    def _ppl(self, n: int) -> float:
        v = -self.log_likelihood / n
        return math.exp(v) if v < 700 else math.inf

    @property
    def token_perplexity(self) -> float:
        return self._ppl(self.tokens)

    @property
    def word_perplexity(self) -> float:
        return self._ppl(self.words)

    @property
    def byte_perplexity(self) -> float:
        return self._ppl(self.bytes)

    @property
    def bits_per_byte(self) -> float:
        return -self.log_likelihood / (self.bytes * math.log(2))


def _count_words(text: str) -> int:
    return len(re.split(r"\s+", text))  # lm-eval's word count (wikitext)


def budget_docs(tokenizer: Any, docs: Iterable[str], max_tokens: int | None = None) -> list[tuple[str, list[int]]]:
    """``(text, token ids)`` of the documents within ``max_tokens`` tokens: taken in order, documents without
    tokens skipped, the last one cut to fit (its text is then the decoded kept tokens)."""
    out = []
    n_tok, budget = 0, math.inf if max_tokens is None else max_tokens
    for doc in docs:
        if n_tok >= budget:
            break
        ids = tokenizer.encode(doc)
        if not ids:
            continue
        if n_tok + len(ids) > budget:
            ids = ids[: int(budget - n_tok)]
            doc = tokenizer.decode(ids)
        out.append((doc, ids))
        n_tok += len(ids)
    return out


def perplexity(model: nnx.Module, tokenizer: Any, docs: Iterable[str], *, name: str = "text",
               max_tokens: int | None = None, max_length: int = 512, stride: int | None = None,
               batch_size: int = 8, prefix_token: int | None = None, progress: bool = False,
               mesh: jax.sharding.Mesh | None = None, batch_scales: str = "warn") -> TextScore:
    """Rolling-window token, word and byte perplexity of documents (module docstring).

    ``max_tokens`` caps the tokens scored (`budget_docs`: documents in order, the last one cut to fit, its text then
    the decoded kept tokens, so words and bytes count exactly what was scored). ``stride`` defaults to
    ``max_length`` (lm-eval's disjoint windows). ``prefix_token`` defaults to the tokenizer's BOS id, else its EOS id.
    ``mesh``: a sharded model's mesh, ``batch_scales``: ops whose activation scale spans the batch (`score_requests`).
    """
    stride = max_length if stride is None else stride
    max_seq_len = cast(Any, model).config.max_seq_len  # nnx.Module declares no config (module docstring)
    if max_length > max_seq_len:
        raise ValueError(f"max_length={max_length} exceeds the model's max_seq_len={max_seq_len}")
    prefix = prefix_token if prefix_token is not None else (
        tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id)
    if prefix is None:
        raise ValueError("the tokenizer has neither a BOS nor an EOS token; pass prefix_token")
    requests: list[Request] = []
    n_docs = n_tok = n_words = n_bytes = 0
    for doc, ids in budget_docs(tokenizer, docs, max_tokens):
        requests += rolling_requests(ids, prefix_token=prefix, max_length=max_length, stride=stride)
        n_docs, n_tok = n_docs + 1, n_tok + len(ids)
        n_words += _count_words(doc)
        n_bytes += len(doc.encode("utf-8"))
    if not requests:
        raise ValueError(f"text {name!r} has no tokens to score")
    ll, stats = score_requests(model, requests, batch_size=batch_size, progress=progress, desc=name, mesh=mesh,
                               batch_scales=batch_scales)
    return TextScore(name, n_docs, n_tok, n_words, n_bytes, float(ll.sum()), stats["seconds"], stats["tokens_per_s"])


# ---------------------------------------------------------------------------------------------------------------
# multiple choice


@dataclasses.dataclass(frozen=True)
class ChoiceItem:
    """One multiple-choice item: the ``choices`` (continuations of ``context``) and the index of the right one."""

    context: str
    choices: tuple[str, ...]
    label: int

    def __post_init__(self) -> None:
        if not isinstance(self.context, str):
            raise TypeError(f"ChoiceItem.context must be a str; got {type(self.context).__name__}")
        object.__setattr__(self, "choices", tuple(self.choices))
        if len(self.choices) < 2 or not all(isinstance(c, str) and c for c in self.choices):
            raise ValueError(f"ChoiceItem.choices must be two or more non-empty strings; got {self.choices!r}")
        if isinstance(self.label, bool) or not isinstance(self.label, (int, np.integer)) \
                or not 0 <= self.label < len(self.choices):
            raise ValueError(f"ChoiceItem.label must be an index into the {len(self.choices)} choices; "
                             f"got {self.label!r}")


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's ``_encode_pair``: trailing whitespace of the context moves to the continuation; the continuation's
    tokens are those of ``context + continuation`` after the context's own tokens."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return ctx, whole[len(ctx):]


def pair_request(context: Sequence[int], continuation: Sequence[int], *, max_length: int) -> Request:
    """The `Request` scoring ``continuation`` after ``context`` (token ids). A sequence longer than ``max_length + 1``
    tokens keeps its end (lm-eval's left truncation of the context); a continuation longer than ``max_length``
    cannot be scored whole and is an error, as in lm-eval."""
    if not continuation:
        raise ValueError("the continuation has no tokens")
    if len(continuation) > max_length:
        raise ValueError(f"a continuation of {len(continuation)} tokens exceeds max_length={max_length}")
    if not context:
        raise ValueError("the context has no tokens; prepend a prefix (BOS or EOS) token, as lm-eval does")
    seq = (list(context) + list(continuation))[-(max_length + 1):]
    return Request(tuple(int(t) for t in seq), len(continuation))


def choice_requests(tokenizer: Any, items: Sequence[ChoiceItem], *, max_length: int) -> list[Request]:
    """One `Request` per (item, choice), items in order (`encode_pair`, then `pair_request`: a sequence longer
    than ``max_length + 1`` tokens keeps its end, lm-eval's left truncation)."""
    requests = []
    for i, item in enumerate(items):
        for j, cont in enumerate(item.choices):
            ctx, cont_ids = encode_pair(tokenizer, item.context, cont)
            try:
                requests.append(pair_request(ctx, cont_ids, max_length=max_length))
            except ValueError as e:
                raise ValueError(f"item {i} choice {j} ({cont!r}): {e}") from None
    return requests


def score_choices(model: nnx.Module, tokenizer: Any, items: Sequence[ChoiceItem], *, max_length: int = 512,
                  batch_size: int = 16, progress: bool = False, mesh: jax.sharding.Mesh | None = None,
                  batch_scales: str = "warn") -> dict[str, float]:
    """Multiple-choice accuracy: ``acc`` by total log-likelihood of the choice's tokens, ``acc_norm`` by
    log-likelihood per UTF-8 byte of the choice (lm-eval's length normalisation); ``items``, ``seconds`` and
    ``tokens_per_s`` too. Every item must have the same number of choices. ``mesh``: a sharded model's mesh;
    ``batch_scales``: ops whose activation scale spans the batch (`score_requests`)."""
    items = list(items)
    if not items:
        raise ValueError("score_choices needs at least one ChoiceItem")
    n_choices = {len(it.choices) for it in items}
    if len(n_choices) != 1:
        raise ValueError(f"every item must have the same number of choices; got {sorted(n_choices)}")
    requests = choice_requests(tokenizer, items, max_length=max_length)
    ll, stats = score_requests(model, requests, batch_size=batch_size, progress=progress, desc="choices", mesh=mesh,
                               batch_scales=batch_scales)
    ll = ll.reshape(len(items), n_choices.pop())
    nbytes = np.asarray([[len(c.encode("utf-8")) for c in it.choices] for it in items], np.float64)
    label = np.asarray([it.label for it in items])
    return {"acc": float(np.mean(np.argmax(ll, axis=1) == label)),
            "acc_norm": float(np.mean(np.argmax(ll / nbytes, axis=1) == label)),
            "items": float(len(items)), "seconds": stats["seconds"], "tokens_per_s": stats["tokens_per_s"]}


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
