"""The library's own exception types, below every floor that raises them (`jaxlowfp.models` and `jaxlowfp.ptq` both
refuse damaged checkpoints with a `CheckpointError`; `jaxlowfp.models.CheckpointError` is this class)."""
from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; the message names the file (and tensor) and says what was expected."""
