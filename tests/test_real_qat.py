"""Continued pretraining of a real checkpoint (`train.real_qat`): on a tiny random-weight Llama written as a
Hugging Face directory and loaded by `jaxlowfp.models.load`, the token stream follows `BatchStream`'s order, remat
changes nothing but memory, `train_arm` hands the arm and the flags to `train.loop.train` (whose warmup, resume, mesh
and microbatch properties are proven on the tiny model in test_train_loop, test_train_checkpoint, test_multiprocess
and test_qat), and bad models or rules are clear errors; the command runs end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import child_cache_env
from test_models_hf import write_hf
from test_models_oracle import random_weights
from train.arms import RuleError, quantize_arm, train_arm
from train.config import TrainConfig, arm_specs
from train.data import BatchStream
from train.loop import init_state, jit_train_step, make_schedule
from jaxlowfp.models.llama import Llama, ModelConfig
from jaxlowfp.models import load
from train.real_qat import TokenStream, token_eval_batches, tokenize_domain

REPO = Path(__file__).resolve().parents[1]
# a Llama-family model with SmolLM2's features (tied embedding, grouped-query attention), 3 blocks (block 1 quantized)
TINY = dict(vocab=272, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96, tied=True,
            theta=10_000.0, eps=1e-5)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("real") / "tiny-llama"
    write_hf(d, random_weights(TINY, seed=0), TINY, shards=1)
    return d


def _ids(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


@pytest.mark.parametrize("vocab", [200, 49_152, 70_000])
def test_token_stream_draws_batch_stream_windows_of_token_ids(vocab):
    """The byte planes reassemble exactly the ids at the windows BatchStream picks (its starts, computed here)."""
    ids = _ids(5000, vocab)
    kw = dict(batch_size=4, seq_len=15, seed=3)
    stream, order = TokenStream(ids, **kw), BatchStream(np.zeros(len(ids), np.uint8), **kw)
    state = stream.init()
    for _ in range(2 * order.steps_per_epoch + 1):  # across an epoch boundary
        starts = order.global_starts(state)
        batch, state = stream.next(state)
        assert batch.dtype == np.int32
        np.testing.assert_array_equal(batch, ids[starts[:, None] + np.arange(16)])
    evals = token_eval_batches(ids, batch_size=4, seq_len=15, max_batches=3)
    assert len(evals) == 3 and {b.shape for b in evals} == {(4, 16)} and all(np.isin(b, ids).all() for b in evals)
    with pytest.raises(ValueError, match="token ids must be >= 0"):
        TokenStream(np.array([1, -1, 2]), **kw)


def test_tokenize_domain_ends_every_document_with_eos(tiny_dir):
    _, tok = load(tiny_dir)
    ids = tokenize_domain(np.frombuffer(b"def f():\n    return 1\n\0x = 2\n\0", np.uint8), tok)
    assert ids.dtype == np.int32 and (ids == tok.eos_id).sum() == 2 and ids[-1] == tok.eos_id
    assert tok.decode(ids[ids != tok.eos_id].tolist()) == "def f():\n    return 1\nx = 2\n"


def _qat_model(cfg: ModelConfig, arm_name: str = "paper") -> Llama:
    model = Llama(cfg, rngs=nnx.Rngs(0))
    arm = next(a for a in arm_specs(TrainConfig(preset="tiny")) if a.name == arm_name)
    quantize_arm(model, arm, keep_first=1, keep_last=1)
    return model


def _histories(qstate) -> list:
    from jaxlowfp.scaling import AmaxHistory

    out = [h for h in jax.tree.leaves(qstate, is_leaf=lambda x: isinstance(x, AmaxHistory))
           if isinstance(h, AmaxHistory)]
    assert out, "no amax history in the quantized model's state"
    return out


def test_remat_changes_nothing_but_memory():
    """``--remat`` (the loss rematerialised, saving only matmul outputs): the same losses, parameters and amax
    histories as without, through the warmup and the quantized steps, to float32 rounding.

    Not bitwise: the rematerialised backward recomputes the forward inside the backward program, where XLA fuses
    and orders the float32 reductions (RMSNorm means, softmax sums, the gradient sums) its own way, and XLA does
    not promise the same bits for two programs; measured on an AVX2-only CPU: 895 of 2048 weights one or two ulps
    apart (max 4.5e-8) after 3 SGD steps. Remat that changed the math (another residual, a missing stop-gradient,
    a quantizer recomputed with other scales) moves them by orders of magnitude more."""
    import optax

    from jaxlowfp.qat import Warmup
    from train.arms import loss_function

    cfg = ModelConfig(vocab=272, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64,
                      tie_embeddings=True, dtype="float32")  # 3 blocks: block 1 quantized (keep_first = keep_last = 1)
    batches = [jnp.asarray(_ids(8 * 17, 272, seed=s).reshape(8, 17)) for s in range(3)]
    tx = optax.sgd(0.1)
    runs = []
    for remat in (False, True):
        graphdef, state = init_state(_qat_model(cfg), tx)
        step = jit_train_step(graphdef, tx, loss_fn=loss_function(remat), schedule=make_schedule(0.1),
                              warmup=Warmup(steps=1), donate=False)
        losses = []
        for batch in batches:
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        runs.append((state, losses))
    np.testing.assert_allclose(runs[1][1], runs[0][1], rtol=1e-6)
    assert len(_histories(runs[1][0].qstate)) == 6  # block 1's three MLP projections: weight and activation each
    for a, b in zip(jax.tree.leaves((runs[0][0].params, runs[0][0].qstate)),
                    jax.tree.leaves((runs[1][0].params, runs[1][0].qstate))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)


def _arm(name: str, warmup: int) -> object:
    cfg = TrainConfig(model="x", warmup_steps=warmup)
    return next(a for a in arm_specs(cfg) if a.name == name)


def test_train_arm_is_the_training_loop_with_the_arms_warmup_and_the_configs_flags(monkeypatch, tmp_path):
    """`train_arm` runs `train.loop.train` with the arm's observe-only warmup (quantized arms only) and the config's
    resume, checkpoint interval, microbatches and remat, on the given mesh. What the loop does with them is proven
    once, on the tiny model: warmup = high precision bitwise (test_train_loop), resume bit-exact
    (test_train_checkpoint, test_multiprocess), a data x fsdp mesh (test_train_loop, test_multiprocess),
    microbatches = one big batch (test_qat), remat (above); the real model runs end to end below."""
    import inspect

    import train.arms as arms
    from jaxlowfp.qat import Warmup
    from train.loop import train

    calls = []

    def fake_train(model, stream, *, microbatches=1, **kw):
        calls.append(dict(kw, model=model, stream=stream, microbatches=microbatches))
        return "result"

    assert {"resume", "mesh", "warmup", "checkpoint_every", "loss_fn"} <= set(inspect.signature(train).parameters)
    monkeypatch.setattr(arms, "train", fake_train)
    cfg = TrainConfig(model="x", warmup_steps=2, resume=True, checkpoint_every=3, microbatches=2, remat=True,
                      progress=False)
    mesh = object()
    for name in ("paper", "naive", "hp"):
        arm = next(a for a in arm_specs(cfg) if a.name == name)
        assert train_arm("model", arm, "stream", cfg, steps=5, lr=1e-3, schedule="constant", out_dir=tmp_path / name,
                         mesh=mesh, stats="blocks/1/mlp/down_proj") == "result"
    paper, naive, hp = calls
    assert paper["warmup"] == Warmup(steps=2) and naive["warmup"] is None and hp["warmup"] is None
    for c in calls:
        assert (c["model"], c["stream"], c["steps"], c["mesh"], c["resume"], c["checkpoint_every"]) == (
            "model", "stream", 5, mesh, True, 3)
        assert c["microbatches"] == 2 and c["loss_fn"] is arms.loss_function(True)
        assert c["loss_fn"] is not arms.loss_function(False) and c["stats_layer"] == "blocks/1/mlp/down_proj"


def _main(argv, capsys) -> str:
    from train.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    return str(e.value.code) + capsys.readouterr().err


def test_a_bad_model_path_is_a_clear_error(tmp_path, capsys):
    msg = _main(["--model", str(tmp_path / "nope"), "--no-progress"], capsys)
    assert "neither a registered model" in msg and "nope" in msg
    (tmp_path / "x.gguf").write_bytes(b"not a gguf")
    assert "not a GGUF file" in _main(["--model", str(tmp_path / "x.gguf"), "--no-progress"], capsys)


def test_incompatible_rules_are_clear_errors(tiny_dir, tmp_path, capsys):
    msg = _main(["--model", str(tiny_dir), "--keep-first", "3", "--keep-last", "1", "--out", str(tmp_path),
                 "--no-progress"], capsys)
    assert "the quantization rules do not fit the model (3 blocks)" in msg and "leaves no block" in msg
    # NVFP4 blocks of 16 along a 40-wide input: the layer is named
    odd = dict(TINY, d_model=40, head_dim=10)
    write_hf(tmp_path / "odd", random_weights(odd), odd, shards=1)
    msg = _main(["--model", str(tmp_path / "odd"), "--format", "nvfp4", "--keep-first", "1", "--keep-last", "1",
                 "--out", str(tmp_path / "o"), "--no-progress"], capsys)
    assert "blocks/1/mlp/gate_proj" in msg and "in_features=40 is not a multiple of the block size 16" in msg
    model = Llama(ModelConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64),
                  rngs=nnx.Rngs(0))
    for block in model.blocks:  # a model whose MLP projections have other names (w1, w2, w3)
        for i, name in enumerate(("gate_proj", "up_proj", "down_proj")):
            setattr(block.mlp, f"w{i + 1}", getattr(block.mlp, name))
            delattr(block.mlp, name)
    with pytest.raises(RuleError, match="quantized no layer"):
        quantize_arm(model, _arm("paper", 0), keep_first=1, keep_last=1)


def test_python_m_train_model_runs_end_to_end(tiny_dir, tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "train", "--model", str(tiny_dir), "--steps", "2", "--warmup-steps", "1",
            "--batch-size", "2", "--seq-len", "16", "--eval-tokens", "64", "--eval-length", "32", "--mc-items", "4",
            "--max-bytes", "100000", "--keep-first", "1", "--keep-last", "1", "--out", str(out), "--no-progress"]
    # one persistent compilation cache for both runs: the --resume run's evaluation of the loaded model is the same
    # XLA programs as the first run's, and loads them instead of compiling again (a loaded executable is the same
    # compiled program, so the reused rows compared below are unchanged)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **child_cache_env(tmp_path / "xla-cache")}
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    for needle in ("Python ppl", "Shakespeare ppl", "prose ppl", "MC acc", "loss APE %", "pretrained (start)",
                   "high precision", "hif8 most_recent, no warmup", "hif8 max_window 64, warmup 1", "report:"):
        assert needle in p.stdout, p.stdout
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert len(rows) == 4 and all(np.isfinite(r["ppl_python"]) for r in rows)
    assert rows[2]["loss_ape"] > 0 and rows[2]["max_saturated_fraction"] is not None
    paper = [json.loads(line) for line in (out / "paper" / "metrics.jsonl").read_text().splitlines()]
    assert [r["observe_only"] for r in paper] == [True, False] and "amax_estimate" in paper[1]
    # --resume reuses the finished arms (a grid cut by a time limit goes on where it stopped)
    again = subprocess.run(argv + ["--resume"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stderr.count("finished earlier: reused") == 3
    assert json.loads((out / "results.json").read_text())["rows"][1:] == rows[1:]
