"""Packed weights (jaxlowfp.packed) and their execution backends (jaxlowfp.backends), on CPU.

Judges:
- the packed codes and scales are decoded by numpy through ml_dtypes (float4_e2m1fn, float8_e4m3fn, float8_e8m0fnu)
  and en_dtypes (hifloat8), not by jaxlowfp, and must give the fake-quantized weight bit for bit (each element is
  one IEEE float32 product on either side, so bitwise holds on any machine);
- every backend's product must equal the fake-quant path's (``fake_quantize(x) @ fake_quantize(W)``, a float dot):
  * bitwise on inputs whose every product and partial sum is an exact float32 (grid values times powers of two, the
    global scales 1): then no rounding happens anywhere, whatever the summation order;
  * elsewhere within float32 summation order: the low-precision backends compute ``(sum (q s)(q s)) * (g_x g_w)``
    where the fake path computes ``sum ((q s) g_x)((q s) g_w)``; (q s) is exact in float32 (E2M1 or E4M3 times an
    E4M3 / E8M0 scale), so the two differ by the rounding of the global scalings (3 ulp per term) and the order of
    a K-term float32 sum, bounded by ``(K + 4) * eps * (|x̂| @ |ŵ|)``.
"""
from __future__ import annotations

import functools
import types

import en_dtypes
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jaxlowfp
from jaxlowfp import backends, packed
from jaxlowfp.ptq import formats as ptq_formats
from jaxlowfp.ptq import serving

DN = (((1,), (0,)), ((), ()))
EPS = float(np.finfo(np.float32).eps)

# (weight format, activation format, the backends that compute it besides "dequant")
CASES = [
    ("nvfp4-mse", "nvfp4-mse", ("scaled_matmul",)),
    ("nvfp4-static_6", "nvfp4-static_6", ("scaled_matmul",)),
    ("nvfp4-mse-16x16", "nvfp4-mse", ("scaled_matmul",)),
    ("nvfp4-static_6-16x16", "nvfp4-static_6", ("scaled_matmul",)),
    ("mxfp4", "mxfp4", ("scaled_matmul",)),
    ("mxfp8", "mxfp8", ("scaled_matmul",)),
    ("fp8", "fp8", ("fp8",)),
    ("hif8", "hif8", ()),
    ("if4-mse", "if4-mse", ()),
    ("nvfp4-mse", None, ()),  # W4A16: weights only
]


def _weights_fake(w: jax.Array, fmt: str) -> jax.Array:
    """The fake-quantized W' [K, N] of each format, by the public fake-quant functions (blocks along K)."""
    f = packed.as_format(fmt)
    return packed.fake_quantize(w.T, f).T


@functools.partial(jax.jit, static_argnames=("act", "backend"))
def _product(x, p, act, backend):
    """Under jit: (output, the Plan that ran; a pytree without leaves)."""
    return backends.packed_dot_general(x, p, DN, gemm=backend, activation=act, return_backend=True)


def _grid(rng, shape, block, rows=1, lo=-1, hi=1):
    """[R, K] E2M1 grid values times 2^j (j drawn in [lo, hi] per block of `block` along K, shared by `rows` rows:
    16x16 tiles), each block's max magnitude 6 * 2^j, so every block scale is exact and quantizing is lossless."""
    vals = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    q = rng.choice(vals, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    q = q.reshape(shape[0], shape[1] // block, block)
    q[..., 0] = 6.0
    j = np.repeat(rng.integers(lo, hi + 1, size=(shape[0] // rows, shape[1] // block)), rows, axis=0)
    return (q * np.exp2(j)[..., None]).reshape(shape).astype(np.float32)


def _exact_case(fmt: str, rng, m=8, k=64, n=32):
    """(x [M, K], W' [K, N]) for which every backend's arithmetic is exact: grid values, and one element per
    operand that pins the global scale at 1 (NVFP4: amax = 6 * E with E = 448 or 256 (4/6); FP8: 448; HiF8: 15)."""
    f = packed.as_format(fmt)
    block = f.group or 16
    x = _grid(rng, (m, k), block)
    wt = _grid(rng, (n, k), block, rows=f.rows)  # E2M1 grid values times 2^j are E4M3 and HiF8 values too
    if f.kind in ("nvfp4", "if4"):
        big = 6.0 * (448.0 if f.rule in ("static_6", "static_4") or f.kind == "if4" else 256.0)
    else:
        big = {"fp8": 448.0, "hif8": 15.0}.get(f.kind)
    if big is not None:  # in a block of its own in x and in W (another K position), so no product big * big
        x[:, :block] = 0.0
        x[0, 0] = big
        wt[:, block:2 * block] = 0.0
        wt[0, block] = big
    return jnp.asarray(x), jnp.asarray(wt.T)


# ---- the packed arrays, decoded by ml_dtypes / en_dtypes


def _np_nibbles(codes: np.ndarray) -> np.ndarray:
    c = np.asarray(codes)
    out = np.empty((*c.shape[:-1], 2 * c.shape[-1]), np.uint8)
    out[..., 0::2], out[..., 1::2] = c & 0xF, c >> 4  # element 2j in the low nibble
    return out


def _np_decode(p: packed.PackedWeight) -> np.ndarray:
    """W' [K, N] from the packed leaves, by numpy + ml_dtypes / en_dtypes only."""
    a, f = p.array, p.format
    f32 = np.float32
    if f.kind == "nvfp4":
        q = _np_nibbles(a.codes).view(ml_dtypes.float4_e2m1fn).astype(f32)
        s = np.asarray(a.scales).astype(f32)
        if f.rows > 1:
            s = np.repeat(s, f.rows, axis=0)
        wt = (q * np.repeat(s, 16, axis=-1)) * np.asarray(a.global_scale, f32)
    elif f.kind in ("mxfp4", "mxfp8"):
        codes = np.asarray(a.codes)
        q = (_np_nibbles(codes).view(ml_dtypes.float4_e2m1fn) if f.kind == "mxfp4"
             else codes.view(ml_dtypes.float8_e4m3fn)).astype(f32)
        wt = q * np.repeat(np.asarray(a.scales).astype(f32), 32, axis=-1)
    elif f.kind == "fp8":
        wt = np.asarray(a.codes).astype(f32) * np.asarray(a.scale, f32)
    elif f.kind == "hif8":
        wt = np.asarray(a.codes).view(en_dtypes.hifloat8).astype(f32) * np.asarray(a.scale, f32)
    else:
        raise AssertionError(f.kind)
    return wt.T


@pytest.mark.parametrize("fmt", ["nvfp4-mse", "nvfp4-static_6-16x16", "mxfp4", "mxfp8", "fp8", "hif8"])
def test_packed_codes_decode_to_the_fake_quantized_weight(fmt):
    w = jax.random.normal(jax.random.key(0), (64, 32), jnp.float32) * 3.0
    p = packed.pack(w, fmt)
    fake = np.asarray(_weights_fake(w, fmt))
    np.testing.assert_array_equal(_np_decode(p), fake)
    np.testing.assert_array_equal(np.asarray(p.dequantize()), fake)
    global_bytes = {"nvfp4": 8, "fp8": 4, "hif8": 4}.get(p.format.kind, 0)  # S_dec (+ S_enc), or the scale
    assert p.bits_per_param == packed.as_format(fmt).bits + 8 * global_bytes / (64 * 32)


def test_pack_matches_the_ptq_quantizers_bit_for_bit():
    """PTQ's own HiF8 quantizer and compressed-tensors' RTN of ptq.serving (the other formats call the same public
    fake-quant functions as PTQ does)."""
    w = jax.random.normal(jax.random.key(1), (64, 32), jnp.float32)
    tf = jaxlowfp.Format(kind="hif8")
    np.testing.assert_array_equal(packed.pack(w, tf).dequantize(), ptq_formats.hif8_fake_quantize(w.T).T)
    ct = jaxlowfp.Format(kind="nvfp4", rule="static_6", arithmetic="compressed-tensors")
    ref = serving.ct_weight(w, jaxlowfp.Format(kind="nvfp4", rule="static_6"))
    p = packed.pack(w, ct)
    np.testing.assert_array_equal(p.dequantize(), ref.kernel)
    np.testing.assert_array_equal(p.array.codes, ref.packed.codes)
    assert float(p.s_enc) == float(ref.s_enc)


# ---- backends against the fake-quant path


@pytest.mark.parametrize("wf,af,extra", CASES, ids=[f"{c[0]}-a{c[1]}" for c in CASES])
def test_backends_bitwise_where_the_arithmetic_is_exact(wf, af, extra):
    x, w = _exact_case(wf, np.random.default_rng(0))
    p = packed.pack(w, wf)
    np.testing.assert_array_equal(p.dequantize(), w)  # lossless by construction
    xq = x if af is None else packed.fake_quantize(x, af)
    np.testing.assert_array_equal(xq, x)
    ref = jnp.dot(xq, _weights_fake(w, wf))
    for b in ("dequant", *extra):
        y, ran = _product(x, p, af, b)
        assert ran.backend == b and not ran.native  # CPU: jax / XLA emulate the low-precision GEMMs
        np.testing.assert_array_equal(y, ref, err_msg=f"backend {b}")


@pytest.mark.parametrize("wf,af,extra", CASES, ids=[f"{c[0]}-a{c[1]}" for c in CASES])
def test_backends_equal_fake_quant_within_float32_summation_order(wf, af, extra):
    kx, kw = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (8, 64), jnp.float32)
    w = jax.random.normal(kw, (64, 32), jnp.float32) * 0.05
    p = packed.pack(w, wf)
    xq = x if af is None else packed.fake_quantize(x, af)
    wq = _weights_fake(w, wf)
    ref = jnp.dot(xq, wq)
    bound = (64 + 4) * EPS * jnp.dot(jnp.abs(xq), jnp.abs(wq))
    for b in ("dequant", *extra):  # dequant: the same values, but XLA's fused dot may sum in another order
        y, ran = _product(x, p, af, b)
        err = jnp.abs(y - ref)
        assert bool(jnp.all(err <= bound)), (b, float(jnp.max(err - bound)))


@pytest.mark.parametrize("rule", ["static_6", "mse"])
def test_nvfp4_both_global_scale_conventions(rule):
    """jaxlowfp's (q * s) * (1 / g) and compressed-tensors' q * (s / g): the backends factor 1 / g = S_dec out of
    the sum either way, the weights dequantize as their convention says."""
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (8, 64), jnp.float32)
    w = jax.random.normal(kw, (64, 32), jnp.float32)
    for conv in ("jaxlowfp", "compressed-tensors") if rule == "static_6" else ("jaxlowfp",):
        p = packed.pack(w, jaxlowfp.Format(kind="nvfp4", rule=rule, arithmetic=conv))
        xq = packed.fake_quantize(x, f"nvfp4-{rule}")
        ref = jnp.dot(xq, p.dequantize())
        bound = (64 + 4) * EPS * jnp.dot(jnp.abs(xq), jnp.abs(p.dequantize()))
        for b in ("dequant", "scaled_matmul"):
            y, _ = _product(x, p, f"nvfp4-{rule}", b)
            assert bool(jnp.all(jnp.abs(y - ref) <= bound)), (conv, b)


def test_packed_dot_general_axes_dtypes_and_nd_inputs():
    x = jax.random.normal(jax.random.key(4), (2, 4, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(5), (64, 32), jnp.float32)
    p = packed.pack(w, "nvfp4-mse")
    y = backends.packed_dot_general(x, p, (((2,), (0,)), ((), ())), activation="nvfp4-mse", gemm="dequant")
    assert y.shape == (2, 4, 32) and y.dtype == jnp.float32
    flat = _product(x.reshape(8, 64), p, "nvfp4-mse", "dequant")[0]
    np.testing.assert_allclose(y, flat.reshape(2, 4, 32), rtol=1e-5, atol=1e-5)
    xt = jnp.moveaxis(x, 2, 0)  # the contracted axis first
    y2 = backends.packed_dot_general(xt, p, (((0,), (0,)), ((), ())), activation="nvfp4-mse", gemm="dequant")
    np.testing.assert_allclose(y2, y, rtol=1e-5, atol=1e-5)
    yb = backends.packed_dot_general(x.astype(jnp.bfloat16), p, (((2,), (0,)), ((), ())), gemm="scaled_matmul",
                                     activation="nvfp4-mse")
    assert yb.dtype == jnp.bfloat16


# ---- bad input, availability


def test_bad_input_gets_clear_errors():
    w = jnp.ones((40, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"K = 40 .* not a multiple of 16"):
        packed.pack(w, "nvfp4-mse", where="blocks/0/mlp/up_proj")
    with pytest.raises(ValueError, match="multiple of 32"):
        packed.pack(jnp.ones((48, 16)), "mxfp8")
    with pytest.raises(ValueError, match="N to be a multiple of 16"):
        packed.pack(jnp.ones((32, 8)), "nvfp4-mse-16x16")
    with pytest.raises(ValueError, match="kind="):
        packed.as_format("nvfp8")
    p = packed.pack(jnp.ones((64, 16)), "nvfp4-mse")
    x = jnp.ones((4, 64))
    with pytest.raises(ValueError, match="do not match"):  # a mixed-format layer: NVFP4 weights, MXFP4 inputs
        backends.packed_dot_general(x, p, DN, gemm="scaled_matmul", activation="mxfp4")
    with pytest.raises(ValueError, match="weights-only"):
        backends.packed_dot_general(x, p, DN, gemm="scaled_matmul")
    with pytest.raises(ValueError, match="HiF8 has no hardware GEMM"):
        backends.packed_dot_general(x, packed.pack(jnp.ones((64, 16)), "hif8"), DN, gemm="scaled_matmul",
                                    activation="hif8")
    with pytest.raises(ValueError, match="FP8 E4M3"):
        backends.packed_dot_general(x, p, DN, gemm="fp8", activation="nvfp4-mse")
    with pytest.raises(ValueError, match="K = 64"):
        backends.packed_dot_general(jnp.ones((4, 32)), p, DN, gemm="dequant")
    with pytest.raises(ValueError, match="no batch axes"):
        backends.packed_dot_general(x, p, (((1,), (1,)), ((), ())))
    with pytest.raises(ValueError, match="gemm="):
        backends.packed_dot_general(x, p, DN, gemm="cudnn")


def _gpu(kind, cc):
    return types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=cc)


def test_backend_availability_per_device():
    nv = jaxlowfp.Format(kind="nvfp4", rule="mse")
    fp8 = jaxlowfp.Format(kind="fp8")
    b200, h100, a100 = _gpu("NVIDIA B200", "10.0"), _gpu("NVIDIA H100 80GB HBM3", "9.0"), _gpu("NVIDIA A100", "8.0")
    with pytest.raises(backends.BackendUnavailableError, match=r"compute capability >= 10.0.*H100"):
        backends.plan(nv, "nvfp4-mse", "scaled_matmul", device=h100, where="blocks/0/attn/q_proj")
    with pytest.raises(backends.BackendUnavailableError, match=r"compute capability >= 8.9.*A100|A100.*8.9"):
        backends.plan(fp8, "fp8", "fp8", device=a100)
    rocm = types.SimpleNamespace(platform="gpu", device_kind="AMD MI300X", compute_capability="gfx942")
    with pytest.raises(backends.BackendUnavailableError, match="NVIDIA"):
        backends.plan(nv, "nvfp4-mse", "scaled_matmul", device=rocm)
    assert backends.plan(nv, "nvfp4-mse", "auto", device=b200) == backends.Plan(
        backend="scaled_matmul", native=True, reason=backends.plan(nv, "nvfp4-mse", "scaled_matmul",
                                                                   device=b200).reason)
    assert backends.plan(nv, "nvfp4-mse", "auto", device=h100).backend == "dequant"
    assert backends.plan(nv, None, "auto", device=b200).backend == "dequant"  # W4A16
    assert backends.plan(fp8, "fp8", "auto", device=h100).backend == "fp8"
    assert backends.plan(fp8, "fp8", "auto", device=a100).backend == "dequant"
    assert backends.plan(jaxlowfp.Format(kind="hif8"), "hif8", "auto", device=b200).backend == "dequant"
    # MXFP4: XLA expands its scaled_matmul into a float32 dot even on sm_100a (tests/test_gpu_compile_backends.py),
    # so auto does not pick it and an explicit request is not reported native
    mx4 = jaxlowfp.Format(kind="mxfp4")
    assert backends.plan(mx4, "mxfp4", "auto", device=b200).backend == "dequant"
    explicit = backends.plan(mx4, "mxfp4", "scaled_matmul", device=b200)
    assert not explicit.native and "float32 dot" in explicit.reason
    cpu = backends.plan(nv, "nvfp4-mse", "auto")
    assert cpu.backend == "dequant" and "cpu" in cpu.reason
    emulated = backends.plan(nv, "nvfp4-mse", "scaled_matmul")
    assert not emulated.native and "emulated" in emulated.reason


def test_auto_logs_its_choice_once(caplog):
    fmt = jaxlowfp.Format(kind="mxfp8")
    backends._LOGGED.discard((fmt.name, "mxfp8", "NVIDIA B200"))
    with caplog.at_level("INFO", logger="jaxlowfp.backends"):
        for _ in range(3):
            backends.plan(fmt, "mxfp8", device=_gpu("NVIDIA B200", "10.0"))
    msgs = [r.getMessage() for r in caplog.records if "gemm=" in r.getMessage()]
    assert len(msgs) == 1 and "'scaled_matmul'" in msgs[0] and "B200" in msgs[0]


# ---- the nnx.Variable: split / state / jit / sharding


class _Layer(nnx.Module):
    def __init__(self, w):
        self.kernel = packed.PackedParam(packed.pack(w, "nvfp4-mse"))
        self.bias = nnx.Param(jnp.zeros((w.shape[1],), jnp.float32))

    def __call__(self, x):
        return (backends.packed_dot_general(x, self.kernel.get_value(), DN, activation="nvfp4-mse")
                + self.bias[...][None])


def test_packed_param_splits_jits_and_shards():
    w = jax.random.normal(jax.random.key(6), (64, 32), jnp.float32)
    x = jax.random.normal(jax.random.key(7), (4, 64), jnp.float32)
    layer = _Layer(w)
    graph, packed_state, params = nnx.split(layer, packed.PackedParam, nnx.Param)
    leaves = jax.tree.leaves(packed_state)
    assert sorted(str(a.dtype) for a in leaves) == ["float32", "float32", "float8_e4m3fn", "uint8"]
    assert all(not isinstance(v, nnx.Param) for v in jax.tree.leaves(packed_state, is_leaf=lambda v: isinstance(
        v, nnx.Variable)))
    assert len(jax.tree.leaves(params)) == 1  # only the bias is a Param

    @jax.jit
    def f(ps, x):
        return nnx.merge(graph, ps, params)(x)

    y = f(packed_state, x)
    np.testing.assert_allclose(y, layer(x), rtol=1e-5, atol=1e-5)  # jit vs eager: another fusion of the dot
    mesh = jax.make_mesh((4,), ("n",), devices=jax.devices()[:4])
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("n"))  # the N rows of codes and scales
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sharded = jax.tree.map(lambda a: jax.device_put(a, spec if a.ndim == 2 else rep), packed_state)
    assert jax.tree.leaves(sharded)[0].sharding.spec == jax.sharding.PartitionSpec("n")
    np.testing.assert_allclose(f(sharded, x), y, rtol=1e-5, atol=1e-5)
