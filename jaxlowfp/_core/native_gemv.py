"""The native CPU GEMV of a packed NVFP4 weight (``packed_gemv.cc``, an XLA FFI custom call): build, load, call.

``nvfp4_gemv(x, codes, scales, g, tile_rows=R)`` computes ``y [M, N] = x [M, K] @ W'`` with ``W'^T [N, K] =
(e2m1(codes) * e4m3(scales)) * g``, each weight exactly the library's dequantized value (q * s is exact in float32,
then one rounding by g), accumulated in float32 in an order of its own. It reads the packed codes (4 bits), the
block scales and ``g`` directly and decodes them in registers: at M = 1 the product is bound by the bytes it reads,
7x fewer than a float32 GEMV's (issue 44's decode path).

The C++ source is compiled on first use (``$CXX``, else g++, c++ or clang++; ``-O3``, no ``-march``: an AVX2 + FMA
path is chosen at run time by the CPU's own flags, else plain C++) into a cache directory keyed by the hash of the
source, the jaxlib version and the flags (``$JAXLOWFP_NATIVE_CACHE``, default ``~/.cache/jaxlowfp/native``), written
to a temporary name and renamed into place, so concurrent processes may build at once. ``make setup`` builds it up
front (``python -m jaxlowfp._core.native_gemv``). :func:`status` says whether it is usable and, if not, why
(``JAXLOWFP_NATIVE=0`` turns it off); `jaxlowfp.backends.plan` reports it in ``Plan.form`` / ``Plan.reason``.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlowfp._core import minifloat, nvfp4_blocks

__all__ = ["TARGET", "TARGET_LUT8", "SOURCE", "status", "available", "library_path", "build", "nvfp4_gemv",
           "lut8_gemv", "LUT8_KINDS"]

TARGET = "jaxlowfp_nvfp4_gemv"
TARGET_LUT8 = "jaxlowfp_lut8_gemv"
LUT8_KINDS = ("fp8", "hif8")  # 8-bit codes with one tensor scale
SOURCE = Path(__file__).with_name("packed_gemv.cc")
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno")
_COMPILERS = ("g++", "c++", "clang++")


def _jaxlib_version() -> str:
    import jaxlib

    return str(jaxlib.__version__)


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or None
    for c in _COMPILERS:
        found = shutil.which(c)
        if found:
            return found
    return None


def cache_dir() -> Path:
    env = os.environ.get("JAXLOWFP_NATIVE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxlowfp" / "native"


def library_path() -> Path:
    """Where the shared library of this source, jaxlib and flags lives (built or not)."""
    h = hashlib.sha256()
    h.update(SOURCE.read_bytes())
    h.update(_jaxlib_version().encode())
    h.update(" ".join(FLAGS).encode())
    return cache_dir() / f"packed_gemv-{h.hexdigest()[:20]}.so"


def build() -> Path:
    """Compile the kernel into :func:`library_path` if it is not there (atomic: a temporary file renamed into place).
    Raises ``RuntimeError`` with the compiler's message, or when no compiler is found."""
    lib = library_path()
    if lib.exists():
        return lib
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler found ($CXX or one of {', '.join(_COMPILERS)} on PATH)")
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.name + ".", suffix=".tmp", dir=lib.parent)
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def _load() -> tuple[bool, str]:
    if os.environ.get("JAXLOWFP_NATIVE", "1") == "0":
        return False, "turned off (JAXLOWFP_NATIVE=0)"
    try:
        lib = build()
        handle = ctypes.cdll.LoadLibrary(str(lib))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handle.JaxlowfpNvfp4Gemv), platform="cpu")
        jax.ffi.register_ffi_target(TARGET_LUT8, jax.ffi.pycapsule(handle.JaxlowfpLut8Gemv), platform="cpu")
    except Exception as e:  # noqa: BLE001 (reported, never silent: status() and Plan.reason carry it)
        return False, f"the native kernel could not be built or loaded: {e}"
    return True, f"native CPU GEMV ({lib})"


def status() -> tuple[bool, str]:
    """(usable, why): builds and registers the kernel on first call (once a process)."""
    return _load()


def available() -> bool:
    return _load()[0]


def _call(x: jax.Array, codes: jax.Array, scales: jax.Array, g: jax.Array, tile_rows: int, isa: int,
          threads: int) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], codes.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
        x, codes, scales, g, tile_rows=np.int64(tile_rows), isa=np.int64(isa), threads=np.int64(threads))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _gemv(x, codes, scales, g, tile_rows, isa, threads):
    return _call(x, codes, scales, g, tile_rows, isa, threads)


def _gemv_fwd(x, codes, scales, g, tile_rows, isa, threads):
    return _call(x, codes, scales, g, tile_rows, isa, threads), (codes, scales, g)


def _gemv_bwd(tile_rows, isa, threads, res, ct):
    codes, scales, g = res
    n, k = codes.shape[0], codes.shape[1] * 2
    wt = nvfp4_blocks.dequantize_blocks(codes, scales, g, rows=tile_rows, shape=(n, k), dtype=jnp.float32)
    return ct @ wt, None, None, None  # the packed weight is frozen: no cotangent for codes, scales, g


_gemv.defvjp(_gemv_fwd, _gemv_bwd)


def nvfp4_gemv(x: Any, codes: Any, scales: Any, g: Any, *, tile_rows: int = 1, isa: str = "auto",
               threads: int = 0) -> jax.Array:
    """``x [M, K] @ W' [K, N]`` for the NVFP4 array of ``W'^T [N, K]`` (`codes` uint8 [N, K/2], `scales`
    float8_e4m3fn [N / tile_rows, K / 16], `g` the float32 decode scale) on the native kernel: float32 [M, N].
    `isa`: "auto" (AVX2 + FMA when the CPU has them) or "generic" (plain C++). `threads`: 0 for XLA's intra-op
    pool size, 1 for this thread only. Differentiable in `x` (the weight is frozen). Raises ``TypeError`` /
    ``ValueError`` for other dtypes or shapes and ``RuntimeError`` when the kernel is unavailable (:func:`status`)."""
    x, codes, scales = jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scales)
    g = jnp.asarray(g)
    if x.dtype != jnp.float32 or codes.dtype != jnp.uint8 or scales.dtype != jnp.float8_e4m3fn:
        raise TypeError(f"nvfp4_gemv takes x float32, codes uint8, scales float8_e4m3fn; got x {x.dtype}, codes "
                        f"{codes.dtype}, scales {scales.dtype}")
    if g.size != 1 or not jnp.issubdtype(g.dtype, jnp.floating):
        raise TypeError(f"nvfp4_gemv: g is one float32 decode scale; got {g.dtype} of shape {tuple(g.shape)}")
    if tile_rows not in (1, 16):
        raise ValueError(f"nvfp4_gemv: tile_rows is 1 (1x16 blocks) or 16 (16x16 tiles); got {tile_rows!r}")
    if isa not in ("auto", "generic"):
        raise ValueError(f"nvfp4_gemv: isa is 'auto' or 'generic'; got {isa!r}")
    if x.ndim != 2 or codes.ndim != 2 or scales.ndim != 2:
        raise ValueError(f"nvfp4_gemv takes x [M, K], codes [N, K/2], scales [N/R, K/16]; got shapes "
                         f"{tuple(x.shape)}, {tuple(codes.shape)}, {tuple(scales.shape)}")
    m, k = x.shape
    n = codes.shape[0]
    if k % 16 or codes.shape[1] * 2 != k or scales.shape != (n // tile_rows, k // 16) or n % tile_rows:
        raise ValueError(f"nvfp4_gemv: x [M, K] = {tuple(x.shape)} needs K % 16 == 0, codes [N, K/2] and scales "
                         f"[N/{tile_rows}, K/16]; got codes {tuple(codes.shape)}, scales {tuple(scales.shape)}")
    ok, why = status()
    if not ok:
        raise RuntimeError(f"nvfp4_gemv: {why}")
    return _gemv(x, codes, scales, g.astype(jnp.float32).reshape(()), tile_rows, 0 if isa == "auto" else 1,
                 int(threads))


def _lut(kind: str) -> jax.Array:
    """The 256 values of `kind`'s codes in float32, by the library's own decode (QArray.values)."""
    codes = jnp.arange(256, dtype=jnp.uint8)
    if kind == "hif8":
        return minifloat.HIF8.decode(codes, jnp.float32)
    return jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)


def _call8(x, codes, scale, kind, isa):
    out = jax.ShapeDtypeStruct((x.shape[0], codes.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGET_LUT8, out, vmap_method="sequential")(x, codes, _lut(kind), scale,
                                                                         isa=np.int64(isa))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gemv8(x, codes, scale, kind, isa):
    return _call8(x, codes, scale, kind, isa)


def _gemv8_fwd(x, codes, scale, kind, isa):
    return _call8(x, codes, scale, kind, isa), (codes, scale)


def _gemv8_bwd(kind, isa, res, ct):
    codes, scale = res
    c = codes if codes.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(codes, jnp.uint8)
    return ct @ (_lut(kind)[c] * scale), None, None


_gemv8.defvjp(_gemv8_fwd, _gemv8_bwd)


def lut8_gemv(x: Any, codes: Any, scale: Any, *, kind: str, isa: str = "auto") -> jax.Array:
    """``x [M, K] @ W' [K, N]`` for 8-bit codes of ``W'^T [N, K]`` with one tensor scale (`kind` "fp8":
    float8_e4m3fn codes; "hif8": uint8 HiF8 codes) on the native kernel: ``w = value(q) * scale`` (one rounding,
    exactly ``QArray.dequantize``), float32 [M, N]. Differentiable in `x`. Errors as :func:`nvfp4_gemv`."""
    x, codes, scale = jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scale)
    if kind not in LUT8_KINDS:
        raise ValueError(f"lut8_gemv: kind is one of {LUT8_KINDS}; got {kind!r}")
    want = jnp.float8_e4m3fn if kind == "fp8" else jnp.uint8
    if x.dtype != jnp.float32 or codes.dtype != want:
        raise TypeError(f"lut8_gemv({kind}) takes x float32 and codes {jnp.dtype(want).name}; got x {x.dtype}, "
                        f"codes {codes.dtype}")
    if scale.size != 1:
        raise TypeError(f"lut8_gemv: scale is one float32 value; got shape {tuple(scale.shape)}")
    if isa not in ("auto", "generic"):
        raise ValueError(f"lut8_gemv: isa is 'auto' or 'generic'; got {isa!r}")
    if x.ndim != 2 or codes.ndim != 2 or x.shape[1] != codes.shape[1]:
        raise ValueError(f"lut8_gemv takes x [M, K] and codes [N, K]; got shapes {tuple(x.shape)}, "
                         f"{tuple(codes.shape)}")
    ok, why = status()
    if not ok:
        raise RuntimeError(f"lut8_gemv: {why}")
    return _gemv8(x, codes, scale.astype(jnp.float32).reshape(()), kind, 0 if isa == "auto" else 1)


if __name__ == "__main__":  # make setup: build up front
    ok, why = status()
    print(f"jaxlowfp native GEMV: {'ok' if ok else 'NOT available'}: {why}")
    raise SystemExit(0 if ok else 1)
