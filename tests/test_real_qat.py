"""Continued pretraining of a real checkpoint (`train.real_qat`): on a tiny random-weight Llama written as a
Hugging Face directory and loaded by `jaxlowfp.models.load`, gradient accumulation equals one big batch (parameters
and amax histories, merged by max), the warmup is bitwise high precision, resume is bit-exact, the token stream
follows `BatchStream`'s order, and bad models or rules are clear errors; the command runs end to end."""
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

from test_models_hf import write_hf
from test_models_oracle import random_weights
from train.arms import RuleError, quantize_arm, train_arm
from train.config import TrainConfig, arm_specs
from train.data import BatchStream
from train.loop import init_state, jit_train_step, make_schedule
from jaxlowfp.models.llama import Llama, ModelConfig, loss_fn
from jaxlowfp.models import load
from train.real_qat import TokenStream, token_eval_batches, tokenize_domain

REPO = Path(__file__).resolve().parents[1]
# a Llama-family model with SmolLM2's features (tied embedding, grouped-query attention), 4 blocks
TINY = dict(vocab=272, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96, tied=True,
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


def test_microbatches_give_the_parameters_and_amax_histories_of_one_big_batch():
    """k microbatches and one batch k times larger: the same parameters (float32 rounding) and the same amax
    histories. Step 1 is the observe-only warmup, so every later step quantizes with the same delayed estimate in
    both runs. The first step's recorded amaxes are the max over the microbatches, each run alone from the same state
    (not their sum, as Flax's fp8 ops did, nor the last one, as Levanter kept). SGD: Adam divides every coordinate
    by its own gradient's magnitude, so coordinates whose gradient is at rounding level (embedding rows of tokens no
    row contains) would get sign-like updates from float32 rounding noise alone."""
    import optax

    from jaxlowfp.qat import Warmup

    cfg = ModelConfig(vocab=272, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64,
                      tie_embeddings=True, dtype="float32")
    k, b, t = 4, 2, 16
    batches = [jnp.asarray(_ids(k * b * (t + 1), 272, seed=s).reshape(k * b, t + 1)) for s in range(4)]
    schedule = make_schedule(0.1)
    tx = optax.sgd(0.1)
    graphdef, init = init_state(_qat_model(cfg), tx)
    runs = {}
    for micro in (1, k):
        step = jit_train_step(graphdef, tx, loss_fn=loss_fn, schedule=schedule, warmup=Warmup(steps=1),
                              microbatches=micro, donate=False)
        state, hist = init, []
        for batch in batches:
            state, m = step(state, batch)
            assert bool(m["finite"])
            hist.append(_histories(state.qstate))
        runs[micro] = (state, hist)
    (big, big_hist), (small, small_hist) = runs[1], runs[k]
    for a, c in zip(jax.tree.leaves(big.params), jax.tree.leaves(small.params)):
        np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-6, atol=1e-6)
    for h_big, h_small in zip(big_hist, small_hist):
        for a, c in zip(h_big, h_small):
            np.testing.assert_allclose(np.asarray(c.history), np.asarray(a.history), rtol=1e-6)
            np.testing.assert_array_equal(np.asarray(c.count), np.asarray(a.count))

    one = jit_train_step(graphdef, tx, loss_fn=loss_fn, schedule=schedule, warmup=Warmup(steps=1), donate=False)
    alone = [_histories(one(init, batches[0][i * b:(i + 1) * b])[0].qstate) for i in range(k)]
    for j, merged in enumerate(small_hist[0]):
        amaxes = np.stack([np.asarray(h[j].history[0]) for h in alone])  # each microbatch's recorded amax
        assert merged.history.shape[0] > 1 and int(merged.count) == 1
        np.testing.assert_array_equal(np.asarray(merged.history[0]), amaxes.max())
        # the big batch's activations round differently (other matmul blocking): equal to float32 rounding
        np.testing.assert_allclose(np.asarray(big_hist[0][j].history[0]), amaxes.max(), rtol=1e-6)
        assert amaxes.max() < amaxes.sum() and (j > 0 or amaxes.max() != amaxes[-1] or len(set(amaxes)) == 1)


def test_remat_changes_nothing_but_memory():
    """``--remat`` (the loss rematerialised, saving only matmul outputs): the same losses, parameters and amax
    histories as without, bit for bit, through the warmup and the quantized steps."""
    import optax

    from jaxlowfp.qat import Warmup
    from train.arms import loss_function

    cfg = ModelConfig(vocab=272, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64,
                      tie_embeddings=True, dtype="float32")
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
    assert runs[0][1] == runs[1][1]
    for a, b in zip(jax.tree.leaves((runs[0][0].params, runs[0][0].qstate)),
                    jax.tree.leaves((runs[1][0].params, runs[1][0].qstate))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _arm(name: str, warmup: int) -> object:
    cfg = TrainConfig(model="x", warmup_steps=warmup)
    return next(a for a in arm_specs(cfg) if a.name == name)


def _run(tiny_dir, tmp_path, arm, steps, *, resume=False, out="run", mesh=None):
    model, tok = load(tiny_dir)
    cfg = TrainConfig(model=str(tiny_dir), steps=steps, batch_size=4, seq_len=16, keep_first=1, keep_last=1,
                      checkpoint_every=2, resume=resume, progress=False, warmup_steps=arm.warmup_steps)
    quantize_arm(model, arm, keep_first=1, keep_last=1)
    ids = _ids(20_000, 264)
    stream = TokenStream(ids, batch_size=4, seq_len=16, seed=1)
    res = train_arm(model, arm, stream, cfg, steps=steps, lr=1e-3, schedule="constant", out_dir=tmp_path / out,
                    mesh=mesh, stats=None)
    return model, res


def test_the_warmup_is_bitwise_the_high_precision_step_on_the_real_model(tiny_dir, tmp_path):
    """During the observe-only warmup the quantized model trains exactly like the high-precision one."""
    hp, _ = _run(tiny_dir, tmp_path, _arm("hp", 0), 2, out="hp")
    qat, res = _run(tiny_dir, tmp_path, _arm("paper", 2), 2, out="qat")
    assert [r["observe_only"] for r in res.rows] == [True, True]
    for a, b in zip(jax.tree.leaves(nnx.state(hp, nnx.Param)), jax.tree.leaves(nnx.state(qat, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    qat3, res3 = _run(tiny_dir, tmp_path, _arm("paper", 2), 3, out="qat3")  # then quantized: it differs
    hp3, _ = _run(tiny_dir, tmp_path, _arm("hp", 0), 3, out="hp3")
    assert [r["observe_only"] for r in res3.rows] == [True, True, False]
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree.leaves(nnx.state(hp3, nnx.Param)), jax.tree.leaves(nnx.state(qat3, nnx.Param))))


def test_resume_is_bit_exact_on_the_real_model(tiny_dir, tmp_path):
    """4 steps straight = 2 steps, then a fresh process-like restart resuming to 4 (params, amax histories, the
    data position and the losses)."""
    arm = _arm("paper", 1)
    straight, res = _run(tiny_dir, tmp_path, arm, 4, out="straight")
    _run(tiny_dir, tmp_path, arm, 2, out="split")
    resumed, res2 = _run(tiny_dir, tmp_path, arm, 4, resume=True, out="split")
    assert res2.resumed_from == 2
    assert [r["loss"] for r in res.rows[2:]] == [r["loss"] for r in res2.rows]
    for part in (nnx.Param, nnx.Variable):
        for a, b in zip(jax.tree.leaves(nnx.state(straight, part)), jax.tree.leaves(nnx.state(resumed, part))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_real_model_trains_on_a_data_x_fsdp_mesh(tiny_dir, tmp_path):
    """The same arm on a data=2 x fsdp=2 mesh (parameters sharded) and data parallel over 4 devices: the same
    losses up to float32 reduction order."""
    from train.mesh import make_mesh

    arm = _arm("paper", 1)
    _, flat = _run(tiny_dir, tmp_path, arm, 3, out="flat")
    model, sharded = _run(tiny_dir, tmp_path, arm, 3, out="fsdp", mesh=make_mesh("data=2,fsdp=2"))
    np.testing.assert_allclose([r["loss"] for r in sharded.rows], [r["loss"] for r in flat.rows], rtol=1e-5)
    specs = {tuple(x.sharding.spec) for x in jax.tree.leaves(sharded.state.params)}
    assert ("fsdp", None) in specs or (None, "fsdp") in specs


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
    assert "the quantization rules do not fit the model (4 blocks)" in msg and "leaves no block" in msg
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
    p = subprocess.run(argv, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                       timeout=900)
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
    again = subprocess.run(argv + ["--resume"], cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stderr.count("finished earlier: reused") == 3
    assert json.loads((out / "results.json").read_text())["rows"][1:] == rows[1:]
