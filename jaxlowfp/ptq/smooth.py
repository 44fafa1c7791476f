"""Per-input-channel scale migration folded into the preceding op: SmoothQuant and AWQ.

A `Fold` names the op whose output is the input of a group of Linear layers. For a positive scale s [in]::

    prev'(x) = prev(x) / s          (RMSNorm / LayerNorm: scale and bias / s;  Linear: output columns / s)
    W'_l     = diag(s) W_l          (every layer of the group: kernel rows * s)

so ``W'_l^T prev'(x) = W_l^T prev(x)`` exactly in real arithmetic (float32 rounding aside), and the outlier channels
of the activation move into the weights (s > 1) before both are quantized.

SmoothQuant (Xiao et al. 2023): ``s_j = max|X_j|^α / max_l max_o |W_l[j, o]|^(1-α)``.
AWQ (Lin et al. 2024): ``s = mean|X|^r``, normalised by ``sqrt(max s * min s)``, with r on a grid in [0, 1) chosen to
minimise ``Σ_l mean((X W_l - Q_a(X / s) Q_w(diag(s) W_l))^2)`` on calibration samples, Q the layer's PTQ scheme.
(llm-awq also searches a weight clipping range; not done here.)

A Linear prev must feed the group elementwise and linearly per channel, e.g. SwiGLU's ``up_proj`` before
``down_proj`` (``down(silu(gate(x)) * up(x))``). Which ops precede which projections is the model family's
knowledge, not this module's: a model says it with a ``smoothing_folds()`` method (`jaxlowfp.models.Llama` has one),
or the caller passes ``folds=[Fold(...)]``.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxlowfp.ptq.formats import Scheme

_HI = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fold:
    """`prev`: path of an ``nnx.RMSNorm``, ``nnx.LayerNorm`` or ``nnx.Linear`` whose output is the input of every
    Linear in `layers` (paths)."""

    prev: str
    layers: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.prev, str):
            raise TypeError(f"Fold.prev must be a module path string; got {self.prev!r}")
        layers = (self.layers,) if isinstance(self.layers, str) else tuple(self.layers)
        if not layers or not all(isinstance(p, str) for p in layers):
            raise ValueError(f"Fold.layers must be a non-empty sequence of module paths; got {self.layers!r}")
        object.__setattr__(self, "layers", layers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmoothQuant:
    """SmoothQuant migration strength `alpha` in [0, 1] (0.5: the paper's default); `folds`: None for
    the model's own ``smoothing_folds()``. The folded weights are then quantized round-to-nearest."""

    alpha: float = 0.5
    folds: tuple[Fold, ...] | None = None
    name = "smoothquant"

    def __post_init__(self) -> None:
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise ValueError(f"alpha must be a number in [0, 1]; got {a!r}")
        _check_folds(self.folds)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AWQ:
    """AWQ scale search over r = 0, 1/grid, ..., (grid-1)/grid on `samples` calibration tokens per layer group;
    `folds`: None for the model's own ``smoothing_folds()``. The folded weights are then quantized
    round-to-nearest."""

    grid: int = 10
    samples: int = 512
    folds: tuple[Fold, ...] | None = None
    name = "awq"

    def __post_init__(self) -> None:
        for f in ("grid", "samples"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be a positive int; got {v!r}")
        _check_folds(self.folds)


def _check_folds(folds) -> None:
    if folds is not None and not all(isinstance(f, Fold) for f in folds):
        raise TypeError(f"folds must be a sequence of Fold or None; got {folds!r}")


def check_fold(model_mods: dict, fold: Fold) -> None:
    """The fold's modules exist and fit: prev's output size equals every layer's in_features."""
    prev = model_mods.get(fold.prev)
    if prev is None:
        raise ValueError(f"Fold(prev={fold.prev!r}): no module at that path")
    if isinstance(prev, nnx.Linear):
        size = prev.out_features
    elif isinstance(prev, (nnx.RMSNorm, nnx.LayerNorm)):
        if prev.scale is None:
            raise ValueError(f"Fold(prev={fold.prev!r}): the norm has no scale to fold into (use_scale=False)")
        size = prev.scale.shape[-1]
    else:
        raise TypeError(f"Fold(prev={fold.prev!r}) is a {type(prev).__name__}; allowed: nnx.RMSNorm, nnx.LayerNorm, "
                        f"nnx.Linear")
    for p in fold.layers:
        lin = model_mods.get(p)
        if not isinstance(lin, nnx.Linear):
            raise ValueError(f"Fold(prev={fold.prev!r}): layer {p!r} is not an nnx.Linear in the model")
        if lin.in_features != size:
            raise ValueError(f"Fold(prev={fold.prev!r}): {p} has in_features={lin.in_features} but {fold.prev} "
                             f"outputs {size} channels")


def apply_fold(model_mods: dict, fold: Fold, s: np.ndarray) -> None:
    """Divide prev's output channels by `s` and multiply the group's kernel rows by `s` (in place)."""
    s = jnp.asarray(s, jnp.float32)
    prev = model_mods[fold.prev]
    if isinstance(prev, nnx.Linear):
        prev.kernel.set_value(prev.kernel[...] / s[None, :])
        if prev.bias is not None:
            prev.bias.set_value(prev.bias[...] / s)
    else:
        prev.scale.set_value(prev.scale[...] / s)
        if getattr(prev, "bias", None) is not None:
            prev.bias.set_value(prev.bias[...] / s)
    for p in fold.layers:
        lin = model_mods[p]
        lin.kernel.set_value(lin.kernel[...] * s[:, None])


def smoothquant_scales(x_amax: np.ndarray, kernels: Sequence[jax.Array], alpha: float) -> np.ndarray:
    """``s_j = max|X_j|^α / max|W_j|^(1-α)`` (1 where either max is 0), clipped to [1e-5, 1e5]."""
    w_amax = np.max(np.stack([np.max(np.abs(np.asarray(k)), axis=1) for k in kernels]), axis=0)
    x_amax = np.asarray(x_amax, np.float64)
    w_amax = np.asarray(w_amax, np.float64)
    ok = (x_amax > 0) & (w_amax > 0) & np.isfinite(x_amax)
    s = np.where(ok, np.power(np.where(ok, x_amax, 1.0), alpha) / np.power(np.where(ok, w_amax, 1.0), 1 - alpha), 1.0)
    return np.clip(s, 1e-5, 1e5).astype(np.float32)


def _awq_candidates(x_mean: jax.Array, grid: int) -> jax.Array:
    r = jnp.arange(grid, dtype=jnp.float32) / grid
    s = jnp.maximum(x_mean[None, :], 1e-4) ** r[:, None]  # [grid, in]
    return s / jnp.sqrt(jnp.max(s, axis=1, keepdims=True) * jnp.min(s, axis=1, keepdims=True))


@functools.partial(jax.jit, static_argnames=("scheme", "grid"))
def awq_losses(x: jax.Array, kernels: tuple[jax.Array, ...], x_mean: jax.Array, *, scheme: Scheme, grid: int
               ) -> tuple[jax.Array, jax.Array]:
    """(candidate scales [grid, in], loss per candidate [grid]) of AWQ's search (module docstring)."""
    cands = _awq_candidates(x_mean, grid)
    refs = [jnp.matmul(x, k, precision=_HI) for k in kernels]

    def loss(s):
        xs = x / s[None, :]
        if scheme.activation is not None:
            xs = scheme.activation.fake_quantize(xs)
        total = jnp.float32(0.0)
        for k, ref in zip(kernels, refs):
            wq = scheme.weight.fake_quantize((k * s[:, None]).T).T
            total = total + jnp.mean(jnp.square(jnp.matmul(xs, wq, precision=_HI) - ref))
        return total

    return cands, lax.map(loss, cands)
