"""Checkpoints of the training state with orbax: exact resume, atomic saves, no poisoned checkpoints.

One checkpoint per saved step under ``<dir>/<step>/`` holds two items:

* ``state``: the whole functional training state pytree (params, optimizer state, amax state, the rest of the
  NNX state, step and skip counters, RNG key, data-stream position), saved with `ocp.args.StandardSave` and
  restored into an abstract target with the same shardings, so a resumed run continues bit for bit;
* ``meta``: JSON (the config, a schema version, anything the caller adds).

Atomicity is orbax's: a save is written to a temporary directory and renamed when complete, so a process
killed mid-save (SIGKILL) leaves at worst an unfinished temporary directory that `latest_step` never returns and
the next manager cleans up. A state whose checked subtrees (params and optimizer state by default) hold a NaN or
Inf is refused both ways: `save` raises instead of writing it, `restore` raises instead of returning it.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["SCHEMA_VERSION", "CheckpointError", "Checkpointer", "nonfinite_leaves", "abstract_like"]

SCHEMA_VERSION = 1
log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint that must not be written or read (non-finite values, wrong schema, nothing to resume)."""


@jax.jit
def _finite_flags(leaves: list[jax.Array]) -> list[jax.Array]:
    return [jnp.all(jnp.isfinite(x)) for x in leaves]


def nonfinite_leaves(tree: Any) -> list[str]:
    """Key paths of the floating leaves of `tree` that hold a NaN or Inf (one jitted reduction per leaf)."""
    flat = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not flat:
        return []
    flags = jax.device_get(_finite_flags([x for _, x in flat]))
    return [jax.tree_util.keystr(p) for (p, _), ok in zip(flat, flags) if not ok]


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with the shardings of jax arrays) of `tree`: a restore target."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _get(tree: Any, key: str) -> Any:
    """`key` is a dict key or attribute name; dots go deeper (``"train.params"``)."""
    for part in key.split("."):
        tree = tree[part] if isinstance(tree, Mapping) else getattr(tree, part)
    return tree


class Checkpointer:
    """An orbax `CheckpointManager` over ``directory`` that refuses non-finite states.

    `checked` names the fields of the state (dict keys or NamedTuple attributes, dotted for nested ones, e.g.
    ``"train.params"``) that must be finite.
    """

    def __init__(self, directory: str | Path, *, max_to_keep: int = 2, checked: Sequence[str] = ("params", "opt_state"),
                 async_save: bool = False) -> None:
        self.directory = Path(directory).absolute()
        self.checked = tuple(checked)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=True,
            cleanup_tmp_directories=True,  # leftovers of a save killed mid-way
            enable_async_checkpointing=async_save,
        )
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def _nonfinite(self, state: Any) -> list[str]:
        bad = []
        for key in self.checked:
            bad += [f"{key}{p}" for p in nonfinite_leaves(_get(state, key))]
        return bad

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mgr.all_steps())

    def _refuse_nonfinite(self, state: Any, action: str) -> None:
        bad = self._nonfinite(state)
        if bad:
            msg = f"refusing to {action}: non-finite values in {len(bad)} array(s), first {bad[:3]}"
            log.error(msg)
            raise CheckpointError(msg)

    def save(self, step: int, state: Any, meta: Mapping[str, Any] | None = None) -> None:
        """Write `state` at `step` (atomically); raise CheckpointError, writing nothing, if it is non-finite."""
        self._refuse_nonfinite(state, f"save step {step} to {self.directory}")
        meta = {"schema_version": SCHEMA_VERSION, **dict(meta or {})}
        self._mgr.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(_host_leaves_as_arrays(state)), meta=ocp.args.JsonSave(meta)), force=True)
        self._mgr.wait_until_finished()

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """The state at `step` (default latest) in the structure, dtypes and shardings of `target`, and its meta.

        `target` is a live state or its `abstract_like`. Raises CheckpointError if there is no checkpoint, the
        schema differs, or the restored state is non-finite.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint to restore in {self.directory}")
        abstract = abstract_like(_host_leaves_as_arrays(target))
        out = self._mgr.restore(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        meta = dict(out.meta)
        if meta.get("schema_version") != SCHEMA_VERSION:
            raise CheckpointError(f"checkpoint {self.directory}/{step} has schema_version "
                                  f"{meta.get('schema_version')!r}; this code reads {SCHEMA_VERSION}")
        state = _like_target(out.state, target)
        self._refuse_nonfinite(state, f"restore {self.directory}/{step}")
        return state, meta

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _host_leaves_as_arrays(tree: Any) -> Any:
    # orbax takes jax/numpy arrays, not numpy scalars or Python numbers (data-stream positions are often those)
    return jax.tree.map(lambda x: x if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))
                        else np.asarray(x), tree)


def _like_target(restored: Any, target: Any) -> Any:
    # numpy leaves of the target (host-side data position) come back as numpy of the same dtype
    def fix(r: Any, t: Any) -> Any:
        if isinstance(t, (np.ndarray, np.generic, int, float)) and not isinstance(t, jax.Array):
            return np.asarray(r, dtype=np.asarray(t).dtype)
        return r

    return jax.tree.map(fix, restored, target)
