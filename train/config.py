"""Configuration of `python -m train`: one frozen dataclass and its command line.

`TrainConfig` holds everything that decides a run; `parse_args(argv)` builds it from flags and exits with code 2
and a message that names the allowed values when a flag is bad (argparse's convention).

The main job compares *arms* on domain B, all started from the same pretrained parameters, with the same data
order (`train.grid` defines them):

    hp      high precision
    naive   `format` W8A8 with `most_recent` delayed scaling and no warmup (the paper's failure configuration)
    paper   `format` W8A8 with `algorithm` / `history_len` delayed scaling after `warmup_steps` observe-only steps

``grid="paper"`` runs the Max-Window paper's grid instead (scalings x high/low learning rate x warmup, each against
a high-precision baseline at its learning rate); ``grid="fouroversix"`` pretrains from scratch with NVFP4 training
(static_6 against the Four Over Six rules). ``model`` (a registry name such as ``"smollm2-135m"``, a ``.gguf`` file
or a Hugging Face directory) continues a real checkpoint instead of the byte-level demo model (`train.real_qat`).

Fields left at None take defaults that depend on the kind of run (`BYTE_DEFAULTS`, `MODEL_DEFAULTS`): the demo's
for the byte-level model, a CPU-sized smoke run for a real checkpoint, and for ``grid="paper"`` a high learning
rate (`lr`) and ``low_lr = lr / 10``.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from jaxlowfp._core.checks import one_of
from .grid import DEFAULT_ARMS, GRIDS, ArmSpec, arm_specs, default_arms, grid_arm_names

__all__ = [
    "TrainConfig",
    "ArmSpec",
    "ARMS",
    "FORMATS",
    "ALGORITHMS",
    "SCHEDULES",
    "GRIDS",
    "DTYPES",
    "BYTE_DEFAULTS",
    "MODEL_DEFAULTS",
    "arm_specs",
    "pretrain_key",
    "build_parser",
    "parse_args",
]

FORMATS = ("hif8", "nvfp4", "none")
ALGORITHMS = ("max_window", "most_recent", "max", "ema")
SCHEDULES = ("constant", "cosine")
ARMS = DEFAULT_ARMS
DTYPES = ("auto", "float32", "bfloat16")

# defaults of the fields left at None: the byte-level demo (`make demo`), and a real checkpoint (a CPU smoke run;
# scripts/gpu_grid.py passes GPU sizes). `lr` of a real checkpoint: the paper's 1e-5, or its high 1e-4 as the
# high LR of the grid.
BYTE_DEFAULTS: dict[str, Any] = dict(steps=160, lr=3e-4, warmup_steps=40, batch_size=8, keep_first=1, keep_last=1,
                                     mc_items=200)
MODEL_DEFAULTS: dict[str, Any] = dict(steps=8, lr=1e-5, warmup_steps=4, batch_size=4, keep_first=3, keep_last=2,
                                      mc_items=16, seq_len=128)
MODEL_GRID_HIGH_LR = 1e-4


def _presets() -> dict[str, Any]:
    from jaxlowfp.models.llama import PRESETS  # late: keeps `--help` cheap

    return PRESETS


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that decides a run. Defaults are the `make demo` run (<= 10 minutes on a 2-core CPU).

    `warmup_steps` is the QAT warmup (observe-only steps of the `paper` arm), `lr_warmup_steps` the linear LR
    warmup of the cosine schedule; the continued-pretraining arms use a constant low LR by default (the paper's
    recipe against forgetting). Fields marked "(None: ...)" are resolved in ``__post_init__`` (module docstring).
    """

    preset: str = "small"
    steps: int | None = None  # per continued-pretraining arm (domain B); None: 160 (demo) / 8 (real model)
    pretrain_steps: int = 300  # high precision on domain A, cached (fouroversix: the steps of every arm)
    lr: float | None = None  # continued pretraining; the high LR of grid "paper". None: 3e-4 / 1e-5 (1e-4 in grid)
    schedule: str = "constant"
    pretrain_lr: float = 2e-3
    lr_warmup_steps: int = 30  # of the pretraining warmup-cosine schedule (and of `schedule="cosine"`)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    format: str = "hif8"
    algorithm: str = "max_window"
    history_len: int = 64
    warmup_steps: int | None = None  # None: 40 / 4
    arms: tuple[str, ...] | None = None  # None: every arm of the job or grid (fouroversix: hp, static_6, mae, mse)
    keep_first: int | None = None  # None: 1 / 3
    keep_last: int | None = None  # None: 1 / 2
    batch_size: int | None = None  # None: 8 / 4
    seq_len: int | None = None  # None: min(128, the preset's max_seq_len) / 128 tokens
    seed: int = 0
    out: str | None = None  # run directory; default runs/<preset>-<format> (grids and models: see run_dir)
    cache_dir: str = "runs"  # where pretrained-<hash>/ lives
    mesh: str | None = None  # "data=2,fsdp=2"; None: data parallel over all devices
    checkpoint_every: int = 50
    resume: bool = False
    eval_batches: int = 16
    mc_items: int | None = None  # None: 200 / 16
    max_bytes: int | None = None  # cap on bytes read per domain (tests)
    progress: bool = True
    grid: str | None = None  # None, "paper" or "fouroversix"
    low_lr: float | None = None  # the low LR of grid "paper"; None: lr / 10
    model: str | None = None  # a real checkpoint (jaxlowfp.models.load); None: the byte-level model of `preset`
    dtype: str = "auto"  # compute dtype; auto: bfloat16 on GPU, float32 on CPU
    microbatches: int = 1  # gradient accumulation: microbatches per step (amax histories merged by max)
    remat: bool = False  # rematerialise the forward in the backward, saving only matmul outputs
    eval_tokens: int = 512  # real model: tokens scored per text (perplexity)
    eval_length: int = 128  # real model: perplexity window in tokens (disjoint windows)
    downstream: str | None = None  # real model: a `tasks prepare` directory every arm is evaluated on (train.real_qat)

    def __post_init__(self) -> None:
        one_of(self.format, FORMATS, "format")
        one_of(self.algorithm, ALGORITHMS, "algorithm")
        one_of(self.schedule, SCHEDULES, "schedule")
        one_of(self.dtype, DTYPES, "dtype")
        if self.grid is not None:
            one_of(self.grid, GRIDS, "grid")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"model must be a registry name or a path; got {self.model!r}")
        if self.grid == "fouroversix" and self.model is not None:
            raise ValueError("grid='fouroversix' pretrains the byte-level model from scratch; it takes no model")
        if self.downstream is not None and (self.model is None or not isinstance(self.downstream, str)
                                            or not self.downstream):
            raise ValueError(f"downstream={self.downstream!r}: the downstream tasks need a real checkpoint (--model) "
                             "and a directory written by `python -m train tasks prepare`")
        if self.grid == "paper" and self.format != "hif8":
            raise ValueError(f"grid='paper' is the Max-Window paper's HiF8 W8A8 grid; got format={self.format!r}")
        self._resolve_defaults()
        if not isinstance(self.arms, tuple) or not self.arms:
            raise ValueError(f"arms must be a non-empty tuple drawn from {grid_arm_names(self.grid)}; "
                             f"got {self.arms!r}")
        names = grid_arm_names(self.grid)
        bad = [a for a in self.arms if a not in names]
        if bad:
            where = "" if self.grid is None else f" under grid {self.grid!r}"
            raise ValueError(f"invalid arm(s) {', '.join(map(repr, bad))}; allowed: {', '.join(names)}{where} "
                             "(comma separated)")
        if len(set(self.arms)) != len(self.arms):
            raise ValueError(f"arms must not repeat; got {self.arms!r}")
        if self.format == "none" and set(self.arms) - {"hp"}:
            raise ValueError(f"format='none' runs only the 'hp' arm; got arms={self.arms!r} (pass --arms hp)")
        presets = _presets()
        if self.preset not in presets:
            raise ValueError(f"preset={self.preset!r} is not supported; allowed: {', '.join(map(repr, presets))}")
        _positive(self, "steps", "batch_size", "seq_len", "history_len", "checkpoint_every", "eval_batches",
                  "mc_items", "microbatches", "eval_tokens", "eval_length")
        _non_negative(self, "pretrain_steps", "warmup_steps", "lr_warmup_steps", "keep_first", "keep_last", "seed")
        for name in ("lr", "pretrain_lr", "low_lr"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 < v < 1.0:
                raise ValueError(f"{name} must be a float in (0, 1); got {v!r}")
        for name in ("weight_decay", "grad_clip"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a float >= 0; got {v!r}")
        if not isinstance(self.remat, bool):
            raise ValueError(f"remat must be a bool; got {self.remat!r}")
        if self.batch_size % self.microbatches:
            raise ValueError(f"microbatches={self.microbatches} must divide batch_size={self.batch_size}")
        if self.max_bytes is not None:
            _positive(self, "max_bytes")
        if self.mesh is not None:
            from .mesh import parse_mesh

            parse_mesh(self.mesh)  # raises a ValueError naming the allowed axes
        if self.model is not None:  # sizes of a real checkpoint are checked once it is loaded (train.real_qat)
            return
        max_len = presets[self.preset].max_seq_len
        if self.seq_len > max_len:
            raise ValueError(f"seq_len={self.seq_len} exceeds the max_seq_len {max_len} of preset {self.preset!r}")
        n_blocks = presets[self.preset].n_layers
        quantized = set(self.arms) - {"hp"} and self.grid != "fouroversix"  # fouroversix quantizes every block
        if quantized and self.keep_first + self.keep_last >= n_blocks:
            raise ValueError(f"keep_first={self.keep_first} + keep_last={self.keep_last} leaves none of the "
                             f"{n_blocks} blocks of preset {self.preset!r} to quantize")

    def _resolve_defaults(self) -> None:
        defaults = dict(MODEL_DEFAULTS if self.model is not None else BYTE_DEFAULTS)
        if self.model is not None and self.grid == "paper":
            defaults["lr"] = MODEL_GRID_HIGH_LR
        if self.model is None:
            defaults["seq_len"] = min(128, _presets()[self.preset].max_seq_len) if self.preset in _presets() else 128
        defaults["arms"] = default_arms(self.grid)
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.low_lr is None:
            object.__setattr__(self, "low_lr", self.lr / 10 if isinstance(self.lr, (int, float)) else self.lr)

    @property
    def run_dir(self) -> str:
        if self.out is not None:
            return self.out
        if self.model is not None:
            name = self.model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")
            return f"runs/{name}-{self.format}" + (f"-{self.grid}" if self.grid else "")
        if self.grid == "fouroversix":
            return f"runs/{self.preset}-fouroversix"
        return f"runs/{self.preset}-{self.format}" + (f"-{self.grid}" if self.grid else "")

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


_PRETRAIN_FIELDS = ("preset", "pretrain_steps", "pretrain_lr", "lr_warmup_steps", "weight_decay", "grad_clip",
                    "batch_size", "seq_len", "seed", "max_bytes")


def pretrain_key(cfg: TrainConfig, data_fingerprint: str = "") -> str:
    """A short hash of what decides the pretrained model, the fields of `cfg` that pretraining reads and the
    domain-A corpus fingerprint: the cache key of runs/pretrained-<hash>/."""
    payload = {k: getattr(cfg, k) for k in _PRETRAIN_FIELDS}
    payload["data"] = data_fingerprint
    payload["version"] = 1
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def _csv(text: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    if not items:
        raise argparse.ArgumentTypeError(f"invalid arm(s) {text!r}: give arm names, comma separated")
    return items


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig.__dataclass_fields__
    p = argparse.ArgumentParser(
        prog="python -m train",
        description="Pretrain a small Llama on Shakespeare (domain A, cached), then continue on Python source "
                    "(domain B) in several arms: high precision and HiF8 W8A8 QAT with and without the paper's "
                    "fixes (max-window delayed scaling + high-precision warmup). --grid paper runs the Max-Window "
                    "paper's grid, --grid fouroversix NVFP4 pretraining with and without Four Over Six, --model "
                    "continues a real checkpoint (e.g. smollm2-135m) instead of the byte-level model. Subcommands: "
                    "python -m train {eval,generate,stream,...} --help.")
    add = p.add_argument
    add("--preset", default=d["preset"].default, help="model size (tiny, small, base)")
    add("--model", default=None,
        help="continue a real checkpoint: a registry name (smollm2-135m), a .gguf file or a Hugging Face directory")
    add("--grid", choices=GRIDS, default=None,
        help="paper: the Max-Window paper's grid (scalings x high/low LR x warmup); fouroversix: NVFP4 "
             "pretraining from scratch, static_6 vs the 4/6 rules vs high precision")
    add("--steps", type=int, default=None, help="steps per continued-pretraining arm (default 160; real model 8)")
    add("--pretrain-steps", type=int, default=d["pretrain_steps"].default,
        help="domain-A pretraining steps (fouroversix: the steps of every arm)")
    add("--lr", type=float, default=None,
        help="learning rate of the continued-pretraining arms, the high LR of --grid paper (default 3e-4; real "
             "model 1e-5, in --grid paper 1e-4)")
    add("--low-lr", type=float, default=None, help="the low LR of --grid paper (default lr / 10)")
    add("--schedule", choices=SCHEDULES, default=d["schedule"].default, help="LR schedule of the arms")
    add("--pretrain-lr", type=float, default=d["pretrain_lr"].default)
    add("--format", choices=FORMATS, default=d["format"].default, help="element format of the quantized arms")
    add("--algorithm", choices=ALGORITHMS, default=d["algorithm"].default,
        help="delayed-scaling algorithm of the 'paper' arm")
    add("--history-len", type=int, default=d["history_len"].default)
    add("--warmup-steps", type=int, default=None,
        help="observe-only (high precision) steps before QAT in the 'paper' arm (default 40; real model 4)")
    add("--arms", type=_csv, default=None,
        help=f"comma separated, from {', '.join(ARMS)} (--grid paper / fouroversix: see train/grid.py)")
    add("--keep-first", type=int, default=None, help="first blocks kept in high precision (default 1; real model 3)")
    add("--keep-last", type=int, default=None, help="last blocks kept in high precision (default 1; real model 2)")
    add("--batch-size", type=int, default=None, help="sequences per step (default 8; real model 4)")
    add("--microbatches", type=int, default=d["microbatches"].default,
        help="split every batch into this many microbatches (gradient accumulation; amax histories merged by max)")
    add("--remat", action="store_true", help="rematerialise activations in the backward (saves memory)")
    add("--dtype", choices=DTYPES, default=d["dtype"].default,
        help="compute dtype (auto: bfloat16 on GPU, float32 on CPU); parameters stay float32")
    add("--seq-len", type=int, default=None,
        help="bytes (real model: tokens) per training sequence (default min(128, preset max); real model 128)")
    add("--seed", type=int, default=d["seed"].default)
    add("--out", default=None, help="run directory (default runs/<preset or model>-<format>[-<grid>])")
    add("--cache-dir", default=d["cache_dir"].default, help="where pretrained-<hash>/ is cached")
    add("--mesh", default=None, help="device mesh, e.g. data=2,fsdp=2 (default: data parallel on all devices)")
    add("--checkpoint-every", type=int, default=d["checkpoint_every"].default)
    add("--resume", action="store_true", help="continue each arm from its latest checkpoint")
    add("--eval-batches", type=int, default=d["eval_batches"].default)
    add("--eval-tokens", type=int, default=d["eval_tokens"].default,
        help="real model: tokens scored per text for perplexity")
    add("--eval-length", type=int, default=d["eval_length"].default,
        help="real model: perplexity window in tokens")
    add("--downstream", default=None, metavar="DIR",
        help="real model: evaluate the start model and every trained arm, as trained (quantized), on the lm-eval "
             "tasks of DIR (written by `python -m train tasks prepare`), with per-sample logs and paired differences "
             "against the arm's high-precision baseline at the same LR")
    add("--mc-items", type=int, default=None, help="multiple-choice items (default 200; real model 16)")
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
