"""Per-tensor scale estimation as explicit functional state, in the style of optax.

A scaling object is static, hashable configuration; its state is an :class:`AmaxHistory` pytree that goes into and
comes out of every training step. At step ``t`` with tensor amax ``a_t``::

    est_t   = algorithm(a_0 .. a_{t-1}) * 2**margin      # only amaxes recorded *before* t (one-step delay)
    est_t   = a_t * 2**margin                            # ... while nothing has been recorded yet
    scale_t = est_t / target_max                         # dequant multiplier (x ~= q * scale); 1 if est_t is 0/NaN/Inf
    state'  = record(state, a_t)                         # after use; a non-finite a_t is counted, not recorded

Algorithms (``DelayedScaling.algorithm``), over the recorded amaxes ``a_0 .. a_{c-1}``:

- ``"most_recent"``: ``a_{c-1}``. Clips whenever the amax grows from one step to the next.
- ``"max_window"``: ``max(a_{c-L} .. a_{c-1})`` with ``L = history_len`` (the Max-Window paper: L = 64). Transformer
  Engine and Flax call this "max" over their ``amax_history_len`` buffer.
- ``"max"``: ``max(a_0 .. a_{c-1})``, everything ever recorded (an unbounded window). Never clips a value seen
  before, but one early spike pins the scale for the rest of training and pushes small values into underflow.
- ``"ema"``: ``e_0 = a_0``, ``e_k = d * e_{k-1} + (1 - d) * a_k`` with ``d = ema_decay``. Lags both ways, so a
  non-monotonic amax is clipped on every rise.

``CurrentScaling`` estimates from the tensor itself (``est_t = a_t``): no delay, no clipping by the scale, but the
scale moves with every batch and costs a reduction over the tensor before quantizing.

Conventions (``DelayedScaling.convention``): ``"default"`` is the above. ``"te"`` and ``"flax"`` reproduce Transformer
Engine's delayed scaling and Flax's ``fp8_ops`` (which follows it) bit for bit, with ``A_t`` the window value of the
algorithm over the recorded amaxes (the empty slots of the buffer count as 0)::

    est_t   = A_t * 2**margin  if A_t is finite and > 0,  else est_{t-1}   (est_{-1} = 0: the scale starts at 1)
    sf_t    = target_max / est_t                     # TE's quantization multiplier;  1 when est_t is 0
    scale_t = 1 / sf_t                               # the dequant multiplier: two roundings, not est_t / target_max
    state'  = record(state, a_t)                     # a NaN/Inf amax is recorded too: it freezes the scale
                                                     # (est_t = est_{t-1}) until it leaves the window

They differ only in the quantizer (:mod:`jaxlowfp.qat`): TE multiplies ``x * sf_t``, Flax divides ``x / scale_t``.
``margin`` must be an integer there (TE's is an int; Flax's is always 0). See ``docs/from_flax_fp8_and_te.md``.

Delayed scaling of a *backward* tensor (the output gradient of a quantized matmul) keeps the same
:class:`AmaxHistory`; the amax the backward pass sees leaves it as a gradient, a :class:`PendingAmax`, and is
recorded at the next forward pass (:func:`record_pending`), so the history is explicit state of the step.

:func:`merge` combines the states of microbatches or replicas that ran the same step from the same state: slot by
slot maximum of the ring buffers, so the merged history is what one step over the whole batch would have recorded.
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import dataclasses
import math
from collections.abc import Hashable, Sequence
from typing import Any, Literal, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from jaxlowfp._core.bits import ieee_div
from jaxlowfp._core.checks import integer, number, one_of, positive_finite
from jaxlowfp._core.reduce import abs_max

__all__ = [
    "SCHEMA_VERSION",
    "ALGORITHMS",
    "CONVENTIONS",
    "AmaxHistory",
    "PendingAmax",
    "DelayedScaling",
    "StaticScaling",
    "GRANULARITIES",
    "CurrentScaling",
    "Scaling",
    "merge",
    "merge_across",
    "check_version",
    "record_pending",
    "pending_amaxes",
    "with_pending_amaxes",
]

SCHEMA_VERSION = 1
ALGORITHMS = ("most_recent", "max_window", "max", "ema")
PyTree: TypeAlias = Any  # a JAX pytree (nested tuples, lists, dicts, NamedTuples of arrays)
AxisName: TypeAlias = Hashable  # a mapped axis name (jax.lax.pmax), or a tuple of them
Algorithm = Literal["most_recent", "max_window", "max", "ema"]
CONVENTIONS = ("default", "te", "flax")
Convention = Literal["default", "te", "flax"]
# CurrentScaling.granularity: one amax for the whole tensor, or one per vector along the contraction axis (an
# activation's tokens, a weight's output channels)
GRANULARITIES = ("tensor", "token")
Granularity = Literal["tensor", "token"]
_TE_ALGORITHMS = ("max_window", "most_recent")  # TE's amax_compute_algo "max" and "most_recent"


class AmaxHistory(NamedTuple):
    """Scale state of one tensor (an ordinary pytree; orbax saves it as is).

    Attributes:
      history: f32[history_len] ring buffer of recorded amaxes; the amax recorded as the k-th (0-based) sits in
        slot ``k % history_len``. Slots not yet written hold 0.
      count: i32[] number of amaxes recorded so far.
      estimate: f32[] the amax estimate used by the last step (margin included); 0 before the first step.
      nonfinite: i32[] number of steps whose amax was NaN or +-Inf (those are not recorded).
      version: i32[] schema version, :data:`SCHEMA_VERSION`.
      peak: f32[] maximum of every amax ever recorded (the ``"max"`` algorithm).
      ema: f32[] exponential moving average of the recorded amaxes (the ``"ema"`` algorithm).
    """

    history: jax.Array
    count: jax.Array  # type: ignore[assignment]  # a NamedTuple field named like tuple.count
    estimate: jax.Array
    nonfinite: jax.Array
    version: jax.Array
    peak: jax.Array
    ema: jax.Array


class PendingAmax(NamedTuple):
    """The amax a backward pass saw, on its way into an :class:`AmaxHistory` (delayed gradient scaling).

    A quantized matmul whose output gradient uses delayed scaling takes this pytree as an input and defines its
    *gradient* as the amax of the output gradient: differentiate the loss w.r.t. it as well (``jaxlowfp.training``
    does) and store that gradient as the new value; the next forward pass records it (:func:`record_pending`)
    before the backward pass reads the history. A layer called several times in one step, with its state threaded
    from call to call, reports the maximum over the calls.

    Attributes:
      seen: f32[] 1 if a backward pass reported an amax since the last forward pass, else 0.
      amax: f32[] that amax (NaN or Inf if the gradient held one).
    """

    seen: jax.Array
    amax: jax.Array

    @staticmethod
    def none() -> PendingAmax:
        """Nothing pending (the value a forward pass leaves behind)."""
        return PendingAmax(seen=jnp.zeros((), jnp.float32), amax=jnp.zeros((), jnp.float32))


def _init_state(history_len: int) -> AmaxHistory:
    # a buffer of its own for every leaf, so that a jitted step may donate the state
    return AmaxHistory(
        history=jnp.zeros((history_len,), jnp.float32),
        count=jnp.zeros((), jnp.int32),
        estimate=jnp.zeros((), jnp.float32),
        nonfinite=jnp.zeros((), jnp.int32),
        version=jnp.asarray(SCHEMA_VERSION, jnp.int32),
        peak=jnp.zeros((), jnp.float32),
        ema=jnp.zeros((), jnp.float32),
    )


def _as_amax(x_amax: ArrayLike) -> jax.Array:
    a = jnp.asarray(x_amax)
    if a.shape != ():
        raise ValueError(f"x_amax must be a scalar (the tensor's max |x|); got shape {a.shape}")
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"x_amax must be a floating scalar; got dtype {a.dtype}")
    return a.astype(jnp.float32)


def _check_state(state: AmaxHistory, history_len: int, owner: str) -> None:
    if not isinstance(state, AmaxHistory):
        raise TypeError(f"state must be an AmaxHistory (from {owner}.init()); got {type(state).__name__}")
    if state.history.shape != (history_len,):
        raise ValueError(
            f"state.history has shape {state.history.shape}, but {owner} has history_len={history_len}; "
            f"build the state with this object's init()"
        )


def _record(state: AmaxHistory, a: jax.Array, estimate: jax.Array, ema_decay: float,
            keep_nonfinite: bool = False) -> AmaxHistory:
    """Record amax `a` (a non-finite one is counted, and skipped unless `keep_nonfinite`) and remember `estimate`
    as the one used. ``peak`` and ``ema`` only ever see finite amaxes."""
    finite = jnp.isfinite(a)
    n = state.history.shape[0]
    written = lax.dynamic_update_index_in_dim(state.history, a, state.count % n, 0)
    first = state.count == 0
    ema = jnp.where(first, a, ema_decay * state.ema + (1.0 - ema_decay) * a)
    recorded = jnp.bool_(True) if keep_nonfinite else finite
    return AmaxHistory(
        history=jnp.where(recorded, written, state.history),
        count=state.count + recorded.astype(jnp.int32),
        estimate=estimate,
        nonfinite=state.nonfinite + (~finite).astype(jnp.int32),
        version=state.version,
        peak=jnp.where(finite, jnp.maximum(state.peak, a), state.peak),
        ema=jnp.where(finite, ema, state.ema),
    )


def _guarded_scale(amax_est: ArrayLike, target_max: float) -> jax.Array:
    est = jnp.asarray(amax_est).astype(jnp.float32)
    ok = jnp.isfinite(est) & (est > 0)
    # The divisor of the guarded-out branch is irrelevant; keep it finite so no NaN is ever computed.
    return jnp.where(ok, ieee_div(jnp.where(ok, est, 1.0), target_max), jnp.float32(1.0))


def _te_multiplier(amax_est: ArrayLike, target_max: float) -> jax.Array:
    """TE's ``sf = target_max / est`` (IEEE division); 1 when the estimate is 0, NaN or Inf."""
    est = jnp.asarray(amax_est).astype(jnp.float32)
    ok = jnp.isfinite(est) & (est > 0)
    return jnp.where(ok, ieee_div(target_max, jnp.where(ok, est, 1.0)), jnp.float32(1.0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DelayedScaling:
    """Delayed per-tensor scaling: the scale of step t comes from amaxes recorded at steps < t.

    Attributes:
      algorithm: "most_recent", "max_window", "max" or "ema" (see the module docstring).
      history_len: ring-buffer length L (the window of "max_window"; "max" and "ema" keep their own running
        value and use the buffer only for telemetry). Default 64, the Max-Window paper's.
      target_max: the value the estimate maps to: ``scale = estimate / target_max`` (15 for HiF8 activations).
      margin: the estimate is multiplied by ``2**margin`` (>= 0; headroom against growth).
      ema_decay: d in (0, 1) for "ema".
      convention: "default", or "te" / "flax" to reproduce Transformer Engine / Flax ``fp8_ops`` exactly (initial
        scale 1, ``scale = 1 / (target_max / est)``, non-finite amaxes recorded and freezing the scale; module
        docstring). "te" and "flax" take the algorithms "max_window" (their "max") and "most_recent", and an
        integer margin.

    >>> s = DelayedScaling(algorithm="max_window", history_len=2, target_max=15.0)
    >>> st = s.init()
    >>> for a in (1.0, 4.0, 2.0):
    ...     st = s.update(st, a)
    >>> float(s.amax_estimate(st, 3.0))  # max of the last two recorded: 4 and 2
    4.0
    """

    algorithm: Algorithm = "max_window"
    history_len: int = 64
    target_max: float
    margin: float = 0.0
    ema_decay: float = 0.9
    convention: Convention = "default"

    def __post_init__(self) -> None:
        one_of(self.algorithm, ALGORITHMS, "algorithm")
        one_of(self.convention, CONVENTIONS, "convention")
        object.__setattr__(self, "history_len", integer(self.history_len, "history_len", minimum=1))
        object.__setattr__(self, "target_max", positive_finite(self.target_max, "target_max"))
        object.__setattr__(self, "margin", number(self.margin, "margin", lo=0.0, hi=math.inf, hi_open=True,
                                                  allowed="finite and >= 0 (the estimate is multiplied by "
                                                          "2**margin)"))
        object.__setattr__(self, "ema_decay", number(self.ema_decay, "ema_decay", lo=0.0, hi=1.0, lo_open=True,
                                                     hi_open=True))
        if self.convention != "default":
            if self.algorithm not in _TE_ALGORITHMS:
                raise ValueError(f"convention={self.convention!r} has the algorithms {_TE_ALGORITHMS} (TE's 'max' "
                                 f"over its window and 'most_recent'); got algorithm={self.algorithm!r}")
            if self.margin != int(self.margin):
                raise ValueError(f"convention={self.convention!r} needs an integer margin (TE's margin is an int, "
                                 f"Flax's is 0); got margin={self.margin!r}")

    def init(self) -> AmaxHistory:
        """Empty state: nothing recorded, so the first step falls back to the current amax (convention "default")
        or to scale 1 ("te", "flax")."""
        return _init_state(self.history_len)

    def amax_estimate(self, state: AmaxHistory, x_amax: ArrayLike) -> jax.Array:
        """f32[] estimate for this step from amaxes recorded before it; `x_amax` (this step's) if none yet.

        Conventions "te"/"flax": the last estimate (0 at first) when the window value is 0, NaN or Inf."""
        _check_state(state, self.history_len, "DelayedScaling")
        a = _as_amax(x_amax)
        c, n = state.count, self.history_len
        if self.convention != "default":
            if self.algorithm == "max_window":  # the whole buffer, unwritten slots 0; a recorded NaN propagates
                window = abs_max(jnp.where(jnp.arange(n) < c, state.history, 0.0))
            else:
                window = jnp.where(c > 0, state.history[(c - 1) % n], 0.0)
            ok = jnp.isfinite(window) & (window > 0)
            return jnp.where(ok, window * (2.0**self.margin), state.estimate)
        if self.algorithm == "most_recent":
            est = state.history[(c - 1) % n]
        elif self.algorithm == "max_window":
            est = jnp.max(jnp.where(jnp.arange(n) < c, state.history, -jnp.inf))
        elif self.algorithm == "max":
            est = state.peak
        else:
            est = state.ema
        est = jnp.where(c > 0, est, a)
        return est * (2.0**self.margin) if self.margin else est

    def update(self, state: AmaxHistory, x_amax: ArrayLike) -> AmaxHistory:
        """Record this step's amax (after use). A NaN/Inf amax is not recorded (convention "default") or recorded
        ("te", "flax"); ``nonfinite`` counts it either way."""
        est = self.amax_estimate(state, x_amax)
        return _record(state, _as_amax(x_amax), est, self.ema_decay, keep_nonfinite=self.convention != "default")

    def scale(self, amax_est: ArrayLike) -> jax.Array:
        """Dequant multiplier ``amax_est / target_max`` (IEEE division; "te"/"flax": ``1 / (target_max /
        amax_est)``, two IEEE divisions); 1 when the estimate is 0, NaN or Inf."""
        if self.convention == "default":
            return _guarded_scale(amax_est, self.target_max)
        return ieee_div(1.0, _te_multiplier(amax_est, self.target_max))

    def multiplier(self, amax_est: ArrayLike) -> jax.Array:
        """The quantization multiplier ``x -> x * multiplier`` of convention "te": ``target_max / amax_est`` (TE's
        ``scale``; ``scale(est) == 1 / multiplier(est)``); 1 when the estimate is 0, NaN or Inf."""
        return _te_multiplier(amax_est, self.target_max)


class _OneSlot:
    """What current and static scaling share: a one-slot state (the last finite amax, the step and non-finite
    counts, so the telemetry and :func:`merge` of :class:`DelayedScaling` apply) and ``scale = est / target_max``."""

    target_max: float

    @property
    def history_len(self) -> int:
        return 1

    def init(self) -> AmaxHistory:
        return _init_state(1)

    def _estimate(self, x_amax: jax.Array) -> jax.Array:
        raise NotImplementedError

    def amax_estimate(self, state: AmaxHistory, x_amax: ArrayLike) -> jax.Array:
        _check_state(state, 1, type(self).__name__)
        return self._estimate(_as_amax(x_amax))

    def update(self, state: AmaxHistory, x_amax: ArrayLike) -> AmaxHistory:
        a = _as_amax(x_amax)
        _check_state(state, 1, type(self).__name__)
        return _record(state, a, self._estimate(a), 0.0)

    def scale(self, amax_est: ArrayLike) -> jax.Array:
        """Dequant multiplier ``amax_est / target_max`` (IEEE division); 1 when the estimate is 0, NaN or Inf."""
        return _guarded_scale(amax_est, self.target_max)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurrentScaling(_OneSlot):
    """Current (just-in-time) scaling: the estimate is the amax of the tensor being quantized.

    The state keeps the last finite amax (``history_len`` 1), the step count and the non-finite count, so the
    same telemetry and :func:`merge` work as for :class:`DelayedScaling`.

    ``granularity="token"``: one amax per vector along the contraction axis (each token of an activation; each
    output channel of a weight), so a token's quantization depends on that token alone, never on the other rows
    of its batch or on padding (the dynamic per-token scaling of serving engines). Its state records the max over
    the tokens.
    """

    target_max: float
    granularity: Granularity = "tensor"

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_max", positive_finite(self.target_max, "target_max"))
        one_of(self.granularity, GRANULARITIES, "granularity")

    def _estimate(self, x_amax: jax.Array) -> jax.Array:
        """`x_amax` itself (as float32)."""
        return x_amax


@dataclasses.dataclass(frozen=True, kw_only=True)
class StaticScaling(_OneSlot):
    """A fixed, calibrated amax: ``est = amax`` at every step, whatever the tensor holds (values beyond it are
    clipped). What a serving engine applies to activations with a calibrated input scale (vLLM's static
    ``input_global_scale`` for NVFP4, ``input_scale`` for FP8), so a quantized result never depends on the other
    requests of a batch. The state is :class:`CurrentScaling`'s (the last finite amax seen, telemetry only). A
    tuple `amax` holds one per expert, for the grouped GEMM `jaxlowfp.ops.ragged_dot` only.

    ``amax=None``: the calibrated amax is the state's ``estimate`` (:meth:`calibrated` builds that state), not part
    of the spec, so layers calibrated to different amaxes have equal specs and share one compiled program (a PTQ'd
    model's identical blocks); the call then needs that state, as a delayed-scaling call needs its history.

    >>> s = StaticScaling(amax=4.0, target_max=15.0)
    >>> float(s.amax_estimate(s.init(), 9.0)), float(s.scale(s.amax_estimate(s.init(), 9.0)))
    (4.0, 0.2666666805744171)
    """

    amax: float | tuple[float, ...] | None
    target_max: float

    def __post_init__(self) -> None:
        if self.amax is None:  # carried in the state (calibrated)
            pass
        elif isinstance(self.amax, (tuple, list)):  # one calibrated amax per expert (jaxlowfp.ops.ragged_dot)
            object.__setattr__(self, "amax", tuple(positive_finite(a, f"amax[{i}] (the calibrated max |x| of "
                                                                          f"expert {i})")
                                                    for i, a in enumerate(self.amax)))
        else:
            object.__setattr__(self, "amax", positive_finite(self.amax, "amax (the calibrated max |x|)"))
        object.__setattr__(self, "target_max", positive_finite(self.target_max, "target_max"))

    def calibrated(self, amax: float) -> AmaxHistory:
        """The state of a spec with ``amax=None`` that quantizes with the calibrated `amax` (a positive finite max
        |x|, rounded to float32 as a spec's own amax is)."""
        if self.amax is not None:
            raise ValueError(f"StaticScaling(amax={self.amax!r}) holds its amax; calibrated() is for amax=None")
        a = positive_finite(amax, "amax (the calibrated max |x|)")
        return _init_state(1)._replace(estimate=jnp.asarray(a, jnp.float32))

    def amax_estimate(self, state: AmaxHistory, x_amax: ArrayLike) -> jax.Array:
        if self.amax is None:
            _check_state(state, 1, "StaticScaling")
            _as_amax(x_amax)
            return state.estimate
        return super().amax_estimate(state, x_amax)

    def update(self, state: AmaxHistory, x_amax: ArrayLike) -> AmaxHistory:
        if self.amax is None:  # the calibrated estimate stays; the amax seen is telemetry
            a = _as_amax(x_amax)
            _check_state(state, 1, "StaticScaling")
            return _record(state, a, state.estimate, 0.0)
        return super().update(state, x_amax)

    def _estimate(self, x_amax: jax.Array) -> jax.Array:
        """The calibrated `amax` (float32), for any `x_amax`."""
        if isinstance(self.amax, tuple):
            raise ValueError(f"StaticScaling with one amax per expert ({len(self.amax)}) applies to the grouped GEMM "
                             f"jaxlowfp.ops.ragged_dot only; give one float for a tensor")
        return jnp.float32(self.amax)


Scaling = DelayedScaling | CurrentScaling | StaticScaling


def _is_history(x: Any) -> bool:
    return isinstance(x, (AmaxHistory, PendingAmax))


def _merge_pending(p: PendingAmax, axis_name: AxisName | None = None) -> PendingAmax:
    """Max over replicas (a leading axis, or `axis_name`): the amax of the union of their gradients."""
    amax = jnp.where(p.seen > 0, p.amax, 0.0)
    nan = jnp.isnan(amax)
    if axis_name is None:
        return PendingAmax(seen=jnp.max(p.seen, axis=0),
                           amax=jnp.where(jnp.any(nan, axis=0), jnp.nan, jnp.max(amax, axis=0)))
    any_nan = lax.pmax(nan.astype(jnp.int32), axis_name) > 0
    return PendingAmax(seen=lax.pmax(p.seen, axis_name),
                       amax=jnp.where(any_nan, jnp.nan, lax.pmax(jnp.where(nan, 0.0, amax), axis_name)))


def _merge_stacked(s: AmaxHistory) -> AmaxHistory:
    """Merge one AmaxHistory whose leaves carry a leading replica axis R (and, for per-expert histories of a
    grouped GEMM, expert axes after it: history [R, G, L], count [R, G]: each expert merged on its own)."""
    if s.count.ndim > 1 and s.history.ndim == s.count.ndim + 1:
        return jax.vmap(_merge_stacked, in_axes=1)(s)
    if s.count.ndim != 1 or s.history.ndim != 2:
        raise ValueError(
            f"merge expects states stacked along a leading axis (history [R, L], count [R]); got history "
            f"{s.history.shape} and count {s.count.shape}"
        )
    n = s.history.shape[1]
    c_max = jnp.max(s.count)
    # Slot k of replica r holds recorded index j = the largest j < count_r with j = k (mod n). A replica that
    # recorded fewer steps (a non-finite amax) still holds index j - n there, older than the merged window
    # [c_max - n, c_max): mask it, so it cannot leak into the merged window.
    k = jnp.arange(n, dtype=jnp.int32)
    c = s.count[:, None]
    j = c - 1 - jnp.mod(c - 1 - k[None, :], n)
    valid = (j >= 0) & (j >= c_max - n)
    history = jnp.max(jnp.where(valid, s.history, 0.0), axis=0)
    latest = s.count == c_max  # replicas that recorded the newest step carry the up-to-date EMA
    return AmaxHistory(
        history=history,
        count=c_max,
        estimate=jnp.max(s.estimate),
        nonfinite=jnp.max(s.nonfinite),
        version=jnp.max(s.version),
        peak=jnp.max(s.peak),
        ema=jnp.max(jnp.where(latest, s.ema, -jnp.inf)),
    )


def merge(states: Sequence[PyTree] | PyTree) -> PyTree:
    """Combine the scale states of microbatches or replicas that each ran the same step from the same state.

    `states` is a list/tuple of identical pytrees (an :class:`AmaxHistory`, a ``RecipeState``, a model's whole
    state; ``None`` leaves stay ``None``), or one such pytree whose array leaves carry a leading replica axis (the
    output of ``vmap``/``lax.scan``). Every :class:`AmaxHistory` in it merges by maximum:

    - ``history``: slot by slot max of the aligned ring buffers; a replica that skipped a non-finite amax (so
      recorded fewer steps) contributes only the slots it actually wrote inside the merged window;
    - ``count``: the max (replicas that recorded the step all have count + 1);
    - ``peak``, ``estimate``: the max; ``ema``: the max over the replicas with the highest count (since the EMA is
      increasing in the new amax, that is the EMA of the max amax);
    - ``nonfinite``: the max (> 0 iff some replica saw a non-finite amax; a lower bound on the steps that did).

    Every :class:`PendingAmax` merges to the max amax (NaN if any replica's is NaN) of the replicas that saw one.
    Merging is idempotent: ``merge([s, s]) == s``.
    """
    if isinstance(states, list) or type(states) is tuple:
        if not states:
            raise ValueError("merge needs at least one state; got an empty sequence")
        struct = jax.tree.structure(states[0], is_leaf=_is_history)
        for i, s in enumerate(states[1:], 1):
            if jax.tree.structure(s, is_leaf=_is_history) != struct:  # type: ignore[operator]
                raise ValueError(f"merge: state {i} has a different pytree structure from state 0")
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    else:
        stacked = states

    def one(s):
        if isinstance(s, PendingAmax):
            return _merge_pending(s)
        return _merge_stacked(s) if isinstance(s, AmaxHistory) else s

    return jax.tree.map(one, stacked, is_leaf=_is_history)


def merge_across(states: PyTree, axis_name: AxisName) -> PyTree:
    """:func:`merge` over a named mapped axis (inside ``shard_map``/``pmap``/``vmap`` with ``axis_name``).

    Every replica gets the merged state; same rules as :func:`merge`.
    """

    def one(s):
        if isinstance(s, PendingAmax):
            return _merge_pending(s, axis_name)
        if not isinstance(s, AmaxHistory):
            return s
        n = s.history.shape[-1]
        c_max = lax.pmax(s.count, axis_name)
        k = jnp.arange(n, dtype=jnp.int32)
        j = s.count - 1 - jnp.mod(s.count - 1 - k, n)
        valid = (j >= 0) & (j >= c_max - n)
        return AmaxHistory(
            history=lax.pmax(jnp.where(valid, s.history, 0.0), axis_name),
            count=c_max,
            estimate=lax.pmax(s.estimate, axis_name),
            nonfinite=lax.pmax(s.nonfinite, axis_name),
            version=lax.pmax(s.version, axis_name),
            peak=lax.pmax(s.peak, axis_name),
            ema=lax.pmax(jnp.where(s.count == c_max, s.ema, -jnp.inf), axis_name),
        )

    return jax.tree.map(one, states, is_leaf=_is_history)


def check_version(states: PyTree) -> PyTree:
    """Raise ValueError if any (concrete) :class:`AmaxHistory` in `states` has another schema version.

    Call it on a restored checkpoint; returns `states` unchanged.
    """
    for s in jax.tree.leaves(states, is_leaf=_is_history):
        if isinstance(s, AmaxHistory):
            v = np.asarray(s.version)
            if np.any(v != SCHEMA_VERSION):
                raise ValueError(
                    f"AmaxHistory schema version {np.unique(v).tolist()} found; this jaxlowfp reads version "
                    f"{SCHEMA_VERSION}"
                )
    return states


def record_pending(scaling: Scaling, state: AmaxHistory, pending: PendingAmax) -> AmaxHistory:
    """`state` with the amax a backward pass reported recorded (``scaling.update``), if it reported one."""
    if not isinstance(pending, PendingAmax):
        raise TypeError(f"pending must be a PendingAmax; got {type(pending).__name__}")
    updated = scaling.update(state, pending.amax)
    return jax.tree.map(lambda n, o: jnp.where(pending.seen > 0, n, o), updated, state)


def _is_pending(x: Any) -> bool:
    return isinstance(x, PendingAmax)


def pending_amaxes(tree: PyTree) -> PyTree:
    """`tree` (a ``RecipeState``, a model's quantization state, a Linen collection) with every leaf that is not
    part of a :class:`PendingAmax` replaced by None: the part of the state to differentiate the loss w.r.t.

    The gradient of the loss w.r.t. it is the new value of those leaves (:func:`with_pending_amaxes`)::

        pend = scaling.pending_amaxes(qstate)
        (loss, new_qstate), (g_params, g_pend) = jax.value_and_grad(
            lambda p, q: loss_fn(p, scaling.with_pending_amaxes(qstate, q)), argnums=(0, 1), has_aux=True
        )(params, pend)
        new_qstate = scaling.with_pending_amaxes(new_qstate, g_pend)
    """
    return jax.tree.map(lambda x: x if _is_pending(x) else None, tree, is_leaf=_is_pending)


def with_pending_amaxes(tree: PyTree, pendings: PyTree) -> PyTree:
    """`tree` with its :class:`PendingAmax` entries replaced, in order, by those of `pendings` (the output of
    :func:`pending_amaxes` or its gradient)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_pending)
    new = [p for p in jax.tree.leaves(pendings, is_leaf=_is_pending)]
    slots = [i for i, leaf in enumerate(leaves) if _is_pending(leaf)]
    if len(new) != len(slots) or not all(_is_pending(p) for p in new):
        raise ValueError(f"with_pending_amaxes: `tree` holds {len(slots)} PendingAmax, `pendings` "
                         f"{len(new)} (pass the output of pending_amaxes(tree) or its gradient)")
    for i, p in zip(slots, new):
        leaves[i] = PendingAmax(*(jnp.asarray(v, jnp.float32) for v in p))
    return treedef.unflatten(leaves)  # type: ignore[attr-defined]


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
