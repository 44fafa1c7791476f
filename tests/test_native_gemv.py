"""The native CPU GEMV of packed NVFP4 weights (jaxlowfp._core.native_gemv, issue 44's decode path): the kernel's
decode is the library's dequantized value exactly, its products match the library's dequantize-then-dot and an
independent numpy + ml_dtypes decode within float32 summation error, under jax.jit, on both code paths (AVX2 + FMA
and plain C++); backends.plan reports the form; bad input is refused clearly. A kernel that cannot be built FAILS
here (no skip): the suite requires it."""
import en_dtypes
import ml_dtypes
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxlowfp import backends, packed
from jaxlowfp._core import native_gemv

FORMATS = ["nvfp4-mse", "nvfp4-static_6", "nvfp4-static_6-16x16"]


def test_the_kernel_is_built_and_registered():
    ok, why = native_gemv.status()
    assert ok, f"the native GEMV is required by the test suite: {why}"


def _np_decode_t(p: packed.PackedWeight) -> np.ndarray:
    """W'^T [N, K] in float32 from the packed leaves by numpy + ml_dtypes only: (e2m1(q) * e4m3(s)) * g."""
    a = p.array
    c = np.asarray(a.codes)
    nib = np.stack([c & 0x0F, c >> 4], axis=-1).reshape(c.shape[0], -1)  # element 2j in the low nibble
    q = nib.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    s = np.asarray(a.scales).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    if p.format.rows > 1:
        s = np.repeat(s, p.format.rows, axis=0)
    return (q * np.repeat(s, 16, axis=1)) * np.float32(np.asarray(a.global_scale))


KMAX, NMAX = 1040, 1536


@pytest.fixture(scope="module")
def bases():
    """One packed weight per format (packing compiles per shape: pack once, slice); its numpy and library decodes."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((KMAX, NMAX)).astype(np.float32)
    w[:, :512] *= 0.01
    w[:, 1024:] *= 300.0
    w[:16, :3] = 0.0  # a zero block (scale 0), signed zeros among the codes
    out = {}
    for fmt in FORMATS:
        p = packed.pack(jnp.asarray(w), fmt)
        out[fmt] = (p, _np_decode_t(p), np.asarray(p.dequantize_t(jnp.float32)))
    return out


def _slice(p: packed.PackedWeight, k: int, n: int, n0: int = 0) -> tuple:
    """(codes, scales, g) of the sub-matrix W'[:k, n0:n0 + n]: blocks along K and 16-row tiles stay whole."""
    a, r = p.array, p.format.rows
    return a.codes[n0:n0 + n, : k // 2], a.scales[n0 // r:(n0 + n) // r, : k // 16], a.global_scale


def _gemv(rows: int, isa: str):
    return jax.jit(lambda x, c, s, g: native_gemv.nvfp4_gemv(x, c, s, g, tile_rows=rows, isa=isa))


@pytest.mark.parametrize("isa", ["auto", "generic"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernel_decodes_each_weight_to_its_dequantized_value(bases, fmt, isa):
    # x = rows of the identity: y[m, n] = 1 * w[n, k_m] + zeros, exact, so the kernel's decode is compared value for
    # value (== : -0 and +0 agree) with numpy's and the library's
    p, want, lib = bases[fmt]
    np.testing.assert_array_equal(lib, want)  # the library's decode: the same values as numpy's
    k, n = 96, 1536
    for ks in (range(0, 8), range(88, 96), range(13, 93, 10)):
        x = np.zeros((len(ks), k), np.float32)
        x[np.arange(len(ks)), list(ks)] = 1.0
        y = np.asarray(_gemv(p.format.rows, isa)(jnp.asarray(x), *_slice(p, k, n)))
        np.testing.assert_array_equal(y, want[:n, list(ks)].T)


SHAPES = [(1, 16, 1), (1, 576, 1536), (2, 48, 17), (3, 80, 33), (4, 592, 48), (5, 112, 64), (7, 208, 9),
          (8, 1040, 31), (13, 64, 32)]


@pytest.mark.parametrize("isa", ["auto", "generic"])
def test_products_match_dequantize_then_dot_and_numpy(bases, isa):
    # random shapes: K a multiple of 16 but not of 32 / 64 (the SIMD loop's tail), odd N, M = 1..8 and past the
    # 4-row register block; against x @ dequantize(W') in float64 and against numpy's own decode
    rng = np.random.default_rng(7)
    for i, (m, k, n) in enumerate(SHAPES):
        fmt = FORMATS[i % 2] if n % 16 else FORMATS[i % 3]
        p, want, lib = bases[fmt]
        n0 = 16 * int(rng.integers(0, (NMAX - n) // 16 + 1))
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = np.asarray(_gemv(p.format.rows, isa)(jnp.asarray(x), *_slice(p, k, n, n0)), np.float64)
        wd = lib[n0:n0 + n, :k].astype(np.float64).T
        ref = x.astype(np.float64) @ wd
        bound = 4 * k * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(wd)) + 1e-30
        assert np.all(np.abs(y - ref) <= bound), (m, k, n, fmt, float(np.max(np.abs(y - ref) - bound)))
        ref_np = x.astype(np.float64) @ want[n0:n0 + n, :k].astype(np.float64).T
        assert np.all(np.abs(y - ref_np) <= bound), (m, k, n, fmt)


@pytest.mark.parametrize("isa", ["auto", "generic"])
def test_a_rows_result_does_not_depend_on_m(bases, isa):
    # M = 5..8 (past one 4-row step) decodes each weight row once and runs the 1..4-row steps' FMAs on it in their
    # order; the 8-bit kernel takes up to 8 rows a step, one accumulator a row: either way row r of an M-row product
    # is row r computed alone, bit for bit (one deterministic kernel and summation order, not two XLA programs)
    rng = np.random.default_rng(3)
    p = bases["nvfp4-mse"][0]
    k, n = 592, 48
    x = rng.standard_normal((8, k)).astype(np.float32)
    f = _gemv(1, isa)
    alone = np.concatenate([np.asarray(f(jnp.asarray(x[r:r + 1]), *_slice(p, k, n))) for r in range(8)])
    h = packed.pack(jnp.asarray(rng.standard_normal((101, 37)).astype(np.float32)), "hif8")
    g = jax.jit(lambda x, c, s: native_gemv.lut8_gemv(x, c, s, kind="hif8", isa=isa))
    xh = rng.standard_normal((8, 101)).astype(np.float32)
    alone8 = np.concatenate([np.asarray(g(jnp.asarray(xh[r:r + 1]), h.array.codes, h.array.global_scale))
                             for r in range(8)])
    for m in range(2, 9):
        y = np.asarray(f(jnp.asarray(x[:m]), *_slice(p, k, n)))
        np.testing.assert_array_equal(y.view(np.uint32), alone[:m].view(np.uint32), err_msg=f"nvfp4 M={m}")
        y8 = np.asarray(g(jnp.asarray(xh[:m]), h.array.codes, h.array.global_scale))
        np.testing.assert_array_equal(y8.view(np.uint32), alone8[:m].view(np.uint32), err_msg=f"hif8 M={m}")


@pytest.mark.parametrize("isa", ["auto", "generic"])
@pytest.mark.parametrize("kind", ["fp8", "hif8"])
def test_the_8bit_kernel_decodes_exactly_and_matches_the_products(kind, isa):
    # FP8 E4M3 / HiF8 codes with one tensor scale: w = value(q) * s. The decode value for value (identity rows)
    # against numpy + ml_dtypes / en_dtypes; products on K = 8j + r (the SIMD tail) against dequantize-then-dot
    rng = np.random.default_rng(11)
    k, n = 101, 37
    w = rng.standard_normal((k, n)).astype(np.float32) * 5.0
    w[:9, :2] = 0.0
    p = packed.pack(jnp.asarray(w), kind)
    codes = np.asarray(p.array.codes)
    vals = (codes.view(ml_dtypes.float8_e4m3fn) if kind == "fp8" else codes.view(en_dtypes.hifloat8)).astype(np.float32)
    want = vals * np.float32(np.asarray(p.array.global_scale))  # W'^T [N, K]
    np.testing.assert_array_equal(np.asarray(p.dequantize_t(jnp.float32)), want)
    f = jax.jit(lambda x, c, s: native_gemv.lut8_gemv(x, c, s, kind=kind, isa=isa))
    ks = [0, 7, 8, 50, 95, 96, 99, 100]
    x = np.zeros((len(ks), k), np.float32)
    x[np.arange(len(ks)), ks] = 1.0
    y = np.asarray(f(jnp.asarray(x), p.array.codes, p.array.global_scale))
    np.testing.assert_array_equal(y, want[:, ks].T)
    for m in (1, 3, 8):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = np.asarray(f(jnp.asarray(x), p.array.codes, p.array.global_scale), np.float64)
        wd = want.astype(np.float64).T
        bound = 4 * k * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(wd))
        assert np.all(np.abs(y - x.astype(np.float64) @ wd) <= bound), (kind, m)
    out, pl = jax.jit(lambda x, p: backends.packed_matmul(x, p, gemm="dequant"))(jnp.asarray(x), p)
    assert pl.form == "native-gemv"
    np.testing.assert_allclose(np.asarray(out), x @ want.T, rtol=1e-5, atol=1e-4)


def _weight(k: int, n: int, seed: int) -> packed.PackedWeight:
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    return packed.pack(jnp.asarray(w), "nvfp4-static_6")


def test_plan_reports_the_native_form_and_packed_matmul_runs_it():
    p = _weight(64, 48, 3)
    for m in (1, backends.NATIVE_GEMV_ROWS):
        pl = backends.plan(p, None, "dequant", rows=m)
        assert pl.form == "native-gemv" and "native GEMV" in pl.reason
    assert backends.plan(p, None, "dequant", rows=backends.NATIVE_GEMV_ROWS + 1).form == "fused"
    assert backends.plan(p, "nvfp4", rows=1).form == "native-gemv"  # W4A4 on CPU: auto -> dequant -> native
    bf = backends.plan(p, None, rows=1, dtype=jnp.bfloat16)
    assert bf.form == "decode-then-dot" and "float32 activations" in bf.reason
    assert backends.plan(packed.pack(jnp.ones((64, 48)), "hif8"), None, rows=1).form == "native-gemv"
    assert backends.plan(packed.pack(jnp.ones((64, 48)), "mxfp4"), None, rows=1).form == "decode-then-dot"
    x = jax.random.normal(jax.random.key(0), (1, 1, 64), jnp.float32)
    f = jax.jit(lambda x, p: backends.packed_dot_general(x, p, (((2,), (0,)), ((), ())), return_backend=True))
    assert native_gemv.TARGET in f.lower(x, p).as_text()
    out, pl = f(x, p)
    assert pl.form == "native-gemv" and out.shape == (1, 1, 48)
    ref = np.asarray(x[0], np.float64) @ np.asarray(p.dequantize(), np.float64)
    np.testing.assert_allclose(np.asarray(out[0]), ref, rtol=1e-5, atol=1e-5)


def test_w4a4_quantizes_the_activations_in_xla_then_runs_the_kernel():
    p = _weight(128, 40, 4)
    x = jax.random.normal(jax.random.key(1), (3, 128), jnp.float32)
    out, pl = jax.jit(lambda x, p: backends.packed_matmul(x, p, gemm="dequant", activation="nvfp4-static_6"))(x, p)
    assert pl.form == "native-gemv"
    ref = np.asarray(packed.fake_quantize(x, "nvfp4-static_6"), np.float64) @ np.asarray(p.dequantize(), np.float64)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_grad_through_x_and_vmap():
    p = _weight(64, 24, 5)
    x = jax.random.normal(jax.random.key(2), (2, 64), jnp.float32)
    ct = jax.random.normal(jax.random.key(3), (2, 24), jnp.float32)
    g = jax.jit(jax.grad(lambda x: jnp.vdot(backends.packed_matmul(x, p, gemm="dequant")[0], ct)))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(ct) @ np.asarray(p.dequantize()).T, rtol=1e-5, atol=1e-5)
    ys = jax.jit(jax.vmap(lambda r: backends.packed_matmul(r[None], p, gemm="dequant")[0][0]))(x)
    np.testing.assert_allclose(np.asarray(ys), np.asarray(x) @ np.asarray(p.dequantize()), rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_clearly():
    p = _weight(64, 32, 6)
    a = p.array
    x = jnp.ones((1, 64), jnp.float32)
    with pytest.raises(TypeError, match="x float32"):
        native_gemv.nvfp4_gemv(x.astype(jnp.bfloat16), a.codes, a.scales, a.global_scale)
    with pytest.raises(TypeError, match="scales float8_e4m3fn"):
        native_gemv.nvfp4_gemv(x, a.codes, a.scales.astype(jnp.float32), a.global_scale)
    with pytest.raises(ValueError, match="K % 16"):
        native_gemv.nvfp4_gemv(jnp.ones((1, 48), jnp.float32), a.codes, a.scales, a.global_scale)
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        native_gemv.nvfp4_gemv(jnp.ones((64,), jnp.float32), a.codes, a.scales, a.global_scale)
    with pytest.raises(ValueError, match="tile_rows"):
        native_gemv.nvfp4_gemv(x, a.codes, a.scales, a.global_scale, tile_rows=4)
    with pytest.raises(ValueError, match="K = 64"):
        backends.packed_matmul(jnp.ones((1, 48), jnp.float32), p)


def test_without_a_compiler_the_plan_says_what_runs_instead(monkeypatch, tmp_path):
    # no compiler: build() raises saying so; the plan falls back to the XLA form and its reason says why
    monkeypatch.setenv("JAXLOWFP_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        native_gemv.build()
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(native_gemv, "status", lambda: (False, "the native kernel could not be built: no C++ compiler"))
    p = _weight(64, 32, 8)
    pl = backends.plan(p, None, "dequant", rows=1)
    assert pl.form == "decode-then-dot" and "native GEMV not used" in pl.reason and "no C++ compiler" in pl.reason
    x = jnp.ones((1, 64), jnp.float32)
    out, pl = backends.packed_matmul(x, p, gemm="dequant")
    assert pl.form == "decode-then-dot"
    np.testing.assert_allclose(np.asarray(out), np.asarray(x @ p.dequantize()), rtol=1e-5, atol=1e-5)


def test_the_cache_key_follows_the_source_and_jaxlib(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXLOWFP_NATIVE_CACHE", str(tmp_path))
    here = native_gemv.library_path()
    assert here.parent == tmp_path and here.suffix == ".so"
    monkeypatch.setattr(native_gemv, "_jaxlib_version", lambda: "0.0.0-other")
    assert native_gemv.library_path() != here
