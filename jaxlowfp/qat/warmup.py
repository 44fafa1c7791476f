"""The high-precision warmup schedule of QAT (observe-only steps before quantizing)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from jaxlowfp._core.checks import integer

Schedule = Callable[[Any], Any]

@dataclasses.dataclass(frozen=True, kw_only=True)
class Warmup:
    """High precision (observe-only) for the first `steps` steps, then quantized (the Max-Window paper: 500).

    >>> w = Warmup(steps=500)
    >>> bool(w.observe_only(499)), bool(w.observe_only(500))
    (True, False)
    """

    steps: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", integer(self.steps, "steps"))

    def observe_only(self, step: ArrayLike) -> jax.Array:
        """bool[] ``step < steps``: pass as ``observe_only=`` (traced steps do not retrace)."""
        return jnp.asarray(step) < self.steps

    def quantize(self, step: ArrayLike) -> jax.Array:
        """bool[] ``step >= steps``."""
        return jnp.logical_not(self.observe_only(step))

    def lr_schedule(self, high_precision: Schedule | float, quantized: Schedule | float) -> Schedule:
        """An optax schedule: `high_precision` for steps < `steps`, then `quantized` (counting from 0 again).

        ``optax.join_schedules([high_precision, quantized], [steps])``; floats become constant schedules.
        """
        parts = [optax.constant_schedule(s) if isinstance(s, (int, float)) else s for s in (high_precision,
                                                                                             quantized)]
        for p in parts:
            if not callable(p):
                raise TypeError(f"schedules must be callables or numbers; got {p!r}")
        return optax.join_schedules(parts, [self.steps])

