"""Device mesh for `--mesh data=2,fsdp=2`: data parallelism and FSDP over `jax.sharding`, the library's
`jaxlowfp.sharding` on the app's two axes.

* The batch is sharded over ``("data", "fsdp")`` along its leading axis: every device sees its own rows.
* Parameters and optimizer moments are sharded over ``"fsdp"`` along their largest dimension that ``fsdp``
  divides, replicated otherwise; small state (amax histories, counters, RNG) is replicated
  (`jaxlowfp.sharding.param_spec`).
* Amax is a ``jnp.max`` over the *global* activation inside the jitted step, so XLA inserts the all-reduce and
  every replica computes the same scale (tested in tests/test_train_loop.py).

Multi-host: call `initialize_distributed()` first (see `jaxlowfp.sharding.initialize_distributed`);
`jax.devices()` then spans all hosts, each process feeds its local rows (`global_batch`), and the same step runs
unchanged.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlowfp import sharding as _lib
from jaxlowfp.sharding import (assert_same_on_every_process, batch_sharding, global_batch, initialize_distributed,
                               param_shardings, param_spec, replicated, shard)

__all__ = [
    "AXES",
    "BATCH_AXES",
    "Mesh",
    "NamedSharding",
    "P",
    "parse_mesh",
    "make_mesh",
    "batch_sharding",
    "replicated",
    "param_spec",
    "param_shardings",
    "shard",
    "assert_same_on_every_process",
    "global_batch",
    "initialize_distributed",
]

AXES = ("data", "fsdp")  # the app's --mesh axes
BATCH_AXES = AXES


def parse_mesh(spec: str) -> dict[str, int]:
    """``"data=2,fsdp=2"`` -> ``{"data": 2, "fsdp": 2}``; missing axes are 1."""
    return _lib.parse_mesh(spec, AXES)


def make_mesh(spec: str | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``("data", "fsdp")`` mesh over `devices` (default all, across hosts); spec None: data over all of them."""
    return _lib.make_mesh(spec, devices, axes=AXES)
