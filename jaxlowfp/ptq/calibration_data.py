"""What PTQ checks and prepares before it changes a model: the calibration data as batches, each refused when it
holds a NaN / Inf or, for the default forward ``model(tokens)``, token ids or row lengths the model does not accept
(`calibration_batches`), and the storage dtype the quantized model is evaluated and exported in
(`round_high_precision`, `STORAGE_DTYPES`). Used by `jaxlowfp.ptq.quantize_model`.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlowfp.ptq import checks

__all__ = ["STORAGE_DTYPES", "calibration_batches", "check_batch", "local_values", "round_high_precision",
           "split_batches"]

STORAGE_DTYPES = ("float32", "bfloat16", "float16")


def round_high_precision(model: nnx.Module, dtype: str, skip: set[str]) -> None:
    """Round every parameter of 2 or more dimensions not in `skip` (the quantized weights) to `dtype` and back, in
    place: the values `jaxlowfp.ptq.export` writes in that dtype. All are checked first (a value that overflows
    `dtype` is refused, naming the parameter), so a refusal changes nothing."""
    if dtype == "float32":
        return
    low = jnp.dtype(dtype)
    todo = []
    for p, v in nnx.iter_graph(model):
        path = "/".join(map(str, p))
        if not isinstance(v, nnx.Param) or path in skip or v[...].ndim < 2:
            continue
        x = v[...]
        if x.dtype == low:
            continue
        y = x.astype(low).astype(x.dtype)
        checks.check_finite_tensor(y, f"{path} rounded to {dtype}",
                                   action="refusing to quantize with this storage dtype (its values overflow it: "
                                          "use dtype='float32' or 'bfloat16'); nothing was changed")
        todo.append((v, y))
    for v, y in todo:
        v.set_value(y)


def local_values(x: Any) -> np.ndarray:
    """The values of `x` this process holds: all of them, or, for an array spanning processes, its addressable shards
    (flattened; each process checks its own part)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.concatenate([np.asarray(s.data).ravel() for s in x.addressable_shards])
    return np.asarray(x)


def check_batch(i: int, batch: Any, forward_is_default: bool, model: Any) -> None:
    """Refuse a calibration batch with NaN / Inf values (any floating-point leaf), or, for the default forward
    (``model(tokens)``), token ids outside the model's vocabulary or rows longer than its maximum sequence length
    (``model.config.vocab`` / ``max_seq_len``, when the model says them)."""
    for j, leaf in enumerate(jax.tree.leaves(batch)):
        if not hasattr(leaf, "dtype"):
            continue
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            found = checks.describe_nonfinite(local_values(leaf))
            if found is not None:
                raise ValueError(f"calibration batch {i}{f' (leaf {j})' if j else ''}: {found}; calibration data "
                                 f"must be finite (a NaN would vanish from the amax on some backends and be "
                                 f"written into the scales)")
    if not forward_is_default:
        return
    cfg = getattr(model, "config", None)
    vocab, max_len = getattr(cfg, "vocab", None), getattr(cfg, "max_seq_len", None)
    tokens, row = local_values(batch), int(np.shape(batch)[-1]) if np.ndim(batch) else 0
    if isinstance(max_len, int) and row > max_len:
        raise ValueError(f"calibration batch {i} has rows of {row} tokens; the model's maximum sequence "
                         f"length is {max_len} (model.config.max_seq_len): its forward refuses longer rows, so "
                         f"calibrating on them describes no input the model accepts. Cut the rows to {max_len}")
    if isinstance(vocab, int) and tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ValueError(f"calibration batch {i} holds token ids from {int(tokens.min())} to {int(tokens.max())}; "
                         f"allowed: 0 to {vocab - 1} (model.config.vocab = {vocab}); an id outside is no token of "
                         f"this model (its embedding lookup would clamp or NaN)")


def calibration_batches(calibration: Any, batch_size: int, forward_is_default: bool, model: Any = None) -> list[Any]:
    """Calibration data as a list of batches: an int array [n, seq] (split into batches of `batch_size` rows) or
    an iterable of batches; each checked (`check_batch`)."""
    out = split_batches(calibration, batch_size, forward_is_default)
    for i, b in enumerate(out):
        check_batch(i, b, forward_is_default, model)
    return out


def split_batches(calibration: Any, batch_size: int, forward_is_default: bool) -> list[Any]:
    """`calibration` as a list of batches, unchecked (`calibration_batches` checks them)."""
    if isinstance(calibration, (np.ndarray, jax.Array)):
        arr = calibration
        if forward_is_default and (arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"calibration must be an integer token array [n_sequences, seq_len] for the default "
                             f"forward (model(tokens)); got shape {tuple(arr.shape)} dtype {arr.dtype}. Pass "
                             f"forward=... for other inputs")
        if arr.ndim < 1 or arr.shape[0] == 0:
            raise ValueError(f"calibration needs at least one row; got shape {tuple(arr.shape)}")
        return [jnp.asarray(arr[i:i + batch_size]) for i in range(0, arr.shape[0], batch_size)]
    if isinstance(calibration, Iterable) and not isinstance(calibration, (str, bytes)):
        out = list(calibration)
        if not out:
            raise ValueError("calibration is an empty iterable; give at least one batch")
        if forward_is_default:
            for i, b in enumerate(out):
                if getattr(b, "ndim", None) != 2 or not np.issubdtype(np.asarray(b).dtype, np.integer):
                    raise ValueError(f"calibration batch {i} must be an integer token array [batch, seq_len] for the "
                                     f"default forward; got {type(b).__name__} shape {getattr(b, 'shape', None)}")
        return out
    raise TypeError(f"calibration must be a token array or an iterable of batches; got {type(calibration).__name__}")
