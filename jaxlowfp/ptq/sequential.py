"""Sequential (block-by-block) calibration: each block's statistics come from the outputs of the blocks already
quantized, and only one block's statistics are held at a time.

The GPTQ paper (Frantar et al. 2022, section 4: "we quantize layer by layer, feeding the inputs of block k+1 with the
outputs of the already quantized block k") and llm-compressor's sequential pipeline (``pipelines/sequential/
pipeline.py`` in llm-compressor 0.14: calibrate a subgraph, compress it, propagate its quantized outputs) do this.
With ``X_0 = embed(tokens)`` for every calibration batch::

    for block k = 0, 1, ...:
        stats_k   = statistics of block k's target layers on X_k        (one pass over the calibration batches)
        process(block k's layers, stats_k)                               (folds, then GPTQ / RTN of the weights)
        X_{k+1}   = block_k(X_k) with its quantized weights             (propagate; stats_k is dropped)
    layers outside every block (e.g. a head): statistics on head(X_N), then process

Within a block every layer sees the block's unquantized earlier layers during its calibration pass (as in
llm-compressor). A mixture-of-experts block's expert weights are calibrated on the same ``X_k`` (`run`'s
``block_hooks``, `jaxlowfp.ptq.experts`: each expert on the rows block k's router sends it) and quantized before
the block's linear layers. ``propagate="quantized"`` runs the quantized block as it is deployed (weights and run-time
activation quantization), ``"weights"`` with its activations in high precision (llm-compressor: its pipeline runs
under ``DisableQuantization``, so only the weights are quantized while propagating).

On a mesh (a model placed by `jaxlowfp.sharding`) every ``X_k`` has its rows over the mesh's data axes, so the
statistics (``X^T X``, amax, computed by `jaxlowfp.ptq.calibrate`'s jitted step) are reduced over the devices by
XLA's collectives and only the reduced ``[in, in]`` / ``[in]`` values reach the host.

Memory: the calibration activations ``X_k`` (n_batches x [batch, seq, d_model]) plus one block's statistics
(Hessians [in, in] of its layers), not the whole model's; `run` returns the largest number of bytes of statistics and
activations it held at once.

The model says its block structure with a ``ptq_blocks()`` method (`jaxlowfp.models.Llama` has one):
``(embed, blocks, head)``, ``embed(model, batch) -> X_0``, ``blocks = [(path, call), ...]`` in order with
``call(block_module, X) -> X``, ``head(model, X)`` the rest of the model (for target layers outside the blocks).
Module-level functions (not fresh lambdas) let the identical blocks share one compilation.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxlowfp._core.placement import commit_tree
from jaxlowfp._core.progress import progress_bar
from jaxlowfp.ptq import calibrate
from jaxlowfp.ptq.experts import RaggedActQuant, grouped_weights
from jaxlowfp.ptq.layers import default_hook, hook_name

PROPAGATE = ("quantized", "weights")


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A model's ``ptq_blocks()``, checked: `embed`, `blocks` [(path, call)], `head`."""

    embed: Callable[[nnx.Module, Any], Any]
    blocks: tuple[tuple[str, Callable[[nnx.Module, Any], Any]], ...]
    head: Callable[[nnx.Module, Any], Any] | None


def model_blocks(model: nnx.Module, mods: Mapping[str, Any]) -> Blocks:
    """The checked ``model.ptq_blocks()`` (ValueError naming what is missing or wrong)."""
    own = getattr(model, "ptq_blocks", None)
    if not callable(own):
        raise ValueError(f"sequential calibration: a {type(model).__name__} does not say its block structure (it has "
                         "no ptq_blocks() method); use pipeline='one-pass'")
    got = own()
    if not (isinstance(got, tuple) and len(got) == 3):
        raise TypeError(f"{type(model).__name__}.ptq_blocks() must return (embed, blocks, head); got {got!r}")
    embed, blocks, head = got
    blocks = tuple((str(p), c) for p, c in blocks)
    if not callable(embed) or not blocks or not all(callable(c) for _, c in blocks):
        raise TypeError(f"{type(model).__name__}.ptq_blocks(): embed and every block call must be callables and "
                        f"there must be at least one block; got embed={embed!r}, blocks={blocks[:2]!r}")
    for p, _ in blocks:
        if not isinstance(mods.get(p), nnx.Module):
            raise ValueError(f"{type(model).__name__}.ptq_blocks(): no module at block path {p!r}")
    return Blocks(embed=embed, blocks=blocks, head=head if callable(head) else None)


def owner(path: str, blocks: Blocks) -> str | None:
    """The block path that contains layer `path` (None: outside every block)."""
    for p, _ in blocks.blocks:
        if path.startswith(p + "/"):
            return p
    return None


def _nbytes(tree: Any) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")))


def stats_bytes(stats: Mapping[str, calibrate.LayerStats]) -> int:
    return sum(_nbytes(dataclasses.astuple(s)) for s in stats.values())


def _rows_on_mesh(state: Any) -> Callable[[Any], Any]:
    """For a model on a mesh (`jaxlowfp.sharding`): place an activation with its rows over the mesh's data axes
    (`sharding.rows_sharding`; XLA would otherwise keep the layout the embedding gives, the model dimension split),
    so each device calibrates on its own rows and the statistics' sums over rows are XLA's collectives. Identity
    without a mesh."""
    from jaxlowfp import sharding

    mesh = next((x.sharding.mesh for x in jax.tree.leaves(state)
                 if isinstance(x, jax.Array) and isinstance(x.sharding, jax.sharding.NamedSharding)
                 and len(x.sharding.device_set) > 1), None)
    if not isinstance(mesh, jax.sharding.Mesh):
        return lambda x: x

    def place(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.ndim == 0:
            return x
        return jax.device_put(x, sharding.rows_sharding(mesh, x.shape[0]))

    return place


@functools.partial(jax.jit, static_argnums=(0, 3))
def _embed(graphdef, state, batch, fn):
    return fn(nnx.merge(graphdef, state), batch)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _propagate(graphdef, state, x, fn, act_quant: bool):
    block = nnx.merge(graphdef, state)
    if not act_quant:  # llm-compressor's DisableQuantization: only the (already quantized) weights act
        for mod in calibrate.quantizable_modules(block).values():
            setattr(mod, hook_name(mod), default_hook(mod))
        for _, mod, name in grouped_weights(block):  # quantized experts: their routed rows in high precision too
            if isinstance(getattr(mod, "quant_" + name, None), RaggedActQuant):
                setattr(mod, "quant_" + name, None)
    return fn(block, x)


def run(model: nnx.Module, mods: Mapping[str, Any], blocks: Blocks, batches: Sequence[Any], targets: Sequence[str],
        process: Callable[[list[str], dict[str, calibrate.LayerStats]], None], *, hessian: bool,
        samples_per_batch: int, propagate: str = "quantized", progress: bool = False,
        block_hooks: Mapping[str, Callable[[nnx.Module, Sequence[Any], Callable], int]] | None = None
        ) -> tuple[dict[str, float], int]:
    """Calibrate and quantize `targets` block by block (module docstring). ``process(paths, stats)`` quantizes
    the layers at `paths` (full paths) with their statistics `stats` in place. ``block_hooks[path](block, X_k,
    call)`` calibrates and quantizes what else block `path` holds (its experts, `jaxlowfp.ptq.experts`) on the same
    inputs, after the block's layer statistics are taken and before `process` (so both see the block unquantized),
    and returns the bytes of statistics it held. Returns ({path: activation amax}, the peak bytes of statistics and
    calibration activations held at once)."""
    if propagate not in PROPAGATE:
        raise ValueError(f"propagate={propagate!r} is not supported; allowed: {', '.join(map(repr, PROPAGATE))}")
    hooks = dict(block_hooks or {})
    unknown = sorted(set(hooks) - {p for p, _ in blocks.blocks})
    if unknown:
        raise ValueError(f"sequential calibration: block_hooks name {unknown[:3]}, which are not blocks of "
                         f"ptq_blocks() ({[p for p, _ in blocks.blocks][:3]} ...)")
    by_block: dict[str | None, list[str]] = {}
    for t in targets:
        by_block.setdefault(owner(t, blocks), []).append(t)
    g, s = nnx.split(model)
    rows = _rows_on_mesh(s)
    xs = [rows(_embed(g, s, b, blocks.embed)) for b in batches]
    del g, s
    act_amax: dict[str, float] = {}
    peak = _nbytes(xs)
    # the blocks' outputs are needed up to the last block that calibrates something (all of them for the head's)
    last = len(blocks.blocks) if None in by_block else max(
        (j for j, (p, _) in enumerate(blocks.blocks) if p in by_block or p in hooks), default=-1)
    bar = progress_bar(list(blocks.blocks), desc="sequential", enabled=progress)
    for i, (path, call) in enumerate(bar):
        block = mods[path]
        mine = by_block.get(path, [])
        if mine or path in hooks:
            stats: dict[str, calibrate.LayerStats] = {}
            if mine:
                rel = [t[len(path) + 1:] for t in mine]
                st = calibrate.collect(block, rel, xs, forward=call, hessian=hessian,
                                       samples_per_batch=samples_per_batch)
                stats = {f"{path}/{r}": v for r, v in st.items()}
                del st
            held = hooks[path](block, xs, call) if path in hooks else 0
            peak = max(peak, _nbytes(xs) + stats_bytes(stats) + held)
            act_amax.update({p: float(np.max(v.amax)) for p, v in stats.items()})
            if mine:
                process(mine, stats)
            del stats
        if i < last:
            g, s = nnx.split(block)
            xs = [rows(_propagate(g, *commit_tree((s, x)), call, propagate == "quantized")) for x in xs]
            del g, s
    rest = by_block.get(None, [])
    if rest:
        if blocks.head is None:
            raise ValueError(f"sequential calibration: layers {rest[:4]} are outside every block of ptq_blocks() and "
                             "the model gives no head; use pipeline='one-pass'")
        stats = calibrate.collect(model, rest, xs, forward=blocks.head, hessian=hessian,
                                  samples_per_batch=samples_per_batch)
        peak = max(peak, _nbytes(xs) + stats_bytes(stats))
        act_amax.update({p: float(np.max(v.amax)) for p, v in stats.items()})
        process(rest, stats)
    return act_amax, peak
