"""Switching the QAT phase of a model and reading its quantization telemetry."""
from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlowfp._core.checks import bool_flag
from jaxlowfp.qnnx.rules import iter_quant_ops
from jaxlowfp.qat.telemetry import flatten_floats, named_leaves


def set_observe_only(model: nnx.Module, flag: bool | jax.Array) -> int:
    """Switch every quantized op (the quantized layers, and the ops the Qwix provider attached) to observe-only
    (warmup, `flag=True`) or quantized (`False`).

    The flag is state (a `QuantPhase` variable), not static config: a traced bool flips a jitted step without
    retracing. Returns the number of ops switched.
    """
    value = jnp.asarray(bool_flag(flag))
    n = 0
    for _, m in iter_quant_ops(model):
        m.observe_only.set_value(value)
        n += 1
    return n


def _flat_stats(model: nnx.Module) -> Iterator[tuple[tuple[str, ...], jax.Array]]:
    for path, m in iter_quant_ops(model):
        for names, leaf in named_leaves(m.stats.get_value()):
            yield (path, *names), leaf


def collect_stats(model: nnx.Module) -> dict[str, float]:
    """Every quantized op's last QuantStats as a flat `{path/tensor/field: float}` dict, for a logger, e.g.
    `blocks/3/mlp/gate_proj/activation/saturated_fraction`."""
    return flatten_floats(_flat_stats(model))


def max_saturated_fraction(model: nnx.Module) -> jax.Array:
    """max over all quantized ops' tensors of the last saturated (clipped) fraction, as a float32 scalar.

    Traceable: return it from a jitted step for a progress bar. 0 when the model has no quantized op.
    """
    vals = [jnp.max(leaf).astype(jnp.float32) for names, leaf in _flat_stats(model)
            if names[-1] == "saturated_fraction"]
    return jnp.max(jnp.stack(vals)) if vals else jnp.zeros((), jnp.float32)
