"""Device mesh for `--mesh data=2,fsdp=2`: data parallelism and FSDP over `jax.sharding`.

* The batch is sharded over ``("data", "fsdp")`` along its leading axis: every device sees its own rows.
* Parameters and optimizer moments are sharded over ``"fsdp"`` along their largest dimension that ``fsdp``
  divides, replicated otherwise; small state (amax histories, counters, RNG) is replicated.
* Amax is a ``jnp.max`` over the *global* activation inside the jitted step, so XLA inserts the all-reduce and
  every replica computes the same scale (tested in tests/test_train_loop.py).

Multi-host: call `initialize_distributed()` first (it runs `jax.distributed.initialize()` when
``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` are set, or on a cluster JAX detects by
itself, e.g. SLURM or Cloud TPU with ``JAX_DISTRIBUTED=1``); `jax.devices()` then spans all hosts, each process
feeds its local rows (`global_batch`), and the same step runs unchanged.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "AXES",
    "BATCH_AXES",
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

AXES = ("data", "fsdp")
BATCH_AXES = ("data", "fsdp")


def parse_mesh(spec: str) -> dict[str, int]:
    """``"data=2,fsdp=2"`` -> ``{"data": 2, "fsdp": 2}``; missing axes are 1."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"mesh must look like 'data=2,fsdp=2' (axes: {', '.join(AXES)}); got {spec!r}")
    sizes = {a: 1 for a in AXES}
    seen = set()
    for part in spec.split(","):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in AXES or name in seen:
            raise ValueError(
                f"mesh axis {part.strip()!r} in {spec!r} is not valid; write axis=size with axes from "
                f"{', '.join(AXES)}, each at most once (e.g. 'data=2,fsdp=2')")
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size <= 0:
            raise ValueError(f"mesh axis {name!r} needs a positive int size; got {value.strip()!r} in {spec!r}")
        sizes[name] = size
        seen.add(name)
    return sizes


def make_mesh(spec: str | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``("data", "fsdp")`` mesh over `devices` (default all, across hosts); spec None: data over all of them."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": len(devices), "fsdp": 1} if spec is None else parse_mesh(spec)
    n = sizes["data"] * sizes["fsdp"]
    if n != len(devices):
        raise ValueError(f"mesh {spec!r} needs data*fsdp = {n} devices; {len(devices)} are available "
                         f"({jax.default_backend()})")
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes["data"], sizes["fsdp"]), AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis over data and fsdp together; the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def param_spec(shape: Sequence[int], fsdp: int, *, min_size: int = 1024) -> P:
    """Shard the largest dimension that `fsdp` divides; replicate small or indivisible arrays."""
    if fsdp == 1 or int(np.prod(shape, dtype=np.int64)) < min_size:
        return P()
    order = sorted(range(len(shape)), key=lambda i: -shape[i])
    for i in order:
        if shape[i] % fsdp == 0:
            spec: list[Any] = [None] * len(shape)
            spec[i] = "fsdp"
            return P(*spec)
    return P()


def param_shardings(tree: Any, mesh: Mesh, *, min_size: int = 1024) -> Any:
    """A NamedSharding per leaf of `tree` (arrays or ShapeDtypeStructs) by `param_spec`."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree.map(lambda x: NamedSharding(mesh, param_spec(np.shape(x), fsdp, min_size=min_size)), tree)


def shard(tree: Any, shardings: Any, *, copy: bool = False) -> Any:
    """`jax.device_put` each leaf with its sharding (a single sharding applies to every leaf).

    ``copy=True`` gives every leaf a buffer of its own, shared with neither the input nor another leaf (needed
    before donating the result to a jitted step). ``device_put(..., may_alias=False)`` is not enough: a
    replicated put may reuse the source buffer on its device, and NNX states often hold one array in two places.

    Multi-host: every process passes the same values (e.g. the state built from the same seed); each builds only
    its own shards of the global arrays (`jax.make_array_from_callback`, always fresh buffers) after one check that
    all processes hold the same values. (`jax.device_put` would instead compare every leaf across processes, one
    collective per leaf.)
    """
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    if jax.process_count() > 1:
        return _shard_multiprocess(tree, shardings, copy=copy)
    if copy:
        tree = jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
    return jax.tree.map(jax.device_put, tree, shardings)


def _is_global(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _shard_multiprocess(tree: Any, shardings: Any, *, copy: bool) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    shards = treedef.flatten_up_to(shardings)
    host = [None if _is_global(x) else np.asarray(x) for x in leaves]  # this process's copy of a local value
    assert_same_on_every_process([h for h in host if h is not None], what="train.mesh.shard")

    def put(x: Any, h: np.ndarray | None, s: jax.sharding.Sharding) -> jax.Array:
        if h is None:  # already a global array: a (collective) reshard
            return jax.device_put(jnp.array(x, copy=True) if copy else x, s)
        return jax.make_array_from_callback(h.shape, s, lambda index: h[index])

    return treedef.unflatten([put(x, h, s) for x, h, s in zip(leaves, host, shards)])


def assert_same_on_every_process(arrays: Sequence[np.ndarray], *, what: str) -> None:
    """Raise ValueError unless every process passes the same arrays (compared by a SHA-256 digest: one
    all-gather of 32 bytes, whatever the number of arrays)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        digest.update(f"{a.dtype.str}{a.shape}".encode())
        digest.update(a.tobytes())
    mine = np.frombuffer(digest.digest(), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [process_count, 32]
    differ = [i for i in range(every.shape[0]) if not np.array_equal(every[i], every[0])]
    if differ:
        raise ValueError(f"{what}: processes {differ} hold other values than process 0 ({len(arrays)} arrays "
                         "compared); every process must pass the same ones (build the state from the same seed "
                         "and inputs on every host)")


def global_batch(local: np.ndarray, mesh: Mesh) -> jax.Array:
    """This process's rows -> the global batch array sharded by `batch_sharding` (single- and multi-host)."""
    sharding = batch_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(local, sharding)
    return jax.make_array_from_process_local_data(sharding, local)


_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize_distributed() -> bool:
    """Run `jax.distributed.initialize()` for a multi-host job; a no-op on one host.

    Explicit: set JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES and JAX_PROCESS_ID on every host.
    Auto-detected clusters (SLURM, Open MPI, Cloud TPU): set JAX_DISTRIBUTED=1. Must run before any JAX
    computation. Returns whether it initialized.
    """
    explicit = all(os.environ.get(k) for k in _ENV)
    if not explicit and os.environ.get("JAX_DISTRIBUTED", "") not in ("1", "true", "True"):
        return False
    if explicit:
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()
    return True
