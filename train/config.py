"""Configuration of `python -m train`: one frozen dataclass and its command line.

`TrainConfig` holds everything that decides a run; `parse_args(argv)` builds it from flags and exits with code 2
and a message that names the allowed values when a flag is bad (argparse's convention).

The main job compares *arms* on domain B, all started from the same pretrained parameters, with the same data
order and learning rate:

    hp      high precision
    naive   `format` W8A8 with `most_recent` delayed scaling and no warmup (the paper's failure configuration)
    paper   `format` W8A8 with `algorithm` / `history_len` delayed scaling after `warmup_steps` observe-only steps
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from jaxlowfp._core.checks import one_of

__all__ = [
    "TrainConfig",
    "ArmSpec",
    "ARMS",
    "FORMATS",
    "ALGORITHMS",
    "SCHEDULES",
    "arm_specs",
    "pretrain_key",
    "build_parser",
    "parse_args",
]

FORMATS = ("hif8", "nvfp4", "none")
ALGORITHMS = ("max_window", "most_recent", "max", "ema")
SCHEDULES = ("constant", "cosine")
ARMS = ("hp", "naive", "paper")


def _presets() -> dict[str, Any]:
    from train.model import PRESETS  # late: keeps `--help` cheap

    return PRESETS


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that decides a run. Defaults are the `make demo` run (<= 10 minutes on a 2-core CPU).

    `warmup_steps` is the QAT warmup (observe-only steps of the `paper` arm), `lr_warmup_steps` the linear LR
    warmup of the cosine schedule; the continued-pretraining arms use a constant low LR by default (the paper's
    recipe against forgetting).
    """

    preset: str = "small"
    steps: int = 160  # per continued-pretraining arm (domain B)
    pretrain_steps: int = 300  # high precision on domain A, cached
    lr: float = 3e-4  # continued pretraining (all arms)
    schedule: str = "constant"
    pretrain_lr: float = 2e-3
    lr_warmup_steps: int = 30  # of the pretraining warmup-cosine schedule (and of `schedule="cosine"`)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    format: str = "hif8"
    algorithm: str = "max_window"
    history_len: int = 64
    warmup_steps: int = 40
    arms: tuple[str, ...] = ARMS
    keep_first: int = 1
    keep_last: int = 1
    batch_size: int = 8
    seq_len: int | None = None  # default min(128, the preset's max_seq_len)
    seed: int = 0
    out: str | None = None  # run directory; default runs/<preset>-<format>
    cache_dir: str = "runs"  # where pretrained-<hash>/ lives
    mesh: str | None = None  # "data=2,fsdp=2"; None: data parallel over all devices
    checkpoint_every: int = 50
    resume: bool = False
    eval_batches: int = 16
    mc_items: int = 200
    max_bytes: int | None = None  # cap on bytes read per domain (tests)
    progress: bool = True

    def __post_init__(self) -> None:
        one_of(self.format, FORMATS, "format")
        one_of(self.algorithm, ALGORITHMS, "algorithm")
        one_of(self.schedule, SCHEDULES, "schedule")
        if not isinstance(self.arms, tuple) or not self.arms:
            raise ValueError(f"arms must be a non-empty tuple drawn from {ARMS}; got {self.arms!r}")
        for arm in self.arms:
            one_of(arm, ARMS, "arm")
        if len(set(self.arms)) != len(self.arms):
            raise ValueError(f"arms must not repeat; got {self.arms!r}")
        if self.format == "none" and set(self.arms) - {"hp"}:
            raise ValueError(f"format='none' runs only the 'hp' arm; got arms={self.arms!r} (pass --arms hp)")
        presets = _presets()
        if self.preset not in presets:
            raise ValueError(f"preset={self.preset!r} is not supported; allowed: {', '.join(map(repr, presets))}")
        if self.seq_len is None:
            object.__setattr__(self, "seq_len", min(128, presets[self.preset].max_seq_len))
        _positive(self, "steps", "batch_size", "seq_len", "history_len", "checkpoint_every", "eval_batches",
                  "mc_items")
        _non_negative(self, "pretrain_steps", "warmup_steps", "lr_warmup_steps", "keep_first", "keep_last", "seed")
        for name in ("lr", "pretrain_lr"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 < v < 1.0:
                raise ValueError(f"{name} must be a float in (0, 1); got {v!r}")
        for name in ("weight_decay", "grad_clip"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a float >= 0; got {v!r}")
        if self.max_bytes is not None:
            _positive(self, "max_bytes")
        if self.mesh is not None:
            from train.mesh import parse_mesh

            parse_mesh(self.mesh)  # raises a ValueError naming the allowed axes
        max_len = presets[self.preset].max_seq_len
        if self.seq_len > max_len:
            raise ValueError(f"seq_len={self.seq_len} exceeds the max_seq_len {max_len} of preset {self.preset!r}")
        n_blocks = presets[self.preset].n_layers
        if set(self.arms) - {"hp"} and self.keep_first + self.keep_last >= n_blocks:
            raise ValueError(f"keep_first={self.keep_first} + keep_last={self.keep_last} leaves none of the "
                             f"{n_blocks} blocks of preset {self.preset!r} to quantize")

    @property
    def run_dir(self) -> str:
        return self.out if self.out is not None else f"runs/{self.preset}-{self.format}"

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["arms"] = list(self.arms)
        return d


def _positive(cfg: TrainConfig, *names: str) -> None:
    for name in names:
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int; got {v!r}")


def _non_negative(cfg: TrainConfig, *names: str) -> None:
    for name in names:
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be an int >= 0; got {v!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArmSpec:
    """One continued-pretraining arm: `format` "none" is high precision."""

    name: str
    label: str
    format: str
    algorithm: str
    history_len: int
    warmup_steps: int


def arm_specs(cfg: TrainConfig) -> list[ArmSpec]:
    """The arms of `cfg` in order, with the labels the table prints."""
    out = []
    for arm in cfg.arms:
        if arm == "hp":
            out.append(ArmSpec(name="hp", label="high precision", format="none", algorithm=cfg.algorithm,
                               history_len=cfg.history_len, warmup_steps=0))
        elif arm == "naive":
            scaling = "most_recent" if cfg.format == "hif8" else "current scaling"
            out.append(ArmSpec(name="naive", label=f"{cfg.format} {scaling}, no warmup", format=cfg.format,
                               algorithm="most_recent", history_len=cfg.history_len, warmup_steps=0))
        else:
            # NVFP4 recipes scale per 16-element block from the current tensor: no delayed-scaling algorithm
            scaling = f"{cfg.algorithm} {cfg.history_len}" if cfg.format == "hif8" else "current scaling"
            out.append(ArmSpec(name="paper", label=f"{cfg.format} {scaling}, warmup {cfg.warmup_steps}",
                               format=cfg.format, algorithm=cfg.algorithm, history_len=cfg.history_len,
                               warmup_steps=cfg.warmup_steps))
    return out


_PRETRAIN_FIELDS = ("preset", "pretrain_steps", "pretrain_lr", "lr_warmup_steps", "weight_decay", "grad_clip",
                    "batch_size", "seq_len", "seed", "max_bytes")


def pretrain_key(cfg: TrainConfig, data_fingerprint: str = "") -> str:
    """A short hash of what decides the pretrained model, the fields of `cfg` that pretraining reads and the
    domain-A corpus fingerprint: the cache key of runs/pretrained-<hash>/."""
    payload = {k: getattr(cfg, k) for k in _PRETRAIN_FIELDS}
    payload["data"] = data_fingerprint
    payload["version"] = 1
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def _csv(choices: Sequence[str]):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(s.strip() for s in text.split(",") if s.strip())
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"invalid arm(s) {', '.join(map(repr, bad)) or repr(text)}; allowed: {', '.join(choices)} "
                "(comma separated)")
        return items

    return parse


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig.__dataclass_fields__
    p = argparse.ArgumentParser(
        prog="python -m train",
        description="Pretrain a small Llama on Shakespeare (domain A, cached), then continue on Python source "
                    "(domain B) in several arms: high precision and HiF8 W8A8 QAT with and without the paper's "
                    "fixes (max-window delayed scaling + high-precision warmup).")
    add = p.add_argument
    add("--preset", default=d["preset"].default, help="model size (tiny, small, base)")
    add("--steps", type=int, default=d["steps"].default, help="steps per continued-pretraining arm")
    add("--pretrain-steps", type=int, default=d["pretrain_steps"].default, help="domain-A pretraining steps")
    add("--lr", type=float, default=d["lr"].default, help="learning rate of the continued-pretraining arms")
    add("--schedule", choices=SCHEDULES, default=d["schedule"].default, help="LR schedule of the arms")
    add("--pretrain-lr", type=float, default=d["pretrain_lr"].default)
    add("--format", choices=FORMATS, default=d["format"].default, help="element format of the quantized arms")
    add("--algorithm", choices=ALGORITHMS, default=d["algorithm"].default,
        help="delayed-scaling algorithm of the 'paper' arm")
    add("--history-len", type=int, default=d["history_len"].default)
    add("--warmup-steps", type=int, default=d["warmup_steps"].default,
        help="observe-only (high precision) steps before QAT in the 'paper' arm")
    add("--arms", type=_csv(ARMS), default=d["arms"].default, help=f"comma separated, from {', '.join(ARMS)}")
    add("--batch-size", type=int, default=d["batch_size"].default)
    add("--seq-len", type=int, default=None, help="bytes per training sequence (default min(128, preset max))")
    add("--seed", type=int, default=d["seed"].default)
    add("--out", default=None, help="run directory (default runs/<preset>-<format>)")
    add("--cache-dir", default=d["cache_dir"].default, help="where pretrained-<hash>/ is cached")
    add("--mesh", default=None, help="device mesh, e.g. data=2,fsdp=2 (default: data parallel on all devices)")
    add("--checkpoint-every", type=int, default=d["checkpoint_every"].default)
    add("--resume", action="store_true", help="continue each arm from its latest checkpoint")
    add("--eval-batches", type=int, default=d["eval_batches"].default)
    add("--mc-items", type=int, default=d["mc_items"].default)
    add("--max-bytes", type=int, default=None, help="read at most this many bytes per domain")
    add("--no-progress", dest="progress", action="store_false", help="no progress bars")
    return p


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Flags -> TrainConfig; a bad flag or value exits with code 2 and a message naming the allowed values."""
    p = build_parser()
    ns = p.parse_args(argv)
    try:
        return TrainConfig(**vars(ns))
    except (ValueError, TypeError) as e:
        p.error(str(e))
        raise  # unreachable: p.error exits
