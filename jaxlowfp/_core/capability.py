"""Which Pallas kernel exists, on which Pallas backend, and whether it can run here: the data behind
``jaxlowfp.dispatch``.

The kernel table names each kernel's module and function by string, so neither the library nor the kernels import
each other to register one (``jaxlowfp.dispatch.kernel`` imports on first use). Capability checks return
``(ok, reason)`` like Transformer Engine's, so callers can log why a path was taken. Kernels call
:func:`resolve_interpret` for their own ``interpret=`` argument.
"""
from __future__ import annotations

import dataclasses
import os

import jax

INTERPRET_ENV = "JAXLOWFP_PALLAS_INTERPRET"
BACKENDS = ("triton", "mosaic")
_TRUE = ("1", "true", "yes", "on")


class PallasUnavailableError(RuntimeError):
    """``impl="pallas"`` was asked for where the Pallas kernel cannot run (and no interpret mode was requested)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelRequirements:
    """What a Pallas kernel needs from the GPU.

    Attributes:
      min_compute_capability: e.g. 80 for sm_80. Pallas-Triton needs sm_80; Mosaic GPU needs sm_90.
      why: one line explaining the minimum, used in error messages.
    """

    min_compute_capability: int
    why: str

    def __post_init__(self):
        if not isinstance(self.min_compute_capability, int) or self.min_compute_capability < 70:
            raise ValueError(f"min_compute_capability must be an int >= 70; got {self.min_compute_capability!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelTarget:
    """One implementation of a kernel: ``target`` is ``"module:function"``; `requires` its GPU minimum."""

    target: str
    requires: KernelRequirements


# The kernels do all rounding with integer/bit math and store uint8 codes and scale bytes (the fp8 view is taken
# outside the kernel), so none needs the sm_89 fp8 cast; sm_80 is Pallas-Triton's own minimum.
TRITON_MIN = KernelRequirements(min_compute_capability=80, why="Pallas-Triton needs compute capability >= 8.0")
MOSAIC_MIN = KernelRequirements(min_compute_capability=90, why="Mosaic GPU needs compute capability >= 9.0")

# kernel name -> Pallas backend -> implementation
KERNELS: dict[str, dict[str, KernelTarget]] = {
    "hif8.scaled_fake_quant": {
        "triton": KernelTarget(target="jaxlowfp_pallas.hif8:scaled_fake_quant", requires=TRITON_MIN),
        "mosaic": KernelTarget(target="jaxlowfp_pallas.mosaic_hif8:scaled_fake_quant", requires=MOSAIC_MIN),
    },
    "nvfp4.quantize": {
        "triton": KernelTarget(target="jaxlowfp_pallas.nvfp4:quantize", requires=TRITON_MIN),
        "mosaic": KernelTarget(target="jaxlowfp_pallas.mosaic_nvfp4:quantize", requires=MOSAIC_MIN),
    },
    "nvfp4.fake_quantize": {
        "triton": KernelTarget(target="jaxlowfp_pallas.nvfp4:fake_quantize", requires=TRITON_MIN),
        "mosaic": KernelTarget(target="jaxlowfp_pallas.mosaic_nvfp4:fake_quantize", requires=MOSAIC_MIN),
    },
}


def kernel_target(kernel: str, pallas_backend: str = "triton") -> KernelTarget:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not a Pallas kernel of jaxlowfp; known kernels: {sorted(KERNELS)}")
    if pallas_backend not in KERNELS[kernel]:
        raise ValueError(f"kernel {kernel!r} has no pallas_backend={pallas_backend!r}; allowed: "
                         f"{sorted(KERNELS[kernel])}")
    return KERNELS[kernel][pallas_backend]


def interpret_forced() -> bool:
    """True when ``JAXLOWFP_PALLAS_INTERPRET`` is set to 1/true/yes/on (case-insensitive)."""
    return os.environ.get(INTERPRET_ENV, "").strip().lower() in _TRUE


def compute_capability(device) -> int | None:
    """Compute capability as an int (``"9.0"`` -> 90), or None when the device does not report a CUDA one."""
    cc = getattr(device, "compute_capability", None)
    if not isinstance(cc, str):
        return None
    try:
        major, minor = cc.split(".")
        return int(major) * 10 + int(minor)
    except ValueError:  # e.g. ROCm reports "gfx90a"
        return None


def pallas_capability(kernel: str, device: jax.Device | None = None, *, pallas_backend: str = "triton"
                      ) -> tuple[bool, str]:
    """Whether the compiled (non-interpret) Pallas `kernel` on `pallas_backend` can run on `device` (default: JAX's
    first device). Returns ``(ok, reason)``; `reason` says what was found and, when not ok, what is needed."""
    req = kernel_target(kernel, pallas_backend).requires
    if device is None:
        device = jax.devices()[0]
    platform = device.platform
    if platform != "gpu":
        return False, (
            f"the device is {platform!r} ({device.device_kind}); Pallas has no {platform} compiler for jaxlowfp's "
            f"kernels, only interpret mode (interpret=True or {INTERPRET_ENV}=1)"
        )
    cc = compute_capability(device)
    if cc is None:
        return False, (
            f"GPU {device.device_kind!r} does not report a CUDA compute capability (got "
            f"{getattr(device, 'compute_capability', None)!r}); jaxlowfp's kernels are built and tested for NVIDIA only"
        )
    try:
        if pallas_backend == "triton":
            from jax.experimental.pallas import triton as _plt  # noqa: F401
        else:
            from jax.experimental.pallas import mosaic_gpu as _plgpu  # noqa: F401
    except ImportError as e:  # a JAX without that Pallas backend
        return False, f"this JAX ({jax.__version__}) has no Pallas {pallas_backend} backend: {e}"
    if cc < req.min_compute_capability:
        return False, (
            f"{device.device_kind} has compute capability {cc / 10:.1f}; {kernel} needs >= "
            f"{req.min_compute_capability / 10:.1f} ({req.why})"
        )
    return True, (f"{device.device_kind} (compute capability {cc / 10:.1f}) runs {kernel} with Pallas "
                  f"{pallas_backend}")


def resolve_interpret(interpret: bool | None, *, kernel: str, pallas_backend: str = "triton") -> bool:
    """The `interpret` flag a Pallas kernel entry point runs with.

    True/False are taken as given (False with no GPU is how kernels are cross-compiled for a GPU from a CPU host).
    None means: interpret mode if ``JAXLOWFP_PALLAS_INTERPRET`` is set, else the compiled kernel if the device
    supports it, else :class:`PallasUnavailableError`.
    """
    if isinstance(interpret, bool):
        return interpret
    if interpret is not None:
        raise TypeError(f"interpret must be True, False or None; got {interpret!r}")
    if interpret_forced():
        return True
    ok, reason = pallas_capability(kernel, pallas_backend=pallas_backend)
    if ok:
        return False
    raise PallasUnavailableError(
        f"the Pallas kernel {kernel} cannot be compiled here: {reason}. Pass interpret=True (or set "
        f"{INTERPRET_ENV}=1) to run it in interpret mode, or use the jnp implementation."
    )
