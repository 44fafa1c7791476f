"""Device meshes and sharding rules on JAX's own machinery (`jax.sharding.Mesh`, `NamedSharding`, `PartitionSpec`).

A mesh has up to four named axes (`AXES`); the ones not asked for have size 1, so every rule set below applies to
every mesh `make_mesh` builds::

    data    batch rows (pure data parallelism: weights replicated)
    fsdp    batch rows too, and the weights' model dimension (FSDP / ZeRO-3: XLA all-gathers a weight where used)
    tensor  the heads / hidden / vocabulary dimension of the weights (Megatron tensor parallelism)
    expert  the expert dimension of mixture-of-experts weights (`expert_rules`)

A rule set maps parameter paths to `PartitionSpec`s: a `ShardRule` names parameters by a regex matched with
`re.fullmatch` against their "/"-joined NNX graph path (``blocks/3/mlp/gate_proj/kernel``, ``embed/embedding``),
first match wins, as `jaxlowfp.rules.Rule` matches module paths. `llama_rules` is the Llama family's (MaxText's
layout: kernels ``[in, out]`` are ``P(fsdp, tensor)`` when column parallel, ``P(tensor, fsdp)`` when row parallel)::

    from jaxlowfp import sharding
    from jaxlowfp.models import load
    mesh = sharding.make_mesh("fsdp=4,tensor=2")                 # 8 devices
    model, tok = load("smollm2-135m", mesh=mesh, rules=sharding.llama_rules())   # each device reads its shards

`partition_specs` checks a rule set against a mesh and a model's parameters and raises a `ShardingError` naming the
parameter, the rule and the axis when a rule names an axis the mesh does not have, a mesh axis does not divide the
dimension it shards, a rule matches no parameter, or no rule matches a parameter.

The training helpers of the app (`train/mesh.py` re-exports them: `parse_mesh`, `make_mesh`, `batch_sharding`,
`param_spec` / `param_shardings` (automatic FSDP: the largest dimension that ``fsdp`` divides), `shard`,
`global_batch`, `initialize_distributed`) live here too, unchanged in behaviour.

Multi-host: call `initialize_distributed()` first (it runs `jax.distributed.initialize()` when
``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` are set, or on a cluster JAX detects by
itself, e.g. SLURM or Cloud TPU with ``JAX_DISTRIBUTED=1``); `jax.devices()` then spans all hosts, each process
feeds its local rows (`global_batch`), and `jax.make_array_from_callback` builds only this process's shards.
"""
from __future__ import annotations

from jaxlowfp._core.deprecation import deprecated_getattr as _deprecated_getattr
from jaxlowfp._core.surface import public_dir as _public_dir

import dataclasses
import hashlib
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "AXES",
    "BATCH_AXES",
    "Mesh",
    "P",
    "ShardRule",
    "ShardingError",
    "assert_same_on_every_process",
    "batch_sharding",
    "check_on_mesh",
    "device_bytes",
    "expert_rules",
    "fsdp_rules",
    "global_batch",
    "initialize_distributed",
    "llama_rules",
    "make_mesh",
    "model_shardings",
    "moe_rules",
    "packed_shardings",
    "param_shardings",
    "param_spec",
    "parse_mesh",
    "put_batch",
    "replicated",
    "partition_specs",
    "rows_sharding",
    "shard",
    "shard_model",
    "tensor_parallel_rules",
    "to_host",
    "variable_paths",
]

AXES = ("data", "fsdp", "tensor", "expert")
BATCH_AXES = ("data", "fsdp")


class ShardingError(ValueError):
    """A mesh, a rule set and a model do not fit together; the message names the parameter, rule and axis."""


# ---------------------------------------------------------------------------------------------------------------
# meshes


def parse_mesh(spec: str, axes: Sequence[str] = AXES) -> dict[str, int]:
    """``"data=2,fsdp=2"`` -> ``{"data": 2, "fsdp": 2, ...}`` over `axes`; missing axes are 1."""
    axes = tuple(axes)
    example = ",".join(f"{a}=2" for a in axes[:2])
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"mesh must look like {example!r} (axes: {', '.join(axes)}); got {spec!r}")
    sizes = {a: 1 for a in axes}
    seen = set()
    for part in spec.split(","):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in axes or name in seen:
            raise ValueError(
                f"mesh axis {part.strip()!r} in {spec!r} is not valid; write axis=size with axes from "
                f"{', '.join(axes)}, each at most once (e.g. {example!r})")
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size <= 0:
            raise ValueError(f"mesh axis {name!r} needs a positive int size; got {value.strip()!r} in {spec!r}")
        sizes[name] = size
        seen.add(name)
    return sizes


def make_mesh(spec: str | Mapping[str, int] | None = None, devices: Sequence[jax.Device] | None = None, *,
              axes: Sequence[str] = AXES) -> Mesh:
    """A mesh with the named `axes` (default `AXES`) over `devices` (default all, across hosts).

    ``spec``: ``"fsdp=4,tensor=2"`` or ``{"fsdp": 4, "tensor": 2}``; axes not named have size 1; None puts every
    device on the first axis (data parallelism). The product of the sizes must be the number of devices.
    """
    axes = tuple(axes)
    devices = list(jax.devices() if devices is None else devices)
    if spec is None:
        sizes = {a: 1 for a in axes} | {axes[0]: len(devices)}
    elif isinstance(spec, Mapping):
        sizes = parse_mesh(",".join(f"{k}={v}" for k, v in spec.items()), axes) if spec else {a: 1 for a in axes}
    else:
        sizes = parse_mesh(spec, axes)
    n = math.prod(sizes.values())
    if n != len(devices):
        raise ValueError(f"mesh {spec!r} needs {'*'.join(axes)} = {n} devices; {len(devices)} are available "
                         f"({jax.default_backend()})")
    return Mesh(np.asarray(devices, dtype=object).reshape([sizes[a] for a in axes]), axes)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis over the mesh's `BATCH_AXES` (data and fsdp) together; the rest replicated."""
    return NamedSharding(mesh, P(tuple(a for a in BATCH_AXES if a in mesh.axis_names)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def rows_sharding(mesh: Mesh, rows: int) -> NamedSharding:
    """`batch_sharding` when the mesh's data axes divide ``rows``, else replicated (every device all rows)."""
    batch = batch_sharding(mesh)
    split = math.prod(mesh.shape[a] for a in batch.spec[0]) if batch.spec and batch.spec[0] else 1
    return batch if rows % split == 0 else replicated(mesh)


def put_batch(x: Any, mesh: Mesh | None) -> jax.Array:
    """A host batch (rows first) as a device array: on the default device without a mesh, else placed by
    `rows_sharding` (one process; every process passes the whole batch)."""
    if mesh is None:
        return jnp.asarray(x)
    return jax.device_put(x, rows_sharding(mesh, np.shape(x)[0]))


def to_host(x: Any) -> np.ndarray:
    """The whole value of `x` as a numpy array on this process: as it is when every shard is here, else gathered
    from every process (`multihost_utils.process_allgather`, a collective: every process must call it)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:  # every process holds the whole value already
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def check_on_mesh(tree: Any, mesh: Mesh | None) -> None:
    """With a ``mesh``, raise ValueError unless every array of `tree` (an NNX state) lives on the mesh's devices
    (else `jax.jit` refuses the mixed placement later, with a message that names no parameter)."""
    if mesh is None:
        return
    devices = set(mesh.devices.flat)
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(x, jax.Array) and set(x.sharding.device_set) != devices:
            name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            raise ValueError(f"mesh= given, but parameter {name} is on {len(x.sharding.device_set)} device(s), not "
                             f"on the mesh's {len(devices)}; load the model with jaxlowfp.models.load(..., mesh=mesh)"
                             " or place it with jaxlowfp.sharding.shard_model(model, mesh, rules)")


def param_spec(shape: Sequence[int], fsdp: int, *, min_size: int = 1024) -> P:
    """Automatic FSDP: shard the largest dimension that `fsdp` divides; replicate small or indivisible arrays."""
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


# ---------------------------------------------------------------------------------------------------------------
# rules


def _spec(value: Any, where: str) -> P:
    if isinstance(value, P):
        entries = tuple(value)
    elif isinstance(value, (tuple, list)):
        entries = tuple(value)
    else:
        raise TypeError(f"{where}: spec must be a PartitionSpec or a tuple of axis names / None; got {value!r}")
    for e in entries:
        names = e if isinstance(e, tuple) else (e,)
        if not all(n is None or isinstance(n, str) for n in names) or (isinstance(e, tuple) and None in e):
            raise TypeError(f"{where}: every spec entry must be an axis name, a tuple of axis names or None; got "
                            f"{e!r} in {value!r}")
    return P(*entries)


def axes_of(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis name or a tuple of them) as a tuple."""
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardRule:
    """``path``: a regex matched with `re.fullmatch` against a parameter's "/"-joined NNX path; ``spec``: its
    `PartitionSpec` (or a tuple: one entry per leading dimension, an axis name, a tuple of axis names, or None
    for a replicated dimension; ``()`` replicates the whole parameter)."""

    path: str
    spec: Any = ()
    _regex: re.Pattern = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise TypeError(f"ShardRule.path must be a regex string; got {type(self.path).__name__}: {self.path!r}")
        try:
            regex = re.compile(self.path)
        except re.error as e:
            raise ValueError(f"ShardRule.path {self.path!r} is not a valid regular expression: {e}") from None
        object.__setattr__(self, "spec", _spec(self.spec, f"ShardRule(path={self.path!r})"))
        object.__setattr__(self, "_regex", regex)
        used = [a for e in self.spec for a in axes_of(e)]
        twice = sorted({a for a in used if used.count(a) > 1})
        if twice:
            raise ValueError(f"ShardRule(path={self.path!r}): spec {self.spec} uses mesh axis {twice[0]!r} for two "
                             "dimensions; an axis can shard one dimension only")

    def matches(self, path: str) -> bool:
        return self._regex.fullmatch(path) is not None


_COLUMN = r"blocks/\d+/(attn/[qkv]_proj|mlp/(gate|up)_proj)/kernel|lm_head/kernel"  # [d_model, out]
_ROW = r"blocks/\d+/(attn/o_proj|mlp/down_proj)/kernel"  # [in, d_model]


def llama_rules(*, fsdp: str | None = "fsdp", tensor: str | None = "tensor") -> tuple[ShardRule, ...]:
    """The Llama family (`jaxlowfp.models.Llama`: Llama, Mistral, Qwen2, Qwen3), MaxText's layout.

    Kernels are ``[in, out]``: q/k/v, gate/up and the head are column parallel, ``P(fsdp, tensor)`` (the model
    dimension over ``fsdp``, the heads / hidden / vocabulary over ``tensor``); o and down are row parallel,
    ``P(tensor, fsdp)``; the embedding ``[vocab, d_model]`` is ``P(tensor, fsdp)``; norms, biases and anything
    else are replicated. ``fsdp=None`` or ``tensor=None`` leaves that dimension unsharded (`tensor_parallel_rules`,
    `fsdp_rules`). Every rule matches a parameter of every Llama-family model (tied or not).
    """
    return (ShardRule(path=_COLUMN, spec=(fsdp, tensor)), ShardRule(path=_ROW, spec=(tensor, fsdp)),
            ShardRule(path="embed/embedding", spec=(tensor, fsdp)), ShardRule(path=".*", spec=()))


def fsdp_rules(axis: str = "fsdp") -> tuple[ShardRule, ...]:
    """FSDP for the Llama family: every kernel and the embedding sharded over ``axis`` along the model dimension
    (`llama_rules` with ``tensor=None``)."""
    return llama_rules(fsdp=axis, tensor=None)


def tensor_parallel_rules(axis: str = "tensor") -> tuple[ShardRule, ...]:
    """Megatron tensor parallelism for the Llama family: heads, MLP hidden units and vocabulary over ``axis``
    (`llama_rules` with ``fsdp=None``)."""
    return llama_rules(fsdp=None, tensor=axis)


def expert_rules(path: str, *, expert: str | None = "expert", fsdp: str | None = "fsdp", tensor: str | None = "tensor",
                 row_parallel: bool = False) -> ShardRule:
    """A rule for stacked expert weights ``[n_experts, in, out]`` (what `jax.lax.ragged_dot` takes): the expert
    dimension over ``expert`` and the rest as `llama_rules` shards a kernel (``row_parallel``: the down projection,
    ``[n_experts, d_ff, d_model]``). `moe_rules` puts them before the dense rules for `jaxlowfp.models.MoEDecoder`;
    MaxText shards its MoE weights the same way (experts over the expert axis, then fsdp / tensor).
    """
    inner = (tensor, fsdp) if row_parallel else (fsdp, tensor)
    return ShardRule(path=path, spec=(expert, *inner))


_EXPERTS_IN = r"blocks/\d+/mlp/experts/(gate|up)_proj"  # [E, d_model, d_expert]
_EXPERTS_OUT = r"blocks/\d+/mlp/experts/down_proj"  # [E, d_expert, d_model]


def moe_rules(*, expert: str | None = "expert", fsdp: str | None = "fsdp", tensor: str | None = "tensor"
              ) -> tuple[ShardRule, ...]:
    """The mixture-of-experts decoders (`jaxlowfp.models.MoEDecoder`: Qwen3-MoE, Mixtral, OLMoE): expert
    parallelism plus `llama_rules`. The stacked experts ``blocks/N/mlp/experts/{gate,up}_proj`` ``[E, d_model,
    d_expert]`` are ``P(expert, fsdp, tensor)``, ``down_proj`` ``[E, d_expert, d_model]`` ``P(expert, tensor,
    fsdp)`` (`expert_rules`); the router ``[d_model, E]`` is replicated; attention, dense layers, embedding and
    head as `llama_rules`. An axis set to None leaves its dimension unsharded."""
    return (expert_rules(_EXPERTS_IN, expert=expert, fsdp=fsdp, tensor=tensor),
            expert_rules(_EXPERTS_OUT, expert=expert, fsdp=fsdp, tensor=tensor, row_parallel=True),
            ShardRule(path=r"blocks/\d+/mlp/router/kernel", spec=()), *llama_rules(fsdp=fsdp, tensor=tensor))


def partition_specs(shapes: Mapping[str, Sequence[int]], rules: ShardRule | Sequence[ShardRule], mesh: Mesh
            ) -> dict[str, P]:
    """The `PartitionSpec` of every parameter (``{path: shape}``) under `rules` on `mesh`; raises `ShardingError`
    for an axis the mesh lacks, a mesh axis that does not divide the dimension it shards, a rule that matches no
    parameter, or a parameter no rule matches."""
    rules = (rules,) if isinstance(rules, ShardRule) else tuple(rules)
    for i, r in enumerate(rules):
        if not isinstance(r, ShardRule):
            raise TypeError(f"rules[{i}] must be a jaxlowfp.sharding.ShardRule; got {type(r).__name__}: {r!r}")
        for e in r.spec:
            for a in axes_of(e):
                if a not in mesh.axis_names:
                    raise ShardingError(f"ShardRule(path={r.path!r}) names mesh axis {a!r}, which the mesh does not "
                                        f"have (axes: {', '.join(mesh.axis_names)})")
    out: dict[str, P] = {}
    used: set[int] = set()
    for path, shape in shapes.items():
        shape = tuple(int(n) for n in shape)
        hit = next((i for i, r in enumerate(rules) if r.matches(path)), None)
        if hit is None:
            raise ShardingError(f"no sharding rule matches parameter {path} (shape {shape}); add one, e.g. "
                                "ShardRule(path='.*', spec=()) last to replicate the rest")
        used.add(hit)
        rule = rules[hit]
        if len(rule.spec) > len(shape):
            raise ShardingError(f"parameter {path} has shape {shape}, but ShardRule(path={rule.path!r}) gives "
                                f"{len(rule.spec)} dimensions: {rule.spec}")
        for d, e in enumerate(rule.spec):
            size = math.prod(mesh.shape[a] for a in axes_of(e))
            if shape[d] % size:
                raise ShardingError(
                    f"parameter {path} has shape {shape}: mesh axis {e!r} (size {size}) of ShardRule(path="
                    f"{rule.path!r}) does not divide its dimension {d} ({shape[d]}); use a mesh axis size that "
                    "divides it, or a rule that leaves that dimension unsharded")
        out[path] = rule.spec
    unused = [r.path for i, r in enumerate(rules) if i not in used]
    if unused:
        example = next(iter(shapes), "blocks/0/attn/q_proj/kernel")
        raise ShardingError(f"ShardRule(path={unused[0]!r}) matches no parameter of the model (or only ones an "
                            f"earlier rule took); parameter paths look like {example!r}")
    return out


def variable_paths(model: Any) -> dict[str, Any]:
    """``{"/"-joined NNX path: nnx.Variable}`` of every variable of `model` (e.g. ``blocks/0/attn/q_proj/kernel``)."""
    from flax import nnx

    return {"/".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}


def model_shardings(model: Any, mesh: Mesh, rules: ShardRule | Sequence[ShardRule]) -> dict[str, NamedSharding]:
    """``{path: NamedSharding}`` of every variable of an NNX `model` (built or abstract, `nnx.eval_shape`)."""
    shapes = {p: np.shape(v.get_value()) for p, v in variable_paths(model).items()}
    return {p: NamedSharding(mesh, s) for p, s in partition_specs(shapes, rules, mesh).items()}


def packed_shardings(weight: Any, spec: Any, mesh: Mesh, *, where: str = "packed weight") -> Any:
    """The shardings of a `jaxlowfp.packed.PackedWeight`'s leaves (a pytree of `NamedSharding`s of its structure,
    for `jax.device_put`) when its GEMM matrix ``W' [K, N]`` is placed by ``spec`` (``P(k_axes, n_axes)``, the
    kernel's rule): the arrays of ``W'^T`` (codes ``[N, K/2]``, block scales ``[N, K/16]`` or ``[N/16, K/16]``)
    are ``P(n_axes, k_axes)``, the global scales replicated. So a device holds whole blocks with their scales;
    a mesh axis that does not divide the packed dimension it shards is a `ShardingError` naming it.

    Stacked experts (`jaxlowfp.ptq.PackedExperts`: every leaf with a leading expert axis, ``W [E, K, N]`` placed by
    ``P(e_axes, k_axes, n_axes)``): the same, each leaf's expert axis on ``e_axes`` (global scales ``[E]``)."""
    import jax.tree_util as jtu

    entries = tuple(spec) + (None,) * (2 - len(tuple(spec)))
    if len(entries) not in (2, 3):
        raise ShardingError(f"{where}: a packed weight is W' [K, N] (or stacked experts [E, K, N]); its spec {spec} "
                            f"has {len(entries)} entries")
    lead = entries[:-2]  # () or (e_axes,)
    k_axes, n_axes = entries[-2:]

    def leaf(path: Any, x: Any) -> NamedSharding:
        shape = tuple(np.shape(x))
        if len(shape) == len(lead):
            return NamedSharding(mesh, P(*lead))
        if len(shape) != len(lead) + 2:
            raise ShardingError(f"{where}: packed leaf {jtu.keystr(path)} has shape {shape}; expected "
                                f"{len(lead) + 2}-D arrays of W'^T and {len(lead)}-D global scales")
        for d, e in enumerate((*lead, n_axes, k_axes)):
            size = math.prod(mesh.shape[a] for a in axes_of(e))
            if shape[d] % size:
                raise ShardingError(
                    f"{where}: packed leaf {jtu.keystr(path)} has shape {shape}; mesh axis {e!r} (size {size}) of "
                    f"the kernel's rule {spec} does not divide its dimension {d} ({shape[d]}): a device must hold "
                    f"whole blocks and their scales. Use a mesh axis size that divides it, or a rule that leaves "
                    f"that dimension of the kernel unsharded")
        return NamedSharding(mesh, P(*lead, n_axes, k_axes))

    return jtu.tree_map_with_path(leaf, weight)


def shard_model(model: Any, mesh: Mesh, rules: ShardRule | Sequence[ShardRule]) -> Any:
    """Place every variable of an NNX `model` by `rules` on `mesh` (in place, `jax.device_put`); returns it."""
    shardings = model_shardings(model, mesh, rules)
    for path, var in variable_paths(model).items():
        var.set_value(jax.device_put(var.get_value(), shardings[path]))
    return model


def device_bytes(tree: Any) -> dict[Any, int]:
    """Bytes every device holds of the arrays in `tree` (an NNX module, state or any pytree), from their
    ``addressable_shards``; a replicated array counts on every device that holds a copy."""
    from flax import nnx

    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    out: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for s in leaf.addressable_shards:
                out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


# ---------------------------------------------------------------------------------------------------------------
# placing host values (single- and multi-host)


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


def is_global(x: Any) -> bool:
    """Whether `x` is a jax.Array spanning devices of other processes (not fully addressable here)."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _shard_multiprocess(tree: Any, shardings: Any, *, copy: bool) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    shards = treedef.flatten_up_to(shardings)  # type: ignore[attr-defined]
    host = [None if is_global(x) else np.asarray(x) for x in leaves]  # this process's copy of a local value
    assert_same_on_every_process([h for h in host if h is not None], what="jaxlowfp.sharding.shard")

    def put(x: Any, h: np.ndarray | None, s: jax.sharding.Sharding) -> jax.Array:
        if h is None:  # already a global array: a (collective) reshard
            return jax.device_put(jnp.array(x, copy=True) if copy else x, s)
        return jax.make_array_from_callback(h.shape, s, lambda index: h[index])

    return treedef.unflatten([put(x, h, s) for x, h, s in zip(leaves, host, shards)])  # type: ignore[attr-defined]


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


# old name (one release): models.resolve finds a checkpoint; this one gives PartitionSpecs
__getattr__ = _deprecated_getattr(__name__, {"resolve": ("jaxlowfp.sharding.partition_specs",
                                                         lambda: partition_specs)})

__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
