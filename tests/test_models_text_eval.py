"""jaxlowfp.evaluation, train.text_eval and the eval/generate commands: lm-eval's rolling windows, log-likelihoods
against the numpy oracle, word/byte/token perplexity bookkeeping, the token-level multiple-choice task, the prose
text."""
from __future__ import annotations

import io
import math
import re
import tarfile

import numpy as np
import pytest

from test_models_gguf import write_gguf
from test_models_oracle import forward, log_softmax, random_weights, read_gguf
from train import eval_cli
from train import text_eval as te
from jaxlowfp import evaluation as ev
from train.data import DataError
from train.evaluate import ChoiceTask
from jaxlowfp.models import load

CFG = dict(vocab=272, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96, tied=False,
           theta=10_000.0, eps=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "tiny.gguf"
    write_gguf(path, random_weights(CFG, seed=7))
    model, tok = load(path)
    w, cfg, layout = read_gguf(path)
    return path, model, tok, lambda ids: log_softmax(forward(w, cfg, ids, layout))


def lm_eval_windows(token_list, prefix_token, max_seq_len, context_len):
    """lm-eval's ``utils.get_rolling_token_windows`` (lm-evaluation-harness, lm_eval/utils.py), transcribed."""
    assert 1 <= context_len <= max_seq_len
    if not token_list:
        return
    pred_len = max_seq_len - context_len + 1
    predicted = 0
    first_seq_len = min(max_seq_len, len(token_list))
    yield [prefix_token] + token_list[: first_seq_len - 1], token_list[:first_seq_len]
    predicted += first_seq_len
    while predicted < len(token_list):
        window_pred_len = min(len(token_list) - predicted, pred_len)
        window_end = predicted + window_pred_len
        yield token_list[window_end - max_seq_len - 1: window_end - 1], token_list[window_end - window_pred_len:
                                                                                  window_end]
        predicted += window_pred_len


@pytest.mark.parametrize("n,length,stride", [(1, 8, 8), (8, 8, 8), (9, 8, 8), (50, 8, 8), (50, 8, 3), (50, 8, 1),
                                             (23, 16, 5)])
def test_rolling_windows_are_lm_evals(n, length, stride):
    toks = list(range(100, 100 + n))
    ours = ev.rolling_requests(toks, prefix_token=7, max_length=length, stride=stride)
    ref = list(lm_eval_windows(toks, 7, length, length - stride + 1))
    assert len(ours) == len(ref)
    for r, (context, pred) in zip(ours, ref):
        # a request is context + the last prediction; it predicts its last n_pred tokens
        assert list(r.tokens[:-1]) == context and list(r.tokens[-r.n_pred:]) == pred
        assert len(r.tokens) - 1 <= length
    assert [t for r in ours for t in r.tokens[-r.n_pred:]] == toks  # every token scored once, in order


def test_score_requests_matches_the_oracle(tiny):
    _, model, _, oracle = tiny
    rng = np.random.default_rng(0)
    reqs = [ev.Request(tuple(rng.integers(0, 272, n).tolist()), k) for n, k in
            [(5, 4), (17, 3), (60, 60 - 1), (2, 1), (33, 10)]]
    ll, stats = ev.score_requests(model, reqs, batch_size=2, progress=False)
    for r, got in zip(reqs, ll):
        lp = oracle(np.asarray(r.tokens[:-1]))
        want = sum(lp[t - 1, r.tokens[t]] for t in range(len(r.tokens) - r.n_pred, len(r.tokens)))
        assert got == pytest.approx(want, abs=2e-4)
    assert stats["tokens"] == 4 + 16 + 59 + 1 + 32 and stats["scored"] == 4 + 3 + 59 + 1 + 10
    with pytest.raises(ValueError, match="a request of 65 model inputs exceeds max_seq_len=64"):
        ev.score_requests(model, [ev.Request(tuple(range(66)), 3)], progress=False)


def test_perplexity_bookkeeping(tiny):
    _, model, tok, oracle = tiny
    docs = ["the thin cat sat on the mat.\n  And then   it ran away!", "in a hat"]
    s = ev.perplexity(model, tok, docs, name="t", max_length=16, stride=6, batch_size=4, progress=False)
    ids = [tok.encode(d) for d in docs]
    # brute force with the oracle: token i of a doc is predicted from the window the rolling rule gives it
    want = 0.0
    for doc in ids:
        for r in ev.rolling_requests(doc, prefix_token=1, max_length=16, stride=6):
            lp = oracle(np.asarray(r.tokens[:-1]))
            want += sum(lp[t - 1, r.tokens[t]] for t in range(len(r.tokens) - r.n_pred, len(r.tokens)))
    assert s.log_likelihood == pytest.approx(want, abs=1e-3)
    assert (s.docs, s.tokens) == (2, sum(map(len, ids)))
    assert s.words == sum(len(re.split(r"\s+", d)) for d in docs)
    assert s.bytes == sum(len(d.encode()) for d in docs)
    assert s.token_perplexity == pytest.approx(math.exp(-want / s.tokens), rel=1e-5)
    assert s.word_perplexity == pytest.approx(math.exp(-want / s.words), rel=1e-5)
    assert s.bits_per_byte == pytest.approx(-want / s.bytes / math.log(2), rel=1e-5)
    cut = ev.perplexity(model, tok, docs, max_tokens=10, max_length=16, progress=False)
    assert (cut.docs, cut.tokens) == (1, 10) and cut.bytes == len(tok.decode(ids[0][:10]).encode())
    with pytest.raises(ValueError, match="max_length=128 exceeds the model's max_seq_len=64"):
        ev.perplexity(model, tok, docs, max_length=128)


def test_multiple_choice_tokenization_is_lm_evals(tiny):
    _, model, tok, oracle = tiny
    ctx, cont = ev.encode_pair(tok, "I saw the ", "thin cat")
    assert ctx == tok.encode("I saw the") and tok.decode(cont) == " thin cat"  # the space moved
    assert tok.decode(ctx + cont) == "I saw the thin cat"
    text = np.frombuffer(b"once upon a time there ", np.uint8)
    task = ChoiceTask(context=text[None].astype(np.int32),
                      choices=np.zeros((1, 2, 8), np.int32) + np.frombuffer(b"was a he", np.uint8),
                      lengths=np.array([[8, 5]], np.int32), label=np.array([1], np.int32))
    reqs = ev.choice_requests(tok, te.choice_items(task), max_length=16)
    lengths = task.lengths
    assert [tok.decode(r.tokens[-r.n_pred:]) for r in reqs] == [" was a he", " was a"]
    assert all(len(r.tokens) <= 17 for r in reqs)
    res = te.score_choices_tokens(model, tok, task, max_length=16, progress=False)
    ll = [sum(oracle(np.asarray(r.tokens[:-1]))[t - 1, r.tokens[t]] for t in range(len(r.tokens) - r.n_pred,
                                                                                    len(r.tokens))) for r in reqs]
    assert res["acc"] == float(np.argmax(ll) == 1)
    assert res["acc_norm"] == float(np.argmax(np.asarray(ll) / lengths[0]) == 1)


def test_prose_text_from_the_brotli_archive(tmp_path):
    with pytest.raises(DataError, match=r"needs .*brotli-1\.2\.1\.tar\.gz .* `python -m pip download --no-deps "
                                        r"--no-binary :all: \"brotli==1\.2\.1\" -d \.venv/share/prose`"):
        te.prose_text(tmp_path / "brotli-1.2.1.tar.gz")
    archive = tmp_path / "brotli-1.2.1.tar.gz"
    body = b"Alice was beginning\r\nto get very tired.\r\n"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo(te.PROSE_MEMBER)
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    assert te.prose_text(archive) == "Alice was beginning\nto get very tired.\n"
    assert te.load_texts(["prose"], prose_archive=archive)["prose"] == ["to get very tired.\n"]  # last 10 %
    with pytest.raises(ValueError, match="unknown text 'poetry'"):
        te.load_texts(["poetry"])


def test_eval_and_generate_commands(tiny, tmp_path, capsys):
    path = tiny[0]
    out = tmp_path / "report"
    rc = eval_cli.main(["--model", str(path), "--texts", "python", "--max-tokens", "40", "--max-length", "32",
                        "--mc-items", "4", "--no-progress", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "word ppl" in printed and "python" in printed and "multiple choice" in printed
    report = (out / "report.md").read_text()
    assert "| text | docs | tokens | words | bytes | word ppl | byte ppl | bits/byte | token ppl | tok/s |" in report
    assert "| python |" in report
    rc = eval_cli.main_generate(["--model", str(path), "--prompt", "the cat", "--max-new-tokens", "3"])
    assert rc == 0 and capsys.readouterr().out.startswith("the cat")
    with pytest.raises(SystemExit) as e:
        eval_cli.parse_eval_args(["--texts", "poetry"])
    assert e.value.code == 2
    with pytest.raises(SystemExit, match=r"error: .*'nope' is neither a registered model"):
        eval_cli.main(["--model", "nope", "--no-progress"])


def test_main_dispatches_the_subcommands():
    from train.__main__ import SUBCOMMANDS

    import importlib

    assert importlib.import_module(SUBCOMMANDS["eval"], "train").main is eval_cli.main
    assert importlib.import_module(SUBCOMMANDS["generate"], "train").main is eval_cli.main_generate
