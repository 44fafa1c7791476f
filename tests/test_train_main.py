"""`python -m train`: flags and presets are validated with clear messages; a tiny run goes end to end."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert pretrain_key(base) != pretrain_key(dataclasses.replace(base, preset="tiny"))


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
