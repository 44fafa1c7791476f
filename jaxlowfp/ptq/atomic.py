"""All-or-nothing writes of an export (`jaxlowfp.ptq.export`, `jaxlowfp.ptq.export_gguf`): a target that holds
files is refused unless ``overwrite=True``, and the new files appear under the target's name only once complete
(written to a temporary sibling, then renamed)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path

from jaxlowfp.ptq.export_layout import META_FILE, WEIGHTS_FILE, tensor_digests

class TargetExistsError(FileExistsError, ValueError):
    """An export's target exists and is not empty (pass ``overwrite=True`` to replace it)."""


def target_check(target: str | Path, overwrite: bool, what: str = "export") -> None:
    """Refuse a `target` that exists and is not empty (a directory with files, or a file) unless `overwrite`:
    exporting into an older export would mix the two."""
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool; got {type(overwrite).__name__}")
    t = Path(target)
    if overwrite or not t.exists():
        return
    if t.is_dir():
        held = sorted(p.name for p in t.iterdir())
        if held:
            raise TargetExistsError(f"{what}: {t} is not empty ({', '.join(held[:4])}{' ...' if len(held) > 4 else ''}"
                                    f"); refusing to write into it. Pass overwrite=True to replace it, or choose "
                                    f"an empty or new directory")
    else:
        raise TargetExistsError(f"{what}: {t} exists; refusing to overwrite it. Pass overwrite=True to replace it")


@contextlib.contextmanager
def write_atomically(target: str | Path, overwrite: bool = False, *, directory: bool = True):
    """Yield a temporary sibling path of `target` (a new empty directory if `directory`, else a file path not yet
    made) to write into; on success it is renamed to `target` (an existing `target`, allowed by `overwrite`, is
    moved aside first and deleted after), on any error it is deleted: `target` is never seen half written."""
    target = Path(target)
    target_check(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = target.with_name(f".{target.name}.tmp-{tag}")
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        old = None
        if target.exists():
            target_check(target, overwrite)  # nothing appeared there meanwhile
            old = target.with_name(f".{target.name}.old-{tag}")
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
        raise


def record_digests(directory: Path) -> None:
    """Add each written tensor's SHA-256 (`tensor_digests`) to ``jaxlowfp_ptq.json``: `load` verifies them."""
    meta_path = directory / META_FILE
    meta = json.loads(meta_path.read_text())
    meta["sha256"] = tensor_digests(directory / WEIGHTS_FILE)
    meta_path.write_text(json.dumps(meta, indent=1))
