"""The arms of `python -m train`: the default job's three, the Max-Window paper's grid (``--grid paper``) and the
Four Over Six pretraining comparison (``--grid fouroversix``), and the `jaxlowfp.qat.Recipe` of each arm.

An arm is one training run from the same starting point, data order and seed as the others; an `ArmSpec` says
what differs: the format and scaling of the quantized layers, the learning rate, the high-precision warmup, and
which arm its training-loss APE is measured against (its *matched-LR baseline*).

**The Max-Window paper's grid** (arXiv 2605.26189, HiF8 W8A8 QAT of OpenPangu-Embedded-1B). Its abstract names two
failure modes invisible in the training loss, amax saturation (a lagging delayed-scaling estimate clips activations)
and forgetting (a high learning rate), and two fixes, the max over a 64-step amax window, and a 500-step BF16 warmup
followed by QAT at lr 1e-5; "across eight controlled experiments ... both fixes are necessary and sufficient". Only
the abstract and the authors' README (settings of the final run: max over 64 steps, 500 warmup steps, lr 1e-5, BF16
baseline at the same lr) were available, not the paper's table of the eight runs. `PAPER_GRID` therefore covers the
factors the abstract names, each against a high-precision baseline at the same learning rate:

=========================  ===========  ======  ======  =====================================================
arm                        scaling      LR      warmup  role (paper)
=========================  ===========  ======  ======  =====================================================
hp_high                    -            high    -       BF16 baseline at the aggressive LR
hp_low                     -            low     -       BF16 baseline at the paper's LR (final comparison)
most_recent_high           most_recent  high    no      neither fix
max_window_high            max_window   high    no      saturation fix only
most_recent_low            most_recent  low     no      low LR only
max_window_low             max_window   low     no      saturation fix + low LR, no warmup
most_recent_low_warmup     most_recent  low     yes     forgetting fix only (warmup + low LR)
max_window_low_warmup      max_window   low     yes     both fixes: the paper's final configuration
ema_low_warmup             ema          low     yes     another delayed estimator with the forgetting fix
current_low_warmup         current      low     yes     current scaling: no delay, so no saturation by lag
max_window_high_warmup     max_window   high    yes     both scaling fixes at the high LR (only with --arms)
most_recent_high_warmup    most_recent  high    yes     the warmup alone at the high LR (only with --arms)
=========================  ===========  ======  ======  =====================================================

The high LR is ``TrainConfig.lr``, the low LR ``TrainConfig.low_lr`` (default lr / 10, the paper's 1e-4 -> 1e-5
ratio); the warmup is ``TrainConfig.warmup_steps`` observe-only steps; the window ``history_len`` (64).

**Four Over Six in training** (``--grid fouroversix``, arXiv 2512.02010): pretraining from scratch with
`jaxlowfp.qat.nvfp4_training` (W4A4 forward, 16x16 weight blocks, quantized gradients with stochastic rounding,
Hadamard on the weight-gradient operands) on the MLP projections of every block (`FOUROVERSIX_LAYERS`: three
quarters of the block weights; attention, embedding and head stay in high precision, which keeps the CPU run in its
budget: compiling the 4/6 step for all 42 projections of the demo model took 150 s and 15 GB on this 2-core
machine, for the 18 MLP projections 73 s and 4.6 GB), with the block rule `static_6` (standard NVFP4) against the
4/6 rules `mae` (the paper's choice for pretraining) and `mse`, against high precision (``hp``); same
initialisation, data order and seed.
"""
from __future__ import annotations

import dataclasses
from typing import Any

__all__ = [
    "ArmSpec",
    "DEFAULT_ARMS",
    "GRIDS",
    "PAPER_GRID",
    "PAPER_OPTIONAL",
    "FOUROVERSIX_ARMS",
    "FOUROVERSIX_DEFAULT",
    "BLOCK_PROJECTIONS",
    "FOUROVERSIX_LAYERS",
    "grid_arm_names",
    "default_arms",
    "arm_specs",
    "make_recipe",
]

DEFAULT_ARMS = ("hp", "naive", "paper")
GRIDS = ("paper", "fouroversix")
# every projection of a Llama block, and those the fouroversix grid quantizes in every block
BLOCK_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FOUROVERSIX_LAYERS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArmSpec:
    """One arm. `format` "none" is high precision; `algorithm` is a `DelayedScaling` algorithm or ``"current"``.

    ``lr``: the arm's constant (continued pretraining) or peak (pretraining) learning rate; None: the config's.
    ``baseline``: the arm whose training loss the APE compares against. ``rule``: the NVFP4 block rule;
    ``training``: the `nvfp4_training` recipe (quantized gradients) instead of `nvfp4_w4a4`. ``role``: what the arm
    stands for (the report prints it).
    """

    name: str
    label: str
    format: str
    algorithm: str
    history_len: int
    warmup_steps: int
    lr: float | None = None
    baseline: str | None = None
    rule: str | None = None
    training: bool = False
    role: str = ""


# name: (algorithm or None for high precision, LR "high" | "low", warmup, role)
PAPER_GRID: dict[str, tuple[str | None, str, bool, str]] = {
    "hp_high": (None, "high", False, "BF16 baseline at the high LR"),
    "hp_low": (None, "low", False, "BF16 baseline at the paper's low LR (the final comparison)"),
    "most_recent_high": ("most_recent", "high", False, "neither fix"),
    "max_window_high": ("max_window", "high", False, "saturation fix only"),
    "most_recent_low": ("most_recent", "low", False, "low LR only"),
    "max_window_low": ("max_window", "low", False, "saturation fix and low LR, no warmup"),
    "most_recent_low_warmup": ("most_recent", "low", True, "forgetting fix only (warmup + low LR)"),
    "max_window_low_warmup": ("max_window", "low", True, "both fixes: the paper's final configuration"),
    "max_window_high_warmup": ("max_window", "high", True, "saturation and warmup fixes at the high LR"),
    "most_recent_high_warmup": ("most_recent", "high", True, "the warmup alone at the high LR"),
    "ema_low_warmup": ("ema", "low", True, "EMA estimate with the forgetting fix"),
    "current_low_warmup": ("current", "low", True, "current scaling (no delay) with the forgetting fix"),
}

FOUROVERSIX_ARMS = ("hp", "static_6", "static_4", "abs_max", "mae", "mse")
FOUROVERSIX_DEFAULT = ("hp", "static_6", "mae", "mse")


def grid_arm_names(grid: str | None) -> tuple[str, ...]:
    """Every arm name `--arms` accepts under `grid` (None: the default job)."""
    if grid is None:
        return DEFAULT_ARMS
    if grid == "paper":
        return tuple(PAPER_GRID)
    if grid == "fouroversix":
        return FOUROVERSIX_ARMS
    raise ValueError(f"grid={grid!r} is not supported; allowed: None, {', '.join(map(repr, GRIDS))}")


# arms of PAPER_GRID run only when `--arms` names them (the default grid is the ten above them)
PAPER_OPTIONAL = ("max_window_high_warmup", "most_recent_high_warmup")


def default_arms(grid: str | None) -> tuple[str, ...]:
    """The arms run when `--arms` is not given."""
    if grid == "paper":
        return tuple(a for a in PAPER_GRID if a not in PAPER_OPTIONAL)
    return FOUROVERSIX_DEFAULT if grid == "fouroversix" else grid_arm_names(grid)


def _lr_text(lr: float) -> str:
    return f"{lr:.0e}".replace("e-0", "e-")


def arm_specs(cfg: Any) -> list[ArmSpec]:
    """The arms of `cfg` (a `train.config.TrainConfig`) in order, with the labels the table prints."""
    if cfg.grid == "paper":
        return [_paper_arm(cfg, name) for name in cfg.arms]
    if cfg.grid == "fouroversix":
        return [_fouroversix_arm(cfg, name) for name in cfg.arms]
    baseline = "hp" if "hp" in cfg.arms else None
    out = []
    for arm in cfg.arms:
        if arm == "hp":
            out.append(ArmSpec(name="hp", label="high precision", format="none", algorithm=cfg.algorithm,
                               history_len=cfg.history_len, warmup_steps=0, lr=cfg.lr))
        elif arm == "naive":
            scaling = "most_recent" if cfg.format == "hif8" else "current scaling"
            out.append(ArmSpec(name="naive", label=f"{cfg.format} {scaling}, no warmup", format=cfg.format,
                               algorithm="most_recent", history_len=cfg.history_len, warmup_steps=0, lr=cfg.lr,
                               baseline=baseline))
        else:
            # NVFP4 recipes scale per 16-element block from the current tensor: no delayed-scaling algorithm
            scaling = f"{cfg.algorithm} {cfg.history_len}" if cfg.format == "hif8" else "current scaling"
            out.append(ArmSpec(name="paper", label=f"{cfg.format} {scaling}, warmup {cfg.warmup_steps}",
                               format=cfg.format, algorithm=cfg.algorithm, history_len=cfg.history_len,
                               warmup_steps=cfg.warmup_steps, lr=cfg.lr, baseline=baseline))
    return out


def _paper_arm(cfg: Any, name: str) -> ArmSpec:
    algorithm, which, warmup, role = PAPER_GRID[name]
    lr = cfg.lr if which == "high" else cfg.low_lr
    base = f"hp_{which}"
    if algorithm is None:
        return ArmSpec(name=name, label=f"high precision, lr {_lr_text(lr)}", format="none", algorithm="max_window",
                       history_len=cfg.history_len, warmup_steps=0, lr=lr, role=role)
    scaling = {"max_window": f"max_window {cfg.history_len}", "current": "current scaling"}.get(algorithm, algorithm)
    w = cfg.warmup_steps if warmup else 0
    label = f"{cfg.format} {scaling}, lr {_lr_text(lr)}, " + (f"warmup {w}" if w else "no warmup")
    return ArmSpec(name=name, label=label, format=cfg.format, algorithm=algorithm, history_len=cfg.history_len,
                   warmup_steps=w, lr=lr, baseline=base if base in cfg.arms else None, role=role)


def _fouroversix_arm(cfg: Any, name: str) -> ArmSpec:
    lr = cfg.pretrain_lr
    base = "hp" if "hp" in cfg.arms else None
    if name == "hp":
        return ArmSpec(name="hp", label="high precision", format="none", algorithm="current", history_len=1,
                       warmup_steps=0, lr=lr, role="baseline")
    kind = "standard NVFP4" if name == "static_6" else ("Four Over Six" if name in ("mae", "mse", "abs_max")
                                                       else "max mapped to 4")
    return ArmSpec(name=name, label=f"nvfp4 training, {name} ({kind})", format="nvfp4", algorithm="current",
                   history_len=1, warmup_steps=0, lr=lr, baseline=base, rule=name, training=True, role=kind)


def make_recipe(arm: ArmSpec) -> Any:
    """The `jaxlowfp.qat.Recipe` of a quantized arm.

    HiF8: W8A8 with the arm's delayed scaling (`jaxlowfp.qat.hif8_w8a8`), or with current scaling for
    ``algorithm="current"``; target 15, straight-through backward, gradients in high precision. NVFP4:
    `nvfp4_training(rule)` for a training arm, else `nvfp4_w4a4` with the arm's rule (default MAE, which the
    Four Over Six paper prefers for training).
    """
    from jaxlowfp import qat, scaling

    if arm.format == "hif8":
        if arm.algorithm == "current":
            spec = qat.QuantSpec(format="hif8", scaling=scaling.CurrentScaling(target_max=15.0), clip="target",
                                 ste="identity")
            return qat.Recipe(weight=spec, activation=spec, grad=None, name="hif8_w8a8_current")
        return qat.hif8_w8a8(algorithm=arm.algorithm, history_len=arm.history_len, target_max=15.0)
    if arm.format == "nvfp4":
        rule = arm.rule or "mae"
        return qat.nvfp4_training(rule) if arm.training else qat.nvfp4_w4a4(rule=rule)
    raise ValueError(f"arm {arm.name!r} has format {arm.format!r}; no recipe for it")
