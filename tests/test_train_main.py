"""`python -m train`: flags and presets are validated with clear messages; a tiny run goes end to end."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import child_cache_env
from train.config import TrainConfig, arm_specs, parse_args, pretrain_key
from train.mesh import make_mesh, param_spec, parse_mesh

REPO = Path(__file__).resolve().parents[1]


def _exit_message(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--preset", "huge"], "preset='huge' is not supported; allowed: 'tiny', 'small', 'base'"),
        (["--format", "fp7"], "invalid choice: 'fp7' (choose from 'hif8', 'nvfp4', 'none')"),
        (["--algorithm", "mean"], "invalid choice: 'mean' (choose from 'max_window', 'most_recent', 'max', 'ema')"),
        (["--arms", "hp,best"], "invalid arm(s) 'best'; allowed: hp, naive, paper"),
        (["--steps", "0"], "steps must be a positive int; got 0"),
        (["--warmup-steps", "-1"], "warmup_steps must be an int >= 0; got -1"),
        (["--lr", "3"], "lr must be a float in (0, 1); got 3.0"),
        (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
        (["--mesh", "data=2,model=2"], "axes from data, fsdp"),
        (["--mesh", "data=0"], "needs a positive int size"),
        (["--format", "none"], "format='none' runs only the 'hp' arm"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--preset", "tiny", "--seq-len", "65"], "seq_len=65 exceeds the max_seq_len 64 of preset 'tiny'"),
    ],
)
def test_bad_flags_exit_2_with_the_allowed_values(argv, needle, capsys):
    assert needle in _exit_message(argv, capsys)


def test_defaults_and_flags():
    cfg = parse_args([])
    assert (cfg.preset, cfg.format, cfg.algorithm, cfg.history_len, cfg.arms) == (
        "small", "hif8", "max_window", 64, ("hp", "naive", "paper"))
    cfg = parse_args(["--preset", "tiny", "--steps", "7", "--lr", "1e-5", "--warmup-steps", "3", "--resume",
                      "--out", "x", "--mesh", "data=2,fsdp=2", "--pretrain-steps", "0", "--arms", "hp,paper"])
    assert (cfg.preset, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.resume, cfg.run_dir, cfg.mesh, cfg.arms) == (
        "tiny", 7, 1e-5, 3, True, "x", "data=2,fsdp=2", ("hp", "paper"))
    assert parse_args(["--format", "none", "--arms", "hp"]).format == "none"


def test_config_is_frozen_hashable_and_validated():
    cfg = TrainConfig(preset="tiny")
    hash(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        TrainConfig("tiny")  # type: ignore[misc]  # keyword-only
    with pytest.raises(ValueError, match=r"arms must not repeat"):
        TrainConfig(arms=("hp", "hp"))


def test_arms_share_the_format_and_differ_in_scaling():
    hp, naive, paper = arm_specs(TrainConfig(warmup_steps=9))
    assert hp.format == "none"
    assert (naive.format, naive.algorithm, naive.warmup_steps) == ("hif8", "most_recent", 0)
    assert (paper.format, paper.algorithm, paper.history_len, paper.warmup_steps) == ("hif8", "max_window", 64, 9)


def test_pretrain_cache_key_depends_only_on_pretraining():
    base = TrainConfig()
    assert pretrain_key(base) == pretrain_key(dataclasses.replace(base, steps=3, lr=1e-5, algorithm="max"))
    assert pretrain_key(base) != pretrain_key(dataclasses.replace(base, pretrain_steps=301))
    assert pretrain_key(base) != pretrain_key(TrainConfig(preset="tiny"))
    assert pretrain_key(base) != pretrain_key(dataclasses.replace(base, seq_len=64))
    assert pretrain_key(base, "corpus-1") != pretrain_key(base, "corpus-2")


def test_mesh_parsing_and_param_specs():
    assert parse_mesh("fsdp=4") == {"data": 1, "fsdp": 4}
    assert parse_mesh("data=2, fsdp=2") == {"data": 2, "fsdp": 2}
    with pytest.raises(ValueError, match="at most once"):
        parse_mesh("data=2,data=2")
    mesh = make_mesh("data=2,fsdp=2")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2}
    assert dict(make_mesh(None).shape) == {"data": 4, "fsdp": 1}  # conftest: 4 CPU devices
    with pytest.raises(ValueError, match="needs data\\*fsdp = 8 devices; 4 are available"):
        make_mesh("data=4,fsdp=2")
    assert tuple(param_spec((256, 64), 2)) == ("fsdp", None)
    assert tuple(param_spec((64, 256), 2)) == (None, "fsdp")
    assert tuple(param_spec((255, 63), 2)) == ()  # indivisible: replicated
    assert tuple(param_spec((64,), 2)) == ()  # small: replicated


def test_python_m_train_runs_end_to_end_and_the_paper_grid_reuses_the_pretrained_model(tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "train", "--preset", "tiny", "--steps", "4", "--pretrain-steps", "4",
            "--seq-len", "32", "--batch-size", "8", "--max-bytes", "200000", "--eval-batches", "2", "--mc-items", "8",
            "--warmup-steps", "2", "--checkpoint-every", "2", "--out", str(run_dir), "--cache-dir", str(tmp_path),
            "--no-progress"]
    # one persistent compilation cache for both runs: the grid run's high-precision and most_recent arms and every
    # evaluation are the same XLA programs as the first run's, and load instead of compiling again
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **child_cache_env(tmp_path / "xla-cache")}
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    for needle in ("B val loss", "A val loss", "MC acc_norm", "loss APE %", "max sat", "pretrained (start)",
                   "high precision", "hif8 most_recent, no warmup", "hif8 max_window 64, warmup 2", "report:"):
        assert needle in p.stdout, p.stdout
    rows = json.loads((run_dir / "results.json").read_text())["rows"]
    assert [r["arm"] for r in rows][1:] == ["high precision", "hif8 most_recent, no warmup",
                                            "hif8 max_window 64, warmup 2"]
    for r in rows:
        assert all(np.isfinite(r[k]) for k in ("val_loss_a", "val_loss_b", "acc", "acc_norm"))
    assert rows[1]["loss_ape"] is None and rows[2]["loss_ape"] > 0 and rows[3]["loss_ape"] >= 0
    assert rows[1]["max_saturated_fraction"] is None and rows[2]["max_saturated_fraction"] is not None
    report = (run_dir / "report.md").read_text()
    for png in ("loss_curves.png", "saturation.png", "amax.png"):
        assert f"]({png})" in report and (run_dir / png).stat().st_size > 1000
    paper = [json.loads(line) for line in (run_dir / "paper" / "metrics.jsonl").read_text().splitlines()]
    assert [r["observe_only"] for r in paper] == [True, True, False, False]
    assert {"step", "loss", "lr", "tokens_per_s", "max_saturated_fraction", "mean_saturated_fraction", "amax",
            "amax_estimate", "skipped", "observe_only"} <= set(paper[0])
    assert len(list(tmp_path.glob("pretrained-*/done.json"))) == 1


    # the paper's grid (--grid paper) from the same pretraining cache: the pretrained model is reused, and every
    # quantized arm's loss APE is against the high-precision arm at its own learning rate
    grid = tmp_path / "grid"
    base = [a for a in argv if a not in ("--out", str(run_dir))]
    again = subprocess.run(base + ["--grid", "paper", "--steps", "3", "--warmup-steps", "1", "--arms",
                                   "hp_high,most_recent_high,current_low_warmup", "--out", str(grid)],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "pretrained model reused" in again.stderr and "pretraining: reused from cache" in again.stdout
    assert "LR" in again.stdout and "hif8 current scaling, lr 3e-5, warmup 1" in again.stdout, again.stdout
    rows = json.loads((grid / "results.json").read_text())["rows"]
    assert rows[0].get("lr") is None and [r["lr"] for r in rows[1:]] == pytest.approx([3e-4, 3e-4, 3e-5])
    assert rows[2]["loss_ape"] > 0 and rows[2]["max_saturated_fraction"] > 0
    assert rows[3]["loss_ape"] is None  # its baseline, hp_low, did not run
    assert rows[3]["max_saturated_fraction"] == 0.0  # current scaling clips nothing
    report = (grid / "report.md").read_text()
    assert "## Loss vs evaluation" in report and "`hp_high`" in report and "A val loss rise" in report


@pytest.mark.parametrize("fmt, recipe", [("hif8", "hif8_w8a8"), ("nvfp4", "nvfp4_w4a4_mae")])
def test_quantized_arms_use_the_paper_selection(fmt, recipe):
    """The quantized arms replace exactly the MLP projections of the middle blocks (tiny: blocks 1 and 2)."""
    from flax import nnx

    from jaxlowfp.qnnx import iter_quant_linears, paper_rules, quantize_model
    from train.__main__ import make_recipe
    from jaxlowfp.models.llama import PRESETS, Llama

    cfg = TrainConfig(preset="tiny", format=fmt)
    for arm in arm_specs(cfg)[1:]:
        model = Llama(PRESETS["tiny"], rngs=nnx.Rngs(0))
        quantize_model(model, paper_rules(4, keep_first=cfg.keep_first, keep_last=cfg.keep_last,
                                          recipe=make_recipe(arm)))
        layers = dict(iter_quant_linears(model))
        assert sorted(layers) == [f"blocks/{i}/mlp/{p}" for i in (1, 2) for p in ("down_proj", "gate_proj", "up_proj")]
        assert {q.recipe.name for q in layers.values()} == {recipe}
        if fmt == "hif8":  # naive: most_recent; paper: max_window 64
            scaling = next(iter(layers.values())).recipe.activation.scaling
            assert (scaling.algorithm, scaling.history_len) == (arm.algorithm, 64)
