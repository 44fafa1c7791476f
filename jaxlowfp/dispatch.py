"""Choosing between the jnp ("xla") and Pallas ("pallas") implementation of a hot-path kernel.

``impl="xla"`` always runs the pure-jnp twin. ``impl="pallas"`` runs the Pallas kernel where it can run (a CUDA GPU
whose compute capability the kernel supports, or interpret mode, forced by ``interpret=True`` or by the environment
variable ``JAXLOWFP_PALLAS_INTERPRET=1``) and raises :class:`PallasUnavailableError` elsewhere, naming the kernel and
the reason: it never falls back silently. ``impl="auto"`` picks Pallas on a GPU that supports the kernel and XLA
elsewhere (interpret mode is a test tool, never chosen by "auto").

Capability checks return ``(ok, reason)`` like Transformer Engine's, so callers can log why a path was taken.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Literal

import jax

__all__ = [
    "IMPLS",
    "INTERPRET_ENV",
    "KERNELS",
    "KernelRequirements",
    "PallasUnavailableError",
    "interpret_forced",
    "pallas_capability",
    "resolve_impl",
    "resolve_interpret",
]

Impl = Literal["auto", "xla", "pallas"]
IMPLS = ("auto", "xla", "pallas")
INTERPRET_ENV = "JAXLOWFP_PALLAS_INTERPRET"
_TRUE = ("1", "true", "yes", "on")


class PallasUnavailableError(RuntimeError):
    """``impl="pallas"`` was asked for where the Pallas kernel cannot run (and no interpret mode was requested)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelRequirements:
    """What a Pallas kernel needs from the GPU.

    Attributes:
      min_compute_capability: e.g. 80 for sm_80. Pallas-Triton needs sm_80; kernels that cast to fp8 need sm_89.
      why: one line explaining the minimum, used in error messages.
    """

    min_compute_capability: int
    why: str

    def __post_init__(self):
        if not isinstance(self.min_compute_capability, int) or self.min_compute_capability < 70:
            raise ValueError(f"min_compute_capability must be an int >= 70; got {self.min_compute_capability!r}")


# Every kernel in pallas_kernels, by the name used in errors and in `resolve_impl(kernel=...)`.
# The kernels do all rounding with integer/bit math and store uint8 codes and scale bytes (the fp8 view is taken
# outside the kernel), so none needs the sm_89 fp8 cast; sm_80 is Pallas-Triton's own minimum.
_TRITON_MIN = KernelRequirements(min_compute_capability=80, why="Pallas-Triton needs compute capability >= 8.0")
KERNELS: dict[str, KernelRequirements] = {
    "hif8.scaled_fake_quant": _TRITON_MIN,
    "nvfp4.quantize": _TRITON_MIN,
    "nvfp4.fake_quantize": _TRITON_MIN,
}


def _requirements(kernel: str) -> KernelRequirements:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not a Pallas kernel of jaxlowfp; known kernels: {sorted(KERNELS)}")
    return KERNELS[kernel]


def interpret_forced() -> bool:
    """True when ``JAXLOWFP_PALLAS_INTERPRET`` is set to 1/true/yes/on (case-insensitive)."""
    return os.environ.get(INTERPRET_ENV, "").strip().lower() in _TRUE


def _compute_capability(device) -> int | None:
    """Compute capability as an int (``"9.0"`` -> 90), or None when the device does not report a CUDA one."""
    cc = getattr(device, "compute_capability", None)
    if not isinstance(cc, str):
        return None
    try:
        major, minor = cc.split(".")
        return int(major) * 10 + int(minor)
    except ValueError:  # e.g. ROCm reports "gfx90a"
        return None


def pallas_capability(kernel: str, device: jax.Device | None = None) -> tuple[bool, str]:
    """Whether the compiled (non-interpret) Pallas `kernel` can run on `device` (default: JAX's first device).

    Returns ``(ok, reason)``; `reason` says what was found and, when not ok, what is needed.
    """
    req = _requirements(kernel)
    if device is None:
        device = jax.devices()[0]
    platform = device.platform
    if platform != "gpu":
        return False, (
            f"the device is {platform!r} ({device.device_kind}); Pallas has no {platform} compiler for jaxlowfp's "
            f"kernels, only interpret mode (interpret=True or {INTERPRET_ENV}=1)"
        )
    cc = _compute_capability(device)
    if cc is None:
        return False, (
            f"GPU {device.device_kind!r} does not report a CUDA compute capability (got "
            f"{getattr(device, 'compute_capability', None)!r}); jaxlowfp's kernels are built and tested for NVIDIA only"
        )
    try:
        from jax.experimental.pallas import triton as _plt  # noqa: F401
    except ImportError as e:  # a future JAX without Pallas-Triton
        return False, f"this JAX ({jax.__version__}) has no Pallas-Triton backend: {e}"
    if cc < req.min_compute_capability:
        return False, (
            f"{device.device_kind} has compute capability {cc / 10:.1f}; {kernel} needs >= "
            f"{req.min_compute_capability / 10:.1f} ({req.why})"
        )
    return True, f"{device.device_kind} (compute capability {cc / 10:.1f}) runs {kernel} with Pallas-Triton"


def resolve_impl(impl: str, *, kernel: str, interpret: bool | None = None) -> Literal["xla", "pallas"]:
    """Which implementation runs `kernel` for the user's ``impl`` setting.

    - ``"xla"``: always ``"xla"``.
    - ``"pallas"``: ``"pallas"`` if `interpret` is True, the interpret env var is set, or the device supports the
      compiled kernel; otherwise :class:`PallasUnavailableError` saying why.
    - ``"auto"``: ``"pallas"`` when the device supports the compiled kernel (or `interpret` is True), else ``"xla"``.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not supported for {kernel}; allowed: {', '.join(map(repr, IMPLS))}")
    _requirements(kernel)
    if interpret is not None and not isinstance(interpret, bool):
        raise TypeError(f"interpret must be True, False or None; got {interpret!r}")
    if impl == "xla":
        return "xla"
    ok, reason = pallas_capability(kernel)
    if impl == "auto":
        return "pallas" if ok or interpret is True else "xla"
    if ok or interpret is True or (interpret is None and interpret_forced()):
        return "pallas"
    raise PallasUnavailableError(
        f"impl='pallas' was requested for {kernel}, but it cannot run here: {reason}. "
        f"Use impl='xla' (same numerics), impl='auto', or interpret mode (interpret=True or {INTERPRET_ENV}=1)."
    )


def resolve_interpret(interpret: bool | None, *, kernel: str) -> bool:
    """The `interpret` flag a Pallas kernel entry point runs with.

    True/False are taken as given (False with no GPU is how kernels are cross-lowered for a GPU from a CPU host).
    None means: interpret mode if ``JAXLOWFP_PALLAS_INTERPRET`` is set, else the compiled kernel if the device
    supports it, else :class:`PallasUnavailableError`.
    """
    if isinstance(interpret, bool):
        return interpret
    if interpret is not None:
        raise TypeError(f"interpret must be True, False or None; got {interpret!r}")
    if interpret_forced():
        return True
    ok, reason = pallas_capability(kernel)
    if ok:
        return False
    raise PallasUnavailableError(
        f"the Pallas kernel {kernel} cannot be compiled here: {reason}. Pass interpret=True (or set "
        f"{INTERPRET_ENV}=1) to run it in interpret mode, or use the jnp implementation."
    )
