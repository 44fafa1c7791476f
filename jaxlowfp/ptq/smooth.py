"""Per-input-channel scale migration folded into the preceding op: SmoothQuant and AWQ.

A `Fold` names the op whose output is the input of a group of Linear layers. For a positive scale s [in]::

    prev'(x) = prev(x) / s          (RMSNorm / LayerNorm: scale and bias / s;  Linear: output columns / s)
    W'_l     = diag(s) W_l          (every layer of the group: kernel rows * s)

so ``W'_l^T prev'(x) = W_l^T prev(x)`` exactly in real arithmetic (float32 rounding aside), and the outlier channels
of the activation move into the weights (s > 1) before both are quantized.

SmoothQuant (Xiao et al. 2023): ``s_j = max|X_j|^α / max_l max_o |W_l[j, o]|^(1-α)`` (llm-compressor's
``smoothing_strength`` is α); with ``alphas=(...)`` each fold takes the α of that list with the lowest loss L below.

AWQ (Lin et al. 2024) with llm-compressor 0.14's grid (``modifiers/transform/awq/base.py: _compute_best_scale,
_get_grid_search_params``): candidates ``s = mean|X|^r / (w_mean^(1-r) + 1e-4)`` ("duo scaling", w_mean the mean
over the fold's output rows of |W| normalised by its block max) or ``s = mean|X|^r``, clamped at 1e-4 and normalised
by ``sqrt(max s * min s)``; duo_scaling=True tries r = 0 without duo and r = i / (grid - 2), i < grid - 1, with it;
False tries r = i / (grid - 1), i < grid; "both" half the grid each way. The candidate with the lowest

    L(s) = Σ_l mean((X W_l - Q_a(X / s) Q_w(diag(s) W_l))^2)        (calibration samples X; Q the layer's scheme)

wins. (llm-compressor measures the error at the output of the fold's parent module with the weights quantized and
the activations not; L here is per layer with the run-time activation quantization, what the model computes.)

AWQ clipping (``clip=True``; llm-awq's ``auto_clip_layer``, ``awq/quantize/auto_clip.py``, which llm-compressor 0.14
does not have): after the scales, for every block of 16 weights of every clipped layer the largest |w| is shrunk by
r = 1, 1 - 1/clip_grid, ..., 1 - max_shrink, and the r with the lowest block output error
``mean_t (Σ_i x_ti (w_i - Q(clip(w, ±r max|w|))_i))^2`` on the samples is kept; the weights are clipped to it before
they are quantized. Layers matching `clip_skip` (q and k projections, as llm-awq: their outputs meet in q k^T) are
not clipped.

A Linear prev must feed the group elementwise and linearly per channel, e.g. SwiGLU's ``up_proj`` before
``down_proj`` (``down(silu(gate(x)) * up(x))``). Which ops precede which projections is the model family's
knowledge, not this module's: a model says it with a ``smoothing_folds()`` method (`jaxlowfp.models.Llama` has one),
or the caller passes ``folds=[Fold(...)]``.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxlowfp import nvfp4
from jaxlowfp._core.format import Format
from jaxlowfp.ptq.formats import Scheme, fake_quantize

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


def _check_alpha(a, what: str) -> None:
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
        raise ValueError(f"{what} must be a number in [0, 1]; got {a!r}")


def _check_count(obj, *fields: str) -> None:
    for f in fields:
        v = getattr(obj, f)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{f} must be a positive int; got {v!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmoothQuant:
    """SmoothQuant migration strength `alpha` in [0, 1] (0.5: the paper's default and llm-compressor's
    ``smoothing_strength``); `alphas`: a small search, each fold taking the α of the list with the lowest loss on
    `samples` calibration tokens (module docstring); `folds`: None for the model's own ``smoothing_folds()``. The
    folded weights are then quantized round-to-nearest."""

    alpha: float = 0.5
    alphas: tuple[float, ...] | None = None
    samples: int = 512
    folds: tuple[Fold, ...] | None = None
    name = "smoothquant"

    def __post_init__(self) -> None:
        _check_alpha(self.alpha, "alpha")
        if self.alphas is not None:
            a = tuple(self.alphas) if isinstance(self.alphas, (list, tuple)) else self.alphas
            if not isinstance(a, tuple) or not a:
                raise ValueError(f"alphas must be a non-empty sequence of numbers in [0, 1] or None; got {a!r}")
            for v in a:
                _check_alpha(v, "every alphas entry")
            object.__setattr__(self, "alphas", a)
        _check_count(self, "samples")
        _check_folds(self.folds)


DUO = (True, False, "both")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AWQ:
    """AWQ settings (module docstring): `grid` candidates (llm-compressor's ``n_grid``, default 20) with
    `duo_scaling` (True, False or "both", as llm-compressor's), on `samples` calibration tokens per fold; `clip`:
    llm-awq's clipping search over `clip_grid` steps down to 1 - `max_shrink`, except layers matching `clip_skip`;
    `folds`: None for the model's own ``smoothing_folds()``. The folded weights are then quantized round-to-nearest.
    """

    grid: int = 20
    duo_scaling: bool | str = True
    samples: int = 512
    clip: bool = False
    clip_grid: int = 20
    max_shrink: float = 0.5
    clip_skip: str = r"(.*/)?[qk]_proj"
    folds: tuple[Fold, ...] | None = None
    name = "awq"

    def __post_init__(self) -> None:
        _check_count(self, "grid", "samples", "clip_grid")
        if self.duo_scaling not in DUO or not isinstance(self.duo_scaling, (bool, str)):
            raise ValueError(f"duo_scaling must be True, False or 'both'; got {self.duo_scaling!r}")
        if (self.duo_scaling is True and self.grid < 2) or (self.duo_scaling == "both" and self.grid < 4):
            raise ValueError(f"grid={self.grid} is too small for duo_scaling={self.duo_scaling!r} (needs 2, 'both' 4)")
        if not isinstance(self.clip, bool):
            raise TypeError(f"clip must be a bool; got {self.clip!r}")
        m = self.max_shrink
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m < 1:
            raise ValueError(f"max_shrink must be a number in (0, 1); got {m!r}")
        try:
            re.compile(self.clip_skip)
        except (re.error, TypeError) as e:
            raise ValueError(f"clip_skip must be a regular expression; got {self.clip_skip!r}: {e}") from e
        _check_folds(self.folds)

    def grid_params(self) -> list[tuple[float, bool]]:
        """The (r, duo) candidates, in llm-compressor's order."""
        if self.duo_scaling == "both":
            n = self.grid // 2
            return [(i / (n - 1), duo) for i in range(n) for duo in (False, True)]
        if self.duo_scaling is False:
            return [(i / (self.grid - 1) if self.grid > 1 else 0.0, False) for i in range(self.grid)]
        return [(0.0, False)] + [(i / (self.grid - 2) if self.grid > 2 else 0.0, True) for i in range(self.grid - 1)]


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
    s = jnp.asarray(s, jnp.float32)  # type: ignore[assignment]  # numpy in, one float32 jax array here
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


def awq_w_mean(kernels: Sequence[jax.Array], group: int | None) -> np.ndarray:
    """llm-compressor's ``_compute_layer_means``: per input channel, the mean over every output row of the fold's
    layers of |W| divided by (its block's max |W| + 1e-6) (blocks of `group` inputs; None: one per row)."""
    total: Any = 0.0
    rows = 0
    for k in kernels:
        w: Any = np.abs(np.asarray(k, np.float32).T)  # [out, in]
        g = group or w.shape[1]
        blocks = w.reshape(w.shape[0], -1, g)
        w = (blocks / (blocks.max(axis=2, keepdims=True) + np.float32(1e-6))).reshape(w.shape)
        total = total + w.sum(axis=0, dtype=np.float64)
        rows += w.shape[0]
    return np.asarray(total / rows, np.float32)


def awq_candidates(x_mean: np.ndarray, w_mean: np.ndarray, params: Sequence[tuple[float, bool]]) -> np.ndarray:
    """Candidate scales [len(params), in] (module docstring; llm-compressor's formula and normalisation)."""
    x = np.asarray(x_mean, np.float32)
    out = []
    for r_, duo in params:
        r = np.float32(r_)
        if duo:
            s = np.maximum(x ** r / (np.asarray(w_mean, np.float32) ** (1 - r) + np.float32(1e-4)), np.float32(1e-4))
        else:
            s = np.maximum(x ** r, np.float32(1e-4))
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            s = s / np.sqrt(s.max() * s.min())
        out.append(np.where(np.isfinite(s), s, np.float32(1.0)))
    return np.stack(out).astype(np.float32)


def awq_losses(x: jax.Array, kernels: tuple[jax.Array, ...], cands: jax.Array, *, scheme: Scheme) -> jax.Array:
    """Loss L(s) [n] of each candidate scale vector `cands` [n, in] (module docstring)."""
    return _losses(jnp.asarray(x, jnp.float32), tuple(jnp.asarray(k, jnp.float32) for k in kernels),
                   jnp.asarray(cands, jnp.float32), scheme=scheme)


@functools.partial(jax.jit, static_argnames=("scheme",))
def _losses(x: jax.Array, kernels: tuple[jax.Array, ...], cands: jax.Array, *, scheme: Scheme) -> jax.Array:
    refs = [jnp.matmul(x, k, precision=_HI) for k in kernels]

    def loss(s):
        xs = x / s[None, :]
        if scheme.activation is not None:
            xs = fake_quantize(xs, scheme.activation)
        total = jnp.float32(0.0)
        for k, ref in zip(kernels, refs):
            wq = fake_quantize((k * s[:, None]).T, scheme.weight).T
            total = total + jnp.mean(jnp.square(jnp.matmul(xs, wq, precision=_HI) - ref))
        return total

    return lax.map(loss, cands)


def clip_weight(kernel: jax.Array, samples: jax.Array, fmt: Format, *, clip_grid: int = 20,
                max_shrink: float = 0.5) -> jax.Array:
    """llm-awq's clipping search (module docstring) of a kernel [in, out] for inputs `samples` [t, in]: the kernel
    with every block of 16 (NVFP4) or 32 (MXFP4) weights clipped to its best ±r max|w|. Per-tensor formats (HiF8)
    are returned unchanged."""
    if fmt.group is None:
        return kernel
    ratios = 1.0 - np.arange(int(max_shrink * clip_grid)) / clip_grid
    w = jnp.asarray(kernel, jnp.float32).T  # [out, in]
    chunk = int(np.gcd(w.shape[0], 256))  # output rows per step (llm-awq: 256), bounds the [t, rows, blocks] error
    return _clip(w, jnp.asarray(samples, jnp.float32), jnp.asarray(ratios, jnp.float32), fmt=fmt, chunk=chunk).T


@functools.partial(jax.jit, static_argnames=("fmt", "chunk"))
def _clip(w: jax.Array, x: jax.Array, ratios: jax.Array, *, fmt: Format, chunk: int) -> jax.Array:
    out, n = w.shape
    g = fmt.group
    if g is None:
        raise ValueError(f"the clip search runs per block; {fmt.name} has one scale per tensor")
    amax = jnp.max(jnp.abs(w))  # the global scale stays that of the unclipped weights during the search
    xb = x.reshape(x.shape[0], n // g, g)  # [t, blocks, g]
    bmax = jnp.max(jnp.abs(w.reshape(out, n // g, g)), axis=2)  # [out, blocks]

    def quant(v):  # [out, n] -> fake-quantized with the fixed global amax
        if fmt.kind == "nvfp4":
            return nvfp4.fake_quantize(v, rule=fmt.rule, block_shape=fmt.block_shape,  # type: ignore[arg-type]
                                       global_amax=amax)
        return fake_quantize(v, fmt)

    def err(r):  # [out, blocks]: mean over tokens of the squared block output error
        lim = jnp.repeat(bmax * r, g, axis=1)
        cw = jnp.clip(w, -lim, lim)
        d = (w - quant(cw)).reshape(out // chunk, chunk, n // g, g)
        per = lax.map(lambda dc: jnp.mean(jnp.square(jnp.einsum("tbi,obi->tob", xb, dc, precision=_HI)), axis=0), d)
        return per.reshape(out, n // g)

    errs = lax.map(err, ratios)  # [ratios, out, blocks]
    best = ratios[jnp.argmin(errs, axis=0)]  # [out, blocks]
    lim = jnp.repeat(bmax * best, g, axis=1)
    return jnp.clip(w, -lim, lim)
