"""Shared plumbing for the Pallas kernels: interpret/compile choice, block validation, cross-lowering for a GPU.

Pallas-Triton rules the kernels follow (docs/kernels.md): every in-kernel array has a power-of-two element count
(at most 2^20), the ragged last block is masked on load/store (interpret mode pads it with NaN, a GPU leaves it
unspecified, so reductions mask by index), no captured constant arrays, no ``jnp.round``, no float division in
rounding decisions, shift amounts in [0, 31].
"""
from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxlowfp._core.capability import resolve_interpret

__all__ = [
    "GPU_TARGETS",
    "TRITON_CALL",
    "MAX_BLOCK_ELEMENTS",
    "check_pow2",
    "compiler_params",
    "triton_lowering",
    "lower_for_gpu",
    "resolve_interpret",
    "valid_mask",
]

TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call a Pallas-Triton kernel lowers to
MAX_BLOCK_ELEMENTS = 1 << 20  # Triton's cap on the element count of one tensor

# Targets for cross-lowering from a host without a GPU: name -> (device_kind, SM count).
GPU_TARGETS: dict[str, tuple[str, int]] = {
    "sm_80 (A100)": ("NVIDIA A100-SXM4-80GB", 108),
    "sm_90 (H100)": ("NVIDIA H100 80GB HBM3", 132),
    "sm_90 (H200)": ("NVIDIA H200", 132),
    "sm_100 (B200)": ("NVIDIA B200", 148),
}


def check_pow2(value, what: str, *, lo: int = 1, hi: int = MAX_BLOCK_ELEMENTS) -> int:
    """`value` if it is an int power of two in [lo, hi], else a ValueError saying what is allowed."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1 and not value & (value - 1)
    if not ok or not lo <= value <= hi:
        raise ValueError(f"{what} must be a power of two in [{lo}, {hi}] (a Pallas-Triton rule); got {value!r}")
    return value


_TRITON_DEPRECATION = r".*Pallas Triton backend is deprecated.*"
log = logging.getLogger("pallas_kernels")


@functools.lru_cache(maxsize=1)
def _say_triton_once() -> None:
    log.info("JAX deprecates the Pallas Triton backend; jaxlowfp keeps Triton as its default GPU backend until its "
             "Mosaic GPU kernels (backend='mosaic', sm_90+) are verified on a device by `make gpu-check`")


@contextlib.contextmanager
def triton_lowering(interpret: bool) -> Iterator[None]:
    """Around the first call (trace and lowering) of a compiled Triton kernel: JAX's deprecation warning of the
    Triton backend is replaced by one log line saying why jaxlowfp still chooses it. Interpret mode never lowers
    to Triton, so nothing changes there; other warnings pass through."""
    if interpret:
        yield
        return
    _say_triton_once()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)
        yield


def compiler_params(interpret: bool, num_warps: int):
    """Triton compiler parameters (always explicit: on JAX 0.10 the default GPU backend is Mosaic GPU)."""
    if interpret:
        return None
    check_pow2(num_warps, "num_warps", hi=32)
    return plt.CompilerParams(num_warps=num_warps, num_stages=1)


def valid_mask(shape: tuple[int, ...], axis: int, block: int, size: int) -> jnp.ndarray:
    """Inside a kernel: True where the block's index along `axis` (grid axis `axis`) is inside the array (< size)."""
    idx = pl.program_id(axis) * block + lax.broadcasted_iota(jnp.int32, shape, axis)
    return idx < size


def lower_for_gpu(fn, *args, target: str = "sm_90 (H100)", **kwargs) -> str:
    """StableHLO text of the jitted `fn(*args, **kwargs)` lowered for the CUDA GPU `target` (a key of GPU_TARGETS).

    Works on a host without a GPU: the Pallas -> Triton lowering is Python plus MLIR, told the target through an
    AbstractDevice. `args` may be ``jax.ShapeDtypeStruct``. Triton's GPU passes and ptxas are not run (they run
    inside XLA at compile time on a GPU host).
    """
    if target not in GPU_TARGETS:
        raise ValueError(f"target={target!r} is not supported; allowed: {sorted(GPU_TARGETS)}")
    kind, cores = GPU_TARGETS[target]
    if not hasattr(fn, "trace"):
        fn = jax.jit(fn)
    with triton_lowering(interpret=False):
        if not hasattr(jax.sharding, "AbstractDevice"):  # JAX 0.10: no abstract devices; lowering assumes sm_90
            return fn.trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()
        ad = jax.sharding.AbstractDevice(device_kind=kind, num_cores=cores, platform="gpu")
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=ad)):
            return fn.trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()
