"""Where a model's arrays live: committed to the devices they are on, so that a jitted call sees the same inputs the
first time as every time after.

``jax.jit`` lowers an uncommitted argument (a NumPy value, or an array made by ``jnp.asarray`` or an eager op and
never placed) with an unspecified sharding and a committed one with its own, so the two compile apart. A quantized
op writes state in its forward (its execution record; a QAT op its amax history), and ``nnx.jit`` then hands back
the model's state as the call's outputs, which are committed: without this, the second call of a freshly quantized
model compiles the same program again (a SmolLM2-135M forward at ``-O0`` on 2 CPU cores shared with a training run:
7 s more with standard NVFP4 on every projection, 57 s more with Four Over Six). The same holds for a training
state: `jaxlowfp.training.init` made its step counters and the optimizer's count uncommitted, and a jitted step
compiled twice (a tiny MoE's Four Over Six QAT step: 5.9 s more at -O0).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["commit_state", "commit_tree"]


def commit_tree(tree: Any) -> Any:
    """`tree` with every uncommitted array and NumPy value (an execution record) committed to where the tree's
    committed arrays are: their one device, or replicated on their mesh (with none committed: where the arrays
    are). An uncommitted array already there keeps its buffer. Tracers are left as they are, and so is every leaf
    when the committed arrays are on several meshes or devices (jit refuses a mix of committed placements; an
    uncommitted leaf goes wherever the others are)."""
    leaves = [x for x in jax.tree.leaves(tree) if _concrete(x)]
    home = _home([x.sharding for x in leaves if x.committed] or [x.sharding for x in leaves])

    def commit(x: Any) -> Any:
        if home is not None and ((_concrete(x) and not x.committed) or isinstance(x, np.ndarray)):
            return jax.device_put(x, home)
        return x

    return jax.tree.map(commit, tree)


def commit_state(model: nnx.Module) -> None:
    """:func:`commit_tree` of `model`'s state, in place."""
    nnx.update(model, commit_tree(nnx.state(model)))


def _concrete(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def _home(shardings: list[jax.sharding.Sharding]) -> jax.sharding.Sharding | None:
    """Where a value that belongs to no device goes: the one device all `shardings` are on, or their mesh,
    replicated; None when they differ (or there are none)."""
    devices = {frozenset(s.device_set) for s in shardings}
    if len(devices) != 1:
        return None
    (only,) = devices
    if len(only) == 1:
        return jax.sharding.SingleDeviceSharding(next(iter(only)))
    meshes = {s.mesh for s in shardings if isinstance(s, NamedSharding)}
    return NamedSharding(meshes.pop(), PartitionSpec()) if len(meshes) == 1 else None
