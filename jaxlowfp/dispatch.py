"""Choosing between the jnp ("xla") and Pallas ("pallas") implementation of a hot-path kernel; the one place where
the library looks a kernel up.

- ``impl="xla"`` always runs the pure-jnp twin.
- ``impl="pallas"`` runs the Pallas kernel where it can run (a CUDA GPU whose compute capability the kernel
  supports, or interpret mode, forced by ``interpret=True`` or by ``JAXLOWFP_PALLAS_INTERPRET=1``) and raises
  :class:`PallasUnavailableError` elsewhere, naming the kernel and the reason: it never falls back silently.
- ``impl="auto"`` picks the Pallas kernel only on a GPU that supports it *and* for a configuration recorded as
  verified bit-exact on such a device (``verified_kernels.json``, written by ``make gpu-check``); otherwise the
  twin, and it says so once in the log (logger ``jaxlowfp.dispatch``). Interpret mode is a test tool, never
  chosen by "auto" on its own.

Kernels are found by name through :data:`KERNELS` (``"module:function"`` strings, imported on first use), so the
library never imports ``pallas_kernels`` (installed as ``jaxlowfp_pallas``) at import time and the kernels never
import the library.

>>> from jaxlowfp import dispatch
>>> dispatch.resolve_impl("auto", kernel="nvfp4.quantize")   # on a CPU
'xla'
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import functools
import importlib
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import jax

from jaxlowfp._core.capability import (
    BACKENDS as PALLAS_BACKENDS,
    INTERPRET_ENV,
    KERNELS,
    KernelRequirements,
    PallasUnavailableError,
    interpret_forced,
    kernel_target,
    pallas_capability,
    resolve_interpret,
)
from jaxlowfp._core.checks import one_of
from jaxlowfp._core.deprecation import deprecated_getattr

__all__ = [
    "IMPLS",
    "PALLAS_BACKENDS",
    "INTERPRET_ENV",
    "KERNELS",
    "KernelRequirements",
    "PallasUnavailableError",
    "VERIFIED_PATH",
    "interpret_forced",
    "kernel",
    "pallas_capability",
    "resolve_impl",
    "resolve_interpret",
    "verified",
]

Impl = Literal["auto", "xla", "pallas"]
IMPLS = ("auto", "xla", "pallas")
VERIFIED_PATH = Path(__file__).with_name("verified_kernels.json")
log = logging.getLogger(__name__)


def kernel(name: str, pallas_backend: str = "triton") -> Callable[..., Any]:
    """The Pallas entry point of kernel `name` on `pallas_backend` (imported on first use)."""
    one_of(pallas_backend, PALLAS_BACKENDS, "pallas_backend")
    module, function = kernel_target(name, pallas_backend).target.split(":")
    try:
        return getattr(importlib.import_module(module), function)
    except ModuleNotFoundError as e:  # a checkout run without installing (make gpu-check): its pallas_kernels/
        if e.name != "jaxlowfp_pallas":
            raise
        return getattr(importlib.import_module(module.replace("jaxlowfp_pallas", "pallas_kernels", 1)), function)


@functools.lru_cache(maxsize=1)
def _verified_entries() -> tuple[dict[str, Any], ...]:
    if not VERIFIED_PATH.exists():
        return ()
    data = json.loads(VERIFIED_PATH.read_text())
    if data.get("schema") != 1:
        raise ValueError(f"{VERIFIED_PATH}: schema {data.get('schema')!r} is not supported; expected 1")
    return tuple(data.get("entries", ()))


def verified(name: str, *, pallas_backend: str = "triton", device: jax.Device | None = None,
             config: Mapping[str, Any] | None = None) -> bool:
    """Whether `name` on `pallas_backend` was recorded bit-exact on a device of `device`'s kind for `config` (the
    entries' ``rule``, ``block_shape`` and ``dtype`` where given; keys the entry does not name match anything)."""
    device = jax.devices()[0] if device is None else device
    want = {k: (list(v) if isinstance(v, tuple) else v) for k, v in (config or {}).items()}
    for e in _verified_entries():
        if e.get("kernel") != name or e.get("backend") != pallas_backend or e.get("device_kind") != device.device_kind:
            continue
        if all(k not in e or e[k] == v for k, v in want.items()):
            return True
    return False


@functools.lru_cache(maxsize=256)
def _say_once(message: str) -> None:
    log.info(message)


def resolve_impl(impl: str, *, kernel: str, interpret: bool | None = None, pallas_backend: str = "triton",
                 config: Mapping[str, Any] | None = None) -> Literal["xla", "pallas"]:
    """Which implementation runs `kernel` for the user's ``impl`` setting (see the module docstring).

    `config` (``rule``, ``block_shape``, ``dtype``) is what ``"auto"`` looks up in the verified table.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not supported for {kernel}; allowed: {', '.join(map(repr, IMPLS))}")
    one_of(pallas_backend, PALLAS_BACKENDS, "pallas_backend")
    kernel_target(kernel, pallas_backend)
    if interpret is not None and not isinstance(interpret, bool):
        raise TypeError(f"interpret must be True, False or None; got {interpret!r}")
    if impl == "xla":
        return "xla"
    if impl == "auto" and interpret is True:
        return "pallas"
    ok, reason = pallas_capability(kernel, pallas_backend=pallas_backend)
    if impl == "auto":
        if not ok:
            return "xla"
        if verified(kernel, pallas_backend=pallas_backend, config=config):
            return "pallas"
        _say_once(f"impl='auto': {kernel} ({pallas_backend}, {dict(config or {})}) is not recorded as verified on "
                  f"{jax.devices()[0].device_kind}; running the jnp twin (run `make gpu-check` to verify)")
        return "xla"
    if ok or interpret is True or (interpret is None and interpret_forced()):
        return "pallas"
    raise PallasUnavailableError(
        f"impl='pallas' was requested for {kernel}, but it cannot run here: {reason}. "
        f"Use impl='xla' (same numerics), impl='auto', or interpret mode (interpret=True or {INTERPRET_ENV}=1)."
    )


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)

# old name (one release): BACKENDS are the Pallas backends; jaxlowfp.backends.BACKENDS are the GEMM backends
__getattr__ = deprecated_getattr(__name__, {"BACKENDS": ("jaxlowfp.dispatch.PALLAS_BACKENDS",
                                                         lambda: PALLAS_BACKENDS)})
