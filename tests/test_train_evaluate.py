"""train.evaluate: validation loss, the multiple-choice task and its scoring, loss APE (hand-checked)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train.data import load_domain
from train.evaluate import (
    _masked_ll_sum,
    build_choice_task,
    choice_log_likelihoods,
    loss_ape,
    score_choices,
    validation_loss,
)
from jaxlowfp.models.llama import Llama, preset

CTX, CONT = 48, 24


@pytest.fixture(scope="module")
def val_text():
    return load_domain("shakespeare").val[:60_000]


@pytest.fixture(scope="module")
def llama():
    return Llama(preset("tiny", n_layers=2, max_seq_len=128), rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def task(val_text):
    return build_choice_task(val_text, n_items=48, context_len=CTX, continuation_len=CONT, seed=0)


class Uniform(nnx.Module):
    """Every byte equally likely; counts its calls in a Variable (evaluation must not write it back)."""

    def __init__(self):
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, tokens):
        self.calls[...] = self.calls[...] + 1
        zero = jnp.minimum(tokens, 0).astype(jnp.float32)[..., None]  # 0, but XLA cannot constant-fold it (slow)
        return jnp.broadcast_to(zero, tokens.shape + (256,))


class NGramOracle(nnx.Module):
    """A model that memorised a text: after 16 bytes seen in it, predicts the byte that followed them there
    (hashed table; a context followed by different bytes in the text predicts nothing)."""

    P = 1_048_573  # prime; h * 256 + 255 stays below 2**31
    N = 16

    def __init__(self, text: np.ndarray):
        t = text.astype(np.int64)
        h = np.zeros(len(t), np.int64)
        for s in range(self.N - 1, -1, -1):  # hash of bytes [i-15, i], zeros before the start
            h = (h * 256 + np.concatenate([np.zeros(s, np.int64), t[: len(t) - s]])) % self.P
        table = np.full(self.P, -1, np.int32)
        table[h[:-1]] = t[1:]
        table[h[:-1][table[h[:-1]] != t[1:]]] = -1  # ambiguous contexts
        self.table = nnx.Variable(jnp.asarray(table))

    def __call__(self, tokens):
        h = jnp.zeros(tokens.shape, jnp.int32)
        for s in range(self.N - 1, -1, -1):
            shifted = jnp.pad(tokens, ((0, 0), (s, 0)))[:, : tokens.shape[1]]
            h = (h * 256 + shifted) % self.P
        nxt = self.table[...][h]
        return jnp.where((nxt >= 0)[..., None], 10.0 * jax.nn.one_hot(nxt, 256, dtype=jnp.float32), 0.0)


def test_loss_ape_by_hand():
    # |1.1-1|/1 = 10 %, |0.9-1|/1 = 10 %, |2-2|/2 = 0 %  ->  mean 6.666... %
    assert loss_ape([1.1, 0.9, 2.0], [1.0, 1.0, 2.0]) == pytest.approx(20 / 3, rel=1e-12)
    assert loss_ape(np.array([3.0, 3.0], np.float32), np.array([2.0, 4.0], np.float32)) == pytest.approx(37.5)
    assert loss_ape([2.5], [2.5]) == 0.0
    with pytest.raises(ValueError, match="aligned"):
        loss_ape([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match=r"1 non-finite step\(s\); pass nonfinite='skip'"):
        loss_ape([float("nan"), 1.0], [1.0, 1.0])
    assert loss_ape([float("nan"), 1.5, 2.0], [1.0, 1.0, float("inf")], nonfinite="skip") == pytest.approx(50.0)
    with pytest.raises(ValueError, match="no step where both"):
        loss_ape([float("nan")], [1.0], nonfinite="skip")
    with pytest.raises(ValueError, match="nonfinite='drop' is not supported"):
        loss_ape([1.0], [1.0], nonfinite="drop")
    with pytest.raises(ValueError, match="baseline loss is 0"):
        loss_ape([1.0], [0.0])


def test_validation_loss_of_uniform_model_is_log256_and_state_is_untouched(val_text):
    model = Uniform()
    out = validation_loss(model, val_text, batch_size=4, seq_len=32, max_batches=3)
    assert out["loss"] == pytest.approx(math.log(256), rel=1e-6) and out["ppl"] == pytest.approx(256, rel=1e-5)
    assert int(model.calls[...]) == 0


def test_validation_loss_matches_float64_reference(val_text, llama):
    model = llama
    out = validation_loss(model, val_text, batch_size=4, seq_len=32, max_batches=2)
    # reference: the windows picked by hand (2*4 of n evenly spread), float64 log-softmax of the model's logits
    n = len(val_text) // 33
    idx = np.arange(8) * n // 8
    win = np.stack([val_text[i * 33 : i * 33 + 33] for i in idx]).astype(np.int32)
    logits = np.asarray(model(jnp.asarray(win[:, :-1])), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    ref = -np.take_along_axis(logp, win[:, 1:, None], -1).mean()
    assert out["loss"] == pytest.approx(ref, rel=1e-5)
    assert out["ppl"] == pytest.approx(math.exp(ref), rel=1e-4)
    traces = _masked_ll_sum._cache_size()
    same = Llama(preset("tiny", n_layers=2, max_seq_len=128), rngs=nnx.Rngs(9))  # same config, other weights
    validation_loss(same, val_text, batch_size=4, seq_len=32, max_batches=2)
    assert _masked_ll_sum._cache_size() == traces  # static graphdef: no retrace


def test_choice_task_items_come_from_the_text(task, val_text):
    raw = val_text.tobytes()
    n = len(task.label)
    assert task.context.shape == (n, CTX) and task.choices.shape == (n, 4, CONT) and task.lengths.shape == (n, 4)
    assert task.label.min() >= 0 and task.label.max() <= 3 and len(set(task.label.tolist())) == 4
    assert task.lengths.min() >= CONT // 2 and task.lengths.max() <= CONT
    for i in range(n):
        ctx = bytes(task.context[i].astype(np.uint8))
        texts = [bytes(task.choices[i, c, : task.lengths[i, c]].astype(np.uint8)) for c in range(4)]
        assert (ctx + texts[task.label[i]]) in raw  # the true continuation follows its context
        assert len(set(texts)) == 4 and b"\x00" not in ctx + b"".join(texts)
        assert ctx[-1:].isspace() and all(not t[:1].isspace() for t in texts)  # items split at word starts
        assert not task.choices[i][np.arange(CONT)[None, :] >= task.lengths[i][:, None]].any()  # zero padding
        for t in texts:  # every choice is a piece of the text ending at the end of a word
            at = raw.find(t)
            assert at >= 0 and (len(t) == CONT or raw[at + len(t) : at + len(t) + 1].isspace())
    again = build_choice_task(val_text, n_items=48, context_len=CTX, continuation_len=CONT, seed=0)
    other = build_choice_task(val_text, n_items=48, context_len=CTX, continuation_len=CONT, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(task, again))
    assert not np.array_equal(task.context, other.context)


def test_choice_log_likelihoods_match_unpadded_float64_reference(task, llama):
    model = llama
    ll = choice_log_likelihoods(model, task, batch_size=32)
    assert ll.shape == (48, 4) and ll.dtype == np.float32
    for i, c in [(5, 3), (47, 1)]:
        seq = np.concatenate([task.context[i], task.choices[i, c, : task.lengths[i, c]]])
        logits = np.asarray(model(jnp.asarray(seq[None, :-1], jnp.int32))[0], np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        m = task.lengths[i, c]
        ref = logp[np.arange(CTX - 1, CTX - 1 + m), seq[CTX:]].sum()
        assert ll[i, c] == pytest.approx(ref, rel=1e-5)
    res = score_choices(model, task, batch_size=32)
    assert 0.0 <= res["acc"] <= 0.5 and 0.0 <= res["acc_norm"] <= 0.5  # an untrained model is near chance


def test_uniform_model_scores_by_length_only(task):
    ll = choice_log_likelihoods(Uniform(), task, batch_size=32)
    np.testing.assert_allclose(ll, -task.lengths * math.log(256), rtol=1e-5)
    # the sum of log-likelihoods prefers the shortest choice (first one on ties)
    assert score_choices(Uniform(), task)["acc"] == pytest.approx(np.mean(task.lengths.argmin(1) == task.label))


def test_memorising_model_beats_chance(task, val_text):
    res = score_choices(NGramOracle(val_text), task, batch_size=64)
    assert res["acc"] >= 0.95 and res["acc_norm"] >= 0.95


def test_choice_task_rejects_bad_arguments(val_text):
    with pytest.raises(ValueError, match="too few for n_items=5"):
        build_choice_task(val_text[:100], n_items=5, context_len=CTX, continuation_len=CONT, seed=0)
    with pytest.raises(ValueError, match="n_items must be a positive int"):
        build_choice_task(val_text, n_items=0, context_len=CTX, continuation_len=CONT, seed=0)
    with pytest.raises(TypeError, match="1-D uint8"):
        build_choice_task(val_text.astype(np.int32), n_items=4, context_len=CTX, continuation_len=CONT, seed=0)
