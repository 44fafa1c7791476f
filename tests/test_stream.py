"""``python -m train stream`` (`train.stream_cli`): delayed scaling carried batch to batch through a real-architecture
model without training. On a tiny random-weight Llama loaded from a Hugging Face directory: every estimate follows its
algorithm's definition from the amaxes recorded before (numpy, written from the definitions), the per-channel clipped
counts add up to the library's saturation count, current scaling clips nothing, the model is left unchanged; the
command runs end to end and refuses bad options."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxlowfp.qnnx import iter_quant_linears
from test_models_hf import write_hf
from test_models_oracle import random_weights
from jaxlowfp.models import load
from train.stream_cli import main, outlier_channels, run_stream, stream_batches, summarize
from train.text_eval import load_texts

TINY = dict(vocab=272, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96, tied=True,
            theta=10_000.0, eps=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream") / "tiny-llama"
    write_hf(d, random_weights(TINY, seed=1), TINY, shards=1)
    model, tok = load(d)
    texts = {k: v[:3] for k, v in load_texts(("python", "shakespeare")).items()}
    batches = stream_batches(tok, texts, batch_size=2, seq_len=24, batches_per_text=4)
    return d, model, batches


@pytest.fixture(scope="module")
def streamed(tiny):
    """run_stream of the tiny model for an algorithm (history 3), computed once per module (one compilation each)."""
    _, model, batches = tiny
    cache = {}

    def get(algorithm):
        if algorithm not in cache:
            cache[algorithm] = run_stream(model, batches, algorithm, history_len=3, keep_first=1, keep_last=1)
        return cache[algorithm]

    return get


def _expected_estimates(amax: np.ndarray, algorithm: str, window: int, decay: float = 0.9) -> np.ndarray:
    """Batch t's estimate from the amaxes of batches 0..t-1 (batch 0: its own amax)."""
    est = np.empty_like(amax)
    ema = None
    for t, a in enumerate(amax):
        if algorithm == "current" or t == 0:
            est[t] = a
        elif algorithm == "most_recent":
            est[t] = amax[t - 1]
        elif algorithm == "max_window":
            est[t] = amax[max(0, t - window):t].max()
        else:
            est[t] = ema
        ema = a if t == 0 else decay * ema + (1 - decay) * a
    return est


def test_batches_interleave_the_texts(tiny):
    _, _, batches = tiny
    assert [name for name, _ in batches] == ["python", "shakespeare"] * 4
    assert {b.shape for _, b in batches} == {(2, 25)} and all(b.dtype == np.int32 for _, b in batches)


@pytest.mark.parametrize("algorithm", ["most_recent", "ema", "max_window", "current"])
def test_estimates_follow_the_algorithm_and_channel_counts_add_up(tiny, streamed, algorithm):
    _, model, batches = tiny
    before = jax.tree.map(np.asarray, nnx.state(model))
    r = streamed(algorithm)
    assert sorted(r.layers) == [f"blocks/{i}/mlp/{p}" for i in (1, 2) for p in ("down_proj", "gate_proj", "up_proj")]
    for j in range(len(r.layers)):
        np.testing.assert_allclose(r.estimate[j], _expected_estimates(r.amax[j], algorithm, 3), rtol=1e-6)
    clipped = r.saturated > 0
    if algorithm == "current":
        assert not clipped.any()
    else:
        assert not clipped[:, 0].any()  # the first batch scales by its own amax
        np.testing.assert_array_equal(clipped, r.amax > r.estimate)  # clipping is exactly amax above the estimate
        assert clipped.any(), "the stream should move the amax"
    # per-channel counts over the stream = the library's saturated fractions times the elements of each batch
    elements = np.array([2 * 24 * c.size for c in r.clipped])
    np.testing.assert_allclose([c.sum() for c in r.clipped], (r.saturated.sum(axis=1) * elements), rtol=1e-6)
    after = jax.tree.map(np.asarray, nnx.state(model))
    assert not list(iter_quant_linears(model))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)


def test_high_precision_reference_and_summary(tiny, streamed):
    _, model, batches = tiny
    from jaxlowfp.models.llama import token_log_likelihood
    import jax.numpy as jnp

    ref = run_stream(model, batches, None)
    direct = sum(float(np.sum(np.asarray(token_log_likelihood(model, jnp.asarray(b)), np.float64)))
                 for _, b in batches)
    assert ref.log_likelihood.sum() == pytest.approx(direct, rel=1e-6) and ref.layers == []
    r = streamed("most_recent")
    rows = summarize([ref, r], ref)
    assert rows[0]["ppl_change"] is None and rows[1]["ppl_change"] == pytest.approx(
        100 * (r.perplexity / ref.perplexity - 1))
    assert rows[1]["layers"] == 6 and 0 < rows[1]["layers_clipping"] <= 6
    assert set(rows[1]) >= {"ppl_python", "ppl_shakespeare", "mean_clipped", "max_clipped", "max_at"}
    ch = outlier_channels(r, top_layers=2, top_channels=2)
    assert ch and all(0 < c["share"] <= 1 and c["clipped"] > 0 for c in ch)
    j = r.layers.index(ch[0]["layer"])
    assert r.clipped[j][ch[0]["channel"]] == r.clipped[j].max()


def test_the_command_runs_and_refuses_bad_options(tiny, tmp_path, capsys):
    d, _, _ = tiny
    out = tmp_path / "s"
    # the batch shape and history length of the fixtures: the command's high-precision and most_recent passes are
    # the programs the tests above compiled (jit cache hits), so this test costs no compilation
    assert main(["--model", str(d), "--keep-first", "1", "--keep-last", "1", "--batches", "2", "--batch-size", "2",
                 "--seq-len", "24", "--history-len", "3", "--texts", "python,prose", "--algorithms", "most_recent",
                 "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "high precision" in text and "most_recent" in text and "mean clipped" in text
    assert (out / "report.md").is_file() and json.loads((out / "results.json").read_text())["rows"]
    for argv, needle in [(["--algorithms", "max"], "--algorithms: unknown ['max']"),
                         (["--texts", "poetry"], "--texts: unknown ['poetry']"),
                         (["--batches", "0"], "must be a positive int")]:
        with pytest.raises(SystemExit) as e:
            main(["--model", str(d), *argv])
        assert e.value.code == 2 and needle in capsys.readouterr().err
    with pytest.raises(SystemExit, match="leaves none of the 4 blocks"):
        main(["--model", str(d), "--keep-first", "2", "--keep-last", "2"])
    with pytest.raises(SystemExit, match="neither a registered model"):
        main(["--model", str(tmp_path / "nothing")])
