"""Execution backends for a packed (or W4A4 / W8A8) product ``x @ W'``: where the low-precision GEMM really runs.

``packed_dot_general(x, w, dimension_numbers, gemm=..., activation=...)`` takes a
:class:`~jaxlowfp.packed.PackedWeight` (the GEMM matrix ``W' [K, N]``) and the activation format (None: weights
only). Backends, chosen like ``impl=``::

    "scaled_matmul"  jax.nn.scaled_matmul on our codes and scales: NVFP4 (E2M1 x E4M3 block scales, the two float32
                     global scales multiplied into the output), MXFP8 (E4M3 x E8M0), MXFP4 (E2M1 x E8M0). The
                     activations are quantized by OUR quantizer (`jaxlowfp.nvfp4.quantize`, Four Over Six included;
                     `jaxlowfp.mx.quantize`), then the GEMM. On sm_100+ NVFP4 and MXFP8 lower to cuDNN's
                     block-scaled GEMM (``__cudnn$blockScaledDot``), MXFP4 to a float32 dot (XLA expands it, jax
                     0.12); on CPU and TPU jax emulates it (convert, multiply, float32 dot).
    "fp8"            lax.dot_general on float8_e4m3fn operands, the per-tensor scales applied to the float32 output:
                     the pattern XLA's GEMM rewriter turns into cuBLASLt's FP8 GEMM on sm_89+
                     (``__cublas$lt$matmul$f8``).
    "dequant"        dequantize the weight and dot in the compute dtype (XLA fuses the dequantization into the
                     GEMM's operand; at M <= DECODE_THEN_DOT_ROWS, decode, the weight in a buffer, then the GEMV;
                     NVFP4 at M <= NATIVE_GEMV_ROWS on CPU: jaxlowfp's native GEMV, which reads the packed codes:
                     ``Plan.form``): every format, every device. HiF8 and IF4 have no hardware GEMM and always take it.
    "auto"           scaled_matmul on a CUDA GPU of compute capability >= 10.0 for NVFP4 W4A4 / MXFP8 W8A8; fp8 on
                     >= 8.9 for FP8 W8A8; else dequant. What it picked is logged once per (format, activation,
                     device kind).

An explicit backend that cannot run raises :class:`BackendUnavailableError` (the device) or ``ValueError`` (the
format), never falls back. :func:`plan` says what would run and why; ``return_backend=True`` returns it with the
output.

Memory (``tests/test_packed_memory.py``): every product first passes its input and the packed weight's arrays through
one ``lax.optimization_barrier`` (:func:`after_input`), so the weight's decode (dequantize, or the emulated
scaled_matmul's / float8 dot's conversions) depends on the layer's input and runs just before its product. Without
it the decode depends only on the parameters, and XLA is free to schedule every layer's decode before the first
matmul: the whole float32 model alive at once (SmolLM2-135M: 435 MB of XLA temp against float32's 15 MB). With it,
only the weights of the layers sharing one input (q/k/v, gate/up) are decoded together.

Compiled code (``tests/test_shared_quantizer.py``): a packed layer's run-time activation quantizer (W4A4 / W8A8)
runs through :func:`shared_quantizer`: on a one-device CPU process, one compiled program per (quantizer, shape) that
every layer calls, not a copy compiled into each projection of the caller's program. XLA:CPU keeps each copy's
machine code resident (an NVFP4 4/6 quantizer with its per-block errors then unrolled: ~7 MiB), so a W4A4
SmolLM2-135M forward held ~870 MiB of compiled code, five times its packed weights, and took 5.7 GB to compile.

Decode (``tests/test_native_gemv.py``): a product of M <= `NATIVE_GEMV_ROWS` rows (decode, short prompts) of an NVFP4
weight in jaxlowfp's arithmetic (or FP8 / HiF8: ``w = value(q) s``), float32 activations, on CPU, runs
``jaxlowfp._core.native_gemv`` (form
"native-gemv"), a C++ kernel called through the XLA FFI: ``y[m, n] = sum_k x[m, k] ((e2m1(q[n, k]) s[n, k/16]) g)``,
each weight the dequantized value bit for bit, decoded in registers from the 4-bit codes (a GEMV reads 4.5 bits a
parameter instead of 32). W4A4 fake-quantizes the activations in XLA first. Where the kernel cannot be built (no C++
compiler) the XLA form runs and ``Plan.reason`` says why.

Exactness (``tests/test_packed.py``): every backend computes ``sum_k x̂_k ŵ_k`` for the same quantized values as the
fake-quant path (``fake_quantize(x) @ dequantize(W)``); the block-scaled and FP8 backends factor the global scales out
of the sum (``(sum (q s)(q s)) * (g_x g_w)`` instead of ``sum ((q s) g_x)((q s) g_w)``), and each product of
codes and block scales is exact in float32, so results differ only by float32 rounding of those scalings and of the
summation order.
"""
from __future__ import annotations

from jaxlowfp._core.deprecation import renamed_kwarg
from jaxlowfp._core.surface import public_dir as _public_dir

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from jaxlowfp import formats, mx, nvfp4
from jaxlowfp._core.capability import compute_capability
from jaxlowfp._core.checks import one_of
from jaxlowfp._core.pytree import pytree_dataclass
from jaxlowfp._core.format import MX_ELEMENT, Format
from jaxlowfp._core.qarray import QArray, block_scales
from jaxlowfp.packed import PER_TENSOR, PackedWeight, per_tensor_scale, as_format, fake_quantize

__all__ = ["BACKENDS", "BackendUnavailableError", "Plan", "plan", "packed_dot_general", "packed_matmul",
           "SCALED_MATMUL_MIN_CC", "FP8_MIN_CC", "scaled_matmul_rows",
           "block_scaled_product", "block_scaled_rows", "fp8_product", "fp8_rows", "after_input",
           "DECODE_THEN_DOT_ROWS", "NATIVE_GEMV_ROWS", "dequant_form", "native_gemv_problem", "decode_weight",
           "shared_quantizer", "SHARED_QUANTIZER"]

BACKENDS = ("auto", "scaled_matmul", "fp8", "dequant")
# "dequant" products of at most this many rows (decode: M = batch) decode the weight into a buffer, then dot. Left to
# itself, XLA:CPU turns an M = 1 dot into a loop fusion that recomputes the decode inside the reduction
# (bench/packed_decode.py: the fused form is 2-3x slower than decode-then-GEMV at M = 1, and faster from
# M = 2 on, where the dot is a GEMM that reads the decoded operand once)
DECODE_THEN_DOT_ROWS = 1
# "dequant" products of NVFP4, FP8 and HiF8 weights with at most this many rows run on the native CPU GEMV
# (jaxlowfp._core.native_gemv) where it is available: it decodes each weight once per 4 rows in registers, so past
# a few rows XLA's GEMM of the decoded weight wins (bench/packed_decode.py)
NATIVE_GEMV_ROWS = 8
SCALED_MATMUL_MIN_CC = 100  # cuDNN's block-scaled GEMM: Blackwell (sm_100)
FP8_MIN_CC = 89  # cuBLASLt FP8: Ada (sm_89) and Hopper (sm_90)
SCALED_KINDS = ("nvfp4", "mxfp4", "mxfp8")
# run-time activation quantizers of packed layers go through one shared program (shared_quantizer): None (auto) on a
# one-device CPU process, True on any CPU, False never (compiled into each layer, as on other devices)
SHARED_QUANTIZER: bool | None = None
_log = logging.getLogger(__name__)
_LOGGED: set = set()


class BackendUnavailableError(RuntimeError):
    """An explicit backend was asked for on a device that cannot run it."""


@pytree_dataclass(data=(), meta=("backend", "native", "reason", "form"))
class Plan:
    """What a packed product runs: `backend` ("scaled_matmul", "fp8" or "dequant"), whether the low-precision GEMM is
    the device's own (`native`: cuDNN / cuBLASLt) or emulated by jax / XLA in float32, and `reason`. `form`, for
    "dequant" when the rows M of the product are known (:func:`plan`'s ``rows``): "native-gemv" (NVFP4, M <=
    `NATIVE_GEMV_ROWS`, on CPU: jaxlowfp's C++ GEMV on the packed codes; where it cannot run, `reason` says why and
    one of the XLA forms runs), "decode-then-dot" (M <=
    `DECODE_THEN_DOT_ROWS`: the weight decoded into a buffer of its own, then an ordinary dot / GEMV) or "fused"
    (the decode left to XLA, which fuses it into the dot's operand); "" otherwise. A pytree with no leaves, so a
    jitted function can return it."""

    backend: str
    native: bool
    reason: str
    form: str = ""


def _device(device: Any) -> Any:
    return jax.devices()[0] if device is None else device


def _describe(device: Any) -> str:
    cc = compute_capability(device)
    return f"{getattr(device, 'device_kind', '?')} ({device.platform}" + (
        f", compute capability {cc / 10:.1f})" if cc is not None else ")")


def _format_problem(backend: str, w: Format, act: Format | None) -> str | None:
    """Why `backend` cannot compute this weight x activation pair (None: it can)."""
    if backend == "dequant":
        return None
    if act is None:
        return (f"weights-only {w.name} (activation=None) has no low-precision GEMM: the activations stay in high "
                f"precision, so the product is a dequantize + dot; use gemm='dequant' or 'auto'")
    if backend == "scaled_matmul":
        if w.kind not in SCALED_KINDS:
            return (f"{w.name} has no block-scaled GEMM (jax.nn.scaled_matmul takes NVFP4, MXFP8 and MXFP4"
                    + ("; HiF8 has no hardware GEMM anywhere" if w.kind == "hif8" else "")
                    + ("; IF4's INT blocks have no hardware GEMM" if w.kind == "if4" else "")
                    + "); use gemm='dequant' or 'auto'")
        if act.kind != w.kind:
            return (f"scaled_matmul multiplies two operands of one format; weights {w.name} with activations "
                    f"{act.name} do not match (use activation={w.kind!r} formats, or gemm='dequant')")
        if act.rows != 1:
            return f"activations are quantized in 1x16 blocks; got {act.name}"
        return None
    if w.kind != "fp8" or act.kind != "fp8":
        return (f"gemm='fp8' multiplies FP8 E4M3 operands with per-tensor scales; got weights {w.name} and "
                f"activations {act.name} (use gemm='scaled_matmul' for NVFP4 / MX, 'dequant' otherwise)")
    return None


# Block-scaled formats XLA's GPU compiler hands to cuDNN's block-scaled GEMM. MXFP4 is not among them in jax 0.12:
# deviceless compilation for sm_100a (scripts/compile_backends.py, case "mxfp4 W4A4") expands its scaled_matmul
# into convert, multiply and a float32 dot, so it is not reported native there.
CUDNN_BLOCK_SCALED = ("nvfp4", "mxfp8")


def _device_problem(backend: str, device: Any, kind: str | None = None) -> tuple[str | None, bool, str]:
    """(problem or None, native, description) of `backend` on `device` for weights of format `kind`."""
    where = _describe(device)
    if backend == "dequant":
        return None, False, f"dequantize + dot in high precision on {where}"
    cc = compute_capability(device)
    need = SCALED_MATMUL_MIN_CC if backend == "scaled_matmul" else FP8_MIN_CC
    what = ("cuDNN's block-scaled GEMM (jax.nn.scaled_matmul)" if backend == "scaled_matmul"
            else "the cuBLASLt FP8 GEMM (float8 dot_general)")
    if device.platform in ("cpu", "tpu"):
        return None, False, f"{what} emulated by jax/XLA on {where} (convert, multiply, float32 dot)"
    if device.platform == "gpu" and cc is not None:
        if cc < need:
            return (f"{what} needs compute capability >= {need / 10:.1f}; the device is {where}. Use "
                    f"gemm='dequant' or 'auto'"), False, where
        if backend == "scaled_matmul" and kind is not None and kind not in CUDNN_BLOCK_SCALED:
            return None, False, (f"jax.nn.scaled_matmul of {kind} on {where}: XLA expands it into convert, multiply "
                                 f"and a float32 dot (no cuDNN block-scaled GEMM for {kind} in jax 0.12)")
        return None, True, f"{what} on {where}"
    return (f"{what} is built and checked for NVIDIA GPUs (compute capability >= {need / 10:.1f}), CPU and TPU "
            f"(emulated); the device is {where}. Use gemm='dequant' or 'auto'"), False, where


def plan(w: PackedWeight | Format, activation: Any = None, gemm: str = "auto", *, device: Any = None,
         where: str = "", rows: int | None = None, backend: str | None = None, dtype: Any = None,
         weight_dtype: Any = None) -> Plan:
    """The backend a product of `w` (a packed weight or its format) with `activation` runs on `device` (default JAX's
    first device). An explicit `backend` that cannot run raises (``ValueError`` for the formats,
    :class:`BackendUnavailableError` for the device); "auto" logs its choice once. `rows`: the product's M, which
    decides the "dequant" form (``Plan.form``); `dtype` (the activations', default float32) and `weight_dtype` (what
    the decoded weight is rounded to, default none) decide whether the native GEMV can take it."""
    backend = renamed_kwarg("backends.plan", "backend", backend, "gemm", gemm, "auto")
    p = _plan(w, activation, backend, device=device, where=where)
    if p.backend != "dequant" or rows is None:
        return p
    fmt = w.format if isinstance(w, PackedWeight) else as_format(w, "w")
    if rows <= NATIVE_GEMV_ROWS and _native_fits(fmt, _device(device)):
        problem = native_gemv_problem(fmt, device=device, dtype=dtype, weight_dtype=weight_dtype)
        if problem is None:
            reason = f"jaxlowfp's native GEMV on the packed codes on {_describe(_device(device))}"
            return dataclasses.replace(p, form="native-gemv", reason=reason)
        return dataclasses.replace(p, form=dequant_form(rows),
                                   reason=f"{p.reason}; native GEMV not used: {problem}")
    return dataclasses.replace(p, form=dequant_form(rows))


def _native_fits(fmt: Format, dev: Any) -> bool:
    """The native GEMV computes this format on this device (whether or not it can be built here)."""
    return dev.platform == "cpu" and (fmt.kind in ("fp8", "hif8")
                                      or (fmt.kind == "nvfp4" and fmt.arithmetic == "jaxlowfp"))


def native_gemv_problem(w: PackedWeight | Format, *, device: Any = None, dtype: Any = None,
                        weight_dtype: Any = None) -> str | None:
    """Why the native CPU GEMV (``jaxlowfp._core.native_gemv``) cannot compute a product of `w` with activations of
    `dtype` (default float32) on `device`; None when it can (building it on first call)."""
    fmt = w.format if isinstance(w, PackedWeight) else as_format(w, "w")
    dev = _device(device)
    if not _native_fits(fmt, dev):
        return (f"it computes NVFP4 weights in jaxlowfp's arithmetic, FP8 and HiF8 on CPU; got {fmt.name} on "
                f"{_describe(dev)}")
    if dtype is not None and jnp.dtype(dtype) != jnp.float32:
        return f"it takes float32 activations; got {jnp.dtype(dtype).name}"
    if weight_dtype is not None and jnp.dtype(weight_dtype) != jnp.float32:
        return (f"the decoded weight is rounded to {jnp.dtype(weight_dtype).name} (the layer's param_dtype) and the "
                f"kernel multiplies the float32 decode")
    from jaxlowfp._core import native_gemv

    ok, why = native_gemv.status()
    return None if ok else why


def dequant_form(rows: int) -> str:
    """The "dequant" backend's form for a product of `rows` rows (`Plan.form`)."""
    return "decode-then-dot" if rows <= DECODE_THEN_DOT_ROWS else "fused"


def _plan(w: PackedWeight | Format, activation: Any, backend: str, *, device: Any, where: str) -> Plan:
    one_of(backend, BACKENDS, "gemm")
    fmt = w.format if isinstance(w, PackedWeight) else as_format(w, "w")
    act = None if activation is None else as_format(activation, "activation")
    dev = _device(device)
    at = f"{where}: " if where else ""
    if backend != "auto":
        problem = _format_problem(backend, fmt, act)
        if problem:
            raise ValueError(f"{at}gemm={backend!r}: {problem}")
        problem, native, reason = _device_problem(backend, dev, fmt.kind)
        if problem:
            raise BackendUnavailableError(f"{at}gemm={backend!r}: {problem}")
        return Plan(backend=backend, native=native, reason=reason)
    chosen = None
    for cand in ("scaled_matmul", "fp8"):
        if _format_problem(cand, fmt, act) is None:
            problem, native, reason = _device_problem(cand, dev, fmt.kind)
            if problem is None and native:
                chosen = Plan(backend=cand, native=True, reason=reason)
            break
    if chosen is None:
        chosen = Plan(backend="dequant", native=False, reason=_device_problem("dequant", dev)[2])
    key = (fmt.name, None if act is None else act.name, getattr(dev, "device_kind", dev.platform))
    if key not in _LOGGED:
        _LOGGED.add(key)
        _log.info("jaxlowfp.backends: weights %s, activations %s on %s -> gemm=%r (%s)", fmt.name,
                  "none" if act is None else act.name, _describe(dev), chosen.backend, chosen.reason)
    return chosen


# ---- the products on the matrix view: x2 [M, K] times W' [K, N] -> float32 [M, N]


def _e2m1_operand(codes: jax.Array, k: int) -> jax.Array:
    """uint8 [R, K/2] (two E2M1 codes a byte, element 2j low) -> float4_e2m1fn [R, K]: a bitcast, no arithmetic
    (XLA splits a byte into [low, high] nibbles, which is our order)."""
    return lax.bitcast_convert_type(codes, jnp.float4_e2m1fn).reshape(codes.shape[0], k)


def _nvfp4_operand(arr: QArray, k: int) -> tuple[jax.Array, jax.Array]:
    """(float4_e2m1fn [R, K], float8_e4m3fn scales [R, K/16]); 16x16 tiles repeat their scale over the 16 rows."""
    assert arr.scales is not None
    rows = arr.format.rows
    s = arr.scales if rows == 1 else jnp.repeat(arr.scales, rows, axis=0)
    return _e2m1_operand(arr.codes, k), s


def _mx_operand(arr: QArray, k: int) -> tuple[jax.Array, jax.Array]:
    assert arr.scales is not None
    if arr.format.kind == "mxfp4":
        return _e2m1_operand(arr.codes, k), arr.scales
    dt = jnp.float8_e4m3fn if arr.format.kind == "mxfp8" else jnp.float8_e5m2
    return lax.bitcast_convert_type(arr.codes, dt), arr.scales


def block_scaled_product(xa: QArray, wa: QArray) -> jax.Array:
    """``jax.nn.scaled_matmul`` of two quantized arrays of one format with blocks along K: ``xa`` of ``x [M, K]``
    (NVFP4 1x16 blocks, or MX) and ``wa`` of ``W'^T [N, K]`` (NVFP4 1x16 or 16x16, or MX) -> float32 [M, N]. NVFP4's
    two float32 decode scales multiply the output (``g_x g_w sum_k (s_x q_x)(s_w q_w)``)."""
    k = xa.shape[-1]
    if xa.format.kind == "nvfp4":
        (xq, xs), (wq, ws) = _nvfp4_operand(xa, k), _nvfp4_operand(wa, k)
        g = xa.global_scale * wa.global_scale  # type: ignore[operator]
    else:
        (xq, xs), (wq, ws) = _mx_operand(xa, k), _mx_operand(wa, k)
        g = None
    out = jax.nn.scaled_matmul(xq[None], wq[None], xs[None], ws[None], preferred_element_type=jnp.float32)[0]
    return out if g is None else out * g


def _scaled_matmul(x2: jax.Array, w: PackedWeight, act: Format) -> jax.Array:
    if w.format.kind == "nvfp4":
        xa = nvfp4.quantize(x2, rule=act.rule)  # type: ignore[arg-type]  # ours: Four Over Six included
    else:
        xa = mx.quantize(x2, format=MX_ELEMENT[w.array.format.kind])  # type: ignore[arg-type]
    return block_scaled_product(xa, w.array)


@functools.lru_cache(maxsize=None)
def _host_program(fn: Callable[..., jax.Array]) -> Callable[..., Any]:
    """The one jitted program of `fn` (jax.jit caches one executable per shape), called from the host."""
    jitted = jax.jit(fn)
    return lambda *args: np.asarray(jitted(*args))


def _shared(fn: Callable[..., jax.Array], x: jax.Array, operands: tuple) -> jax.Array:
    return jax.pure_callback(_host_program(fn), jax.ShapeDtypeStruct(x.shape, x.dtype), x, *operands,
                             vmap_method="sequential")


_shared_vjp = jax.custom_vjp(_shared, nondiff_argnums=(0,))
_shared_vjp.defvjp(lambda fn, x, operands: (_shared(fn, x, operands), (x, operands)),
                   lambda fn, res, g: jax.vjp(lambda x, ops: fn(x, *ops), *res)[1](g))


@functools.lru_cache(maxsize=None)
def _fake_quantizer(act: Format) -> Callable[[jax.Array], jax.Array]:
    """One function object per activation format (so that :func:`shared_quantizer` shares its program)."""
    return functools.partial(fake_quantize, format=act)


def _share_quantizer(device: Any = None) -> bool:
    """Whether :func:`shared_quantizer` calls one shared program (`SHARED_QUANTIZER`) or computes inline."""
    if SHARED_QUANTIZER is False or _device(device).platform != "cpu":
        return False
    return SHARED_QUANTIZER is True or jax.device_count() == 1


def shared_quantizer(fn: Callable[..., jax.Array], x: jax.Array, *operands: Any, device: Any = None) -> jax.Array:
    """``fn(x, *operands)`` (an activation quantizer: `fn` hashable, its output shaped and typed like `x`), on a
    one-device CPU process through ONE compiled program per (fn, shapes), shared by every layer that calls it, instead
    of a copy compiled into each projection of the caller's program. XLA:CPU keeps each compiled copy's machine code
    resident: an NVFP4 4/6 quantizer is ~7 MiB of it, 120 of them in a W4A4 SmolLM2-135M forward, more than the
    packed model's 165 MiB of parameters (bench/packed_memory.py). The call goes through ``jax.pure_callback``
    (the values are the inline program's; tests/test_shared_quantizer.py); the gradient is `fn`'s own (its VJP, inline).
    Elsewhere (several devices, unless ``SHARED_QUANTIZER = True``; or ``SHARED_QUANTIZER = False``) `fn` runs
    inline."""
    if not _share_quantizer(device):
        return fn(x, *operands)
    return _shared_vjp(fn, x, operands)


def after_input(x: Any, w: Any) -> tuple[Any, Any]:
    """``(x, w)`` through one ``lax.optimization_barrier`` (values unchanged): whatever is computed from the returned
    `w` (a packed weight's decode) depends on `x`, so XLA cannot schedule it before `x` exists (module docstring)."""
    return lax.optimization_barrier((x, w))


def scaled_matmul_rows(x2: jax.Array, w: PackedWeight, rule: str, amax: Any) -> jax.Array:
    """NVFP4 W4A4 on ``jax.nn.scaled_matmul`` with per-row (per-token) or static activation global scales: row m is
    quantized by our quantizer (`jaxlowfp.nvfp4.quantize`, `rule`, 4/6 included) with its own amax ``amax[m]`` (a
    scalar: one static amax for all rows), and since each row's decode scale g_x[m] is constant along K it factors
    out of the contraction: ``out[m, n] = g_x[m] g_w sum_k (s_x q_x)(s_w q_w)``. float32 [M, N]."""
    if w.format.kind != "nvfp4" or w.format.arithmetic != "jaxlowfp":
        raise ValueError(f"scaled_matmul with per-token / static activation scales takes NVFP4 weights in jaxlowfp's "
                         f"convention; got {w.format.name}")
    (x2, amax), w = after_input((x2, amax), w)
    return block_scaled_rows(x2, w.array, rule, amax)


def block_scaled_rows(x2: jax.Array, wa: QArray, rule: str, amax: Any) -> jax.Array:
    """:func:`scaled_matmul_rows` on the NVFP4 array ``wa`` of ``W'^T [N, K]`` (1x16 or 16x16 blocks)."""
    a = jnp.broadcast_to(jnp.asarray(amax, jnp.float32).reshape(-1), (x2.shape[0],))
    rows = jax.vmap(lambda r, m: nvfp4.quantize(r[None], rule=rule, global_amax=m))(x2, a)  # type: ignore[arg-type]
    k = x2.shape[-1]
    xq, xs = _e2m1_operand(rows.codes[:, 0], k), block_scales(rows)[:, 0]
    wq, ws = _nvfp4_operand(wa, k)
    out = jax.nn.scaled_matmul(xq[None], wq[None], xs[None], ws[None], preferred_element_type=jnp.float32)[0]
    return out * (rows.global_scale.reshape(-1, 1) * wa.global_scale)  # type: ignore[union-attr, operator]


def fp8_rows(x2: jax.Array, w: PackedWeight, scaling: Any, amax: Any) -> jax.Array:
    """FP8 W8A8 with per-token (per-row) or static activation scales: row m quantized to E4M3 with its own scale
    ``s_x[m] = scaling.scale(amax[m])`` (`amax` a scalar: one static amax for all rows), exactly as the op layer's
    quantizer rounds it (``E4M3(clip(x * (1 / s), +-448))``), then the float8 dot and both scales on the output:
    ``out[m, n] = s_x[m] s_w sum_k q_x q_w``. float32 [M, N]."""
    if w.format.kind != "fp8":
        raise ValueError(f"fp8_rows takes FP8 weights; got {w.format.name}")
    (x2, amax), w = after_input((x2, amax), w)
    elem, target = PER_TENSOR["fp8"]
    a = jnp.broadcast_to(jnp.asarray(amax, jnp.float32).reshape(-1), (x2.shape[0],))
    s = jax.vmap(scaling.scale)(a)[:, None]  # [M, 1]
    xq = formats.get(elem).round(jnp.clip(x2.astype(jnp.float32) * (1.0 / s), -target, target))
    out = lax.dot_general(xq.astype(jnp.float8_e4m3fn), w.array.codes, (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32)
    return out * (s * w.array.scale)


def fp8_product(xq: jax.Array, sx: jax.Array, wq: jax.Array, sw: jax.Array, dimension_numbers: Any) -> jax.Array:
    """``dot_general(xq, wq) * (sx sw)`` on float8_e4m3fn operands with float32 per-tensor scales, accumulated in
    float32: the pattern XLA's GEMM rewriter hands to cuBLASLt's FP8 GEMM on sm_89+."""
    out = lax.dot_general(xq, wq, dimension_numbers, preferred_element_type=jnp.float32)
    return out * (sx * sw)


def _fp8(x2: jax.Array, w: PackedWeight) -> jax.Array:
    elem, target = PER_TENSOR["fp8"]
    sx = per_tensor_scale(x2, target)
    xq = formats.get(elem).round(jnp.clip(x2.astype(jnp.float32) * (1.0 / sx), -target, target))
    xq = xq.astype(jnp.float8_e4m3fn)  # exact: xq is an E4M3 value
    return fp8_product(xq, sx, w.array.codes, w.array.scale, (((1,), (1,)), ((), ())))


def decode_weight(w: PackedWeight, device: Any = None) -> jax.Array:
    """``W' [K, N]`` in float32, bit for bit ``w.dequantize(jnp.float32)``: what the "dequant" backend multiplies.
    NVFP4 in jaxlowfp's arithmetic decodes through XLA's own float4_e2m1fn and float8_e4m3fn conversions on CPU and
    GPU, ``(q s) g`` in the order `jaxlowfp.nvfp4` decodes (q s exact, one rounding): on CPU a few times cheaper than
    the portable bit arithmetic of `PackedWeight.dequantize`, which every other case takes."""
    a, fmt = w.array, w.format
    if fmt.kind != "nvfp4" or fmt.arithmetic != "jaxlowfp" or _device(device).platform not in ("cpu", "gpu"):
        return w.dequantize(jnp.float32)
    q = _e2m1_operand(a.codes, w.k).astype(jnp.float32)  # [N, K]
    s = a.scales.astype(jnp.float32)  # type: ignore[union-attr]
    if a.format.rows > 1:  # 16x16 tiles: the tile's scale on each of its 16 rows
        s = jnp.repeat(s, a.format.rows, axis=0)
    out = (q.reshape(w.n, w.k // 16, 16) * s[..., None]).reshape(w.n, w.k) * a.global_scale  # type: ignore[operator]
    return out.T


def _dequant(x2: jax.Array, w: PackedWeight, act: Format | None, weight_dtype: Any, device: Any = None,
             form: str = "") -> jax.Array:
    xq = x2 if act is None else shared_quantizer(_fake_quantizer(act), x2, device=device)
    if form == "native-gemv":  # the packed codes straight into the C++ GEMV (float32 in and out)
        from jaxlowfp._core import native_gemv

        a = w.array
        if w.format.kind in native_gemv.LUT8_KINDS:
            return native_gemv.lut8_gemv(xq, a.codes, a.global_scale, kind=w.format.kind)
        return native_gemv.nvfp4_gemv(xq, a.codes, a.scales, a.global_scale, tile_rows=a.format.rows)
    wd = decode_weight(w, device)
    if weight_dtype is not None:
        wd = wd.astype(weight_dtype)
    wd = wd.astype(x2.dtype)
    if dequant_form(x2.shape[0]) == "decode-then-dot":  # the decoded weight in a buffer, then the GEMV
        xq, wd = lax.optimization_barrier((xq, wd))
    return lax.dot_general(xq, wd, (((1,), (0,)), ((), ())))


def packed_matmul(x2: jax.Array, w: PackedWeight, *, gemm: str = "auto", activation: Any = None,
                  weight_dtype: Any = None, device: Any = None, where: str = "", backend: str | None = None
                  ) -> tuple[jax.Array, Plan]:
    """``x2 [M, K] @ W' [K, N]`` on `backend`: (output, the :class:`Plan` that ran). The output is float32 from the
    low-precision GEMMs and x2's dtype from "dequant" (where the weight is dequantized to float32, then, if given,
    rounded to `weight_dtype` (the dtype a float kernel was stored in), then cast to x2's dtype, as a float layer
    promotes it)."""
    backend = renamed_kwarg("backends.packed_matmul", "backend", backend, "gemm", gemm, "auto")
    if not isinstance(w, PackedWeight):
        raise TypeError(f"{where or 'w'}: expected a jaxlowfp.packed.PackedWeight; got {type(w).__name__}")
    act = None if activation is None else as_format(activation, "activation")
    if x2.ndim != 2 or x2.shape[1] != w.k:
        raise ValueError(f"{where or 'packed_matmul'}: x must be [M, K] with K = {w.k} (the weight's W' "
                         f"{w.shape}); got shape {tuple(x2.shape)}")
    if act is not None and act.group is not None and w.k % act.group:
        raise ValueError(f"{where or 'packed_matmul'}: activation format {act.name} has blocks of {act.group} along "
                         f"K; K = {w.k} is not a multiple")
    p = plan(w, act, backend, device=device, where=where, rows=x2.shape[0], dtype=x2.dtype, weight_dtype=weight_dtype)
    x2, w = after_input(x2, w)  # the weight is decoded after its input exists, just before its product
    if p.backend == "scaled_matmul":
        assert act is not None  # plan() takes scaled_matmul for a product with quantized activations only
        return _scaled_matmul(x2, w, act), p
    if p.backend == "fp8":
        return _fp8(x2, w), p
    return _dequant(x2, w, act, weight_dtype, device, p.form), p


def packed_dot_general(
    x: jax.Array,
    w: PackedWeight,
    dimension_numbers: Any,
    *,
    gemm: str = "auto",
    activation: Any = None,
    preferred_element_type: Any = None,
    weight_dtype: Any = None,
    device: Any = None,
    return_backend: bool = False,
    where: str = "",
    backend: str | None = None,
) -> jax.Array | tuple[jax.Array, Plan]:
    """``lax.dot_general(x, W', dimension_numbers)`` for a packed ``W' [K, N]``: one contracted axis of `x` with the
    weight's axis 0, no batch axes (``(((a,), (0,)), ((), ()))``, an ``nnx.Linear``'s). The output has x's other axes
    then N, in `preferred_element_type` (default x's dtype). `activation`: the format `x` is quantized to at run
    time (its current amax), None for weights only. ``return_backend=True`` returns ``(out, Plan)``."""
    backend = renamed_kwarg("backends.packed_dot_general", "backend", backend, "gemm", gemm, "auto")
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc = tuple(lc), tuple(rc)
    if len(lc) != 1 or rc != (0,) or tuple(lb) or tuple(rb):
        raise ValueError(f"{where or 'packed_dot_general'}: a packed weight is the matrix W' [K, N] contracted on "
                         f"its axis 0 with one axis of x and no batch axes; got dimension_numbers "
                         f"{dimension_numbers!r}")
    a = lc[0] % x.ndim
    xt = x if a == x.ndim - 1 else jnp.moveaxis(x, a, -1)
    lead = xt.shape[:-1]
    out, p = packed_matmul(xt.reshape(-1, xt.shape[-1]), w, gemm=backend, activation=activation,
                           weight_dtype=weight_dtype, device=device, where=where)
    out = out.reshape(*lead, w.n).astype(x.dtype if preferred_element_type is None else preferred_element_type)
    return (out, p) if return_backend else out


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
