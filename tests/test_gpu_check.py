"""scripts/gpu_check.py (make gpu-check) on a CPU: it refuses to run, its exactness check works in Pallas
interpret mode and catches a wrong kernel, the verified-kernels table merges correctly, the train steps build."""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


gc = _script()


def test_refuses_without_gpu(capsys):
    files = [ROOT / "bench" / "RESULTS.md", gc.VERIFIED]
    before = [f.read_text() if f.exists() else None for f in files]
    assert gc.main([]) == 2
    err = capsys.readouterr().err
    assert "needs a GPU" in err and "'cpu'" in err and "--interpret" in err
    assert [f.read_text() if f.exists() else None for f in files] == before


def test_committed_verified_table_has_the_schema():
    data = json.loads(gc.VERIFIED.read_text())
    assert data["schema"] == 1 and isinstance(data["entries"], list)
    for e in data["entries"]:
        assert {"kernel", "backend", "device_kind", "compute_capability", "dtype", "jax", "date"} <= set(e)


def test_cases_cover_every_kernel_rule_block_and_dtype():
    from jaxlowfp import dispatch, nvfp4

    cases = gc.all_cases(("triton",))
    assert {c.kernel for c in cases} == set(dispatch.KERNELS) and len(cases) == len(set(cases))
    assert len([c for c in cases if c.rule]) == 2 * len(nvfp4.KERNEL_RULES) * len(nvfp4.BLOCK_SHAPES) * 2
    every = gc.all_cases()
    assert {(c.kernel, c.backend) for c in every} == {(k, b) for k in dispatch.KERNELS for b in dispatch.KERNELS[k]}
    assert len(every) == len(cases) * len(dispatch.PALLAS_BACKENDS)
    sets = gc.input_sets(gc.case_shape(cases[0], small=False))
    assert set(sets) == {"lognormal", "x1e-4", "x1e4", "specials"}
    s = sets["specials"]
    assert np.isnan(s).any() and np.isposinf(s).any() and np.isneginf(s).any()
    sub = (s != 0) & (np.abs(s) < np.finfo(np.float32).tiny)
    assert sub.sum() >= 5 and (np.abs(s) > 1e38).sum() == 2 + 4  # subnormals; near FLT_MAX, and 4 Infs


PICKED = ["hif8.scaled_fake_quant [triton] - - float32", "nvfp4.quantize [triton] mse 1x16 bfloat16",
          "nvfp4.fake_quantize [triton] static_6 16x16 float32"]


def test_exact_in_interpret_mode():
    """The (a) comparison on three configurations (every kernel) in Pallas interpret mode, two at a time: exact."""
    cases = [c for c in gc.all_cases(("triton",)) if c.label in PICKED]
    assert len(cases) == 3
    results = gc.check_exact(cases, interpret=True, small=True, threads=2, log=lambda s: None)
    assert [r.case for r in results] == cases
    for r in results:
        assert r.passed, (r.case.label, r.error, r.mismatches)
        want = {"lognormal", "x1e-4", "x1e4", "specials"} | ({"specials, global_amax"} if r.case.rule else set())
        assert set(r.mismatches) == want
    assert "| pass |" in gc.exact_table(results)


def test_exact_check_catches_a_wrong_kernel(monkeypatch):
    """A kernel off by one code in one element, and one that raises, are failures (the check can fail)."""
    real = gc.dispatch.kernel

    def off_by_one(x, **kw):
        y = real("nvfp4.fake_quantize", "triton")(x, **kw)
        return y.at[3, 5].add(1.0)

    def broken(x, scale, clip, **kw):
        raise RuntimeError("no kernel here")

    fakes = {"nvfp4.fake_quantize": off_by_one, "hif8.scaled_fake_quant": broken}
    monkeypatch.setattr(gc.dispatch, "kernel", lambda name, backend="triton": fakes.get(name) or real(name, backend))
    cases = [gc.Case(kernel="nvfp4.fake_quantize", backend="triton", dtype="float32", rule="static_6",
                     block_shape=(1, 16)),
             gc.Case(kernel="hif8.scaled_fake_quant", backend="triton", dtype="float32")]
    wrong, raised = gc.check_exact(cases, interpret=True, small=True, log=lambda s: None)
    assert not wrong.passed and wrong.mismatches["lognormal"] == 1 and wrong.mismatches["x1e4"] == 1
    assert not raised.passed and "RuntimeError: no kernel here" in raised.error
    assert "FAIL" in gc.exact_table([wrong, raised])


def test_throughput_table_in_interpret_mode(monkeypatch):
    """(b)'s cases time the jnp twin (impl="xla", never "auto", which picks the kernel on a GPU) and the kernel,
    and the table logic runs (interpret mode: timings mean nothing)."""
    calls = []
    for name in ("quantize", "fake_quantize"):
        real = getattr(gc.nvfp4, name)

        def spy(x, real=real, **kw):
            calls.append(kw.get("impl"))
            return real(x, **kw)

        monkeypatch.setattr(gc.nvfp4, name, spy)
    header, rows, notes = gc.throughput((16, 64), jnp.bfloat16, ("triton",), interpret=True, iters=1, reps=1)
    assert len(rows) == 5 and all(len(r) == len(header) for r in rows)
    assert all(r[-2:] == ["0", "0"] for r in rows), rows  # exact, no near-ties
    assert calls and set(calls) == {"xla"}
    assert sum("4/6 overhead" in n for n in notes) == 2


def test_hif8_oracle_counts():
    x = np.array([0.0, -0.0, 1e-39, 2.0, np.inf, np.nan, 5.0], np.float32)
    y = np.array([0.0, -0.0, 0.0, 2.0, 15.0, np.nan, 0.0], np.float32)
    amax, nonfinite, under = gc.hif8_oracle(x, y)
    assert np.isnan(amax) and nonfinite == 2 and under == 2  # the subnormal and 5.0 round to zero
    assert gc.hif8_oracle(x, y, flush_subnormals=True)[2] == 1
    assert gc.hif8_oracle(x[:5], y[:5])[0] == np.float32(np.inf)


def _result(kernel, dtype, passed, rule=None, block_shape=None):
    case = gc.Case(kernel=kernel, backend="triton", dtype=dtype, rule=rule, block_shape=block_shape)
    return gc.ExactResult(case=case, shape=(8, 16), mismatches={"lognormal": 0 if passed else 3})


def test_merge_verified(tmp_path):
    path = tmp_path / "verified.json"
    path.write_text(json.dumps({"schema": 1, "entries": [
        {"kernel": "nvfp4.quantize", "backend": "triton", "device_kind": "NVIDIA B200", "compute_capability": "10.0",
         "rule": "mse", "block_shape": [1, 16], "dtype": "float32", "jax": "0.12.0", "date": "2020-01-01"},
        {"kernel": "nvfp4.quantize", "backend": "triton", "device_kind": "NVIDIA H200", "compute_capability": "9.0",
         "rule": "mse", "block_shape": [1, 16], "dtype": "float32", "jax": "0.11.2", "date": "2020-01-01"},
    ]}))
    dev = dict(device_kind="NVIDIA H200", compute_capability="9.0", jax_version="0.11.2", date="2026-01-02")
    out = gc.merge_verified(path, [
        _result("hif8.scaled_fake_quant", "bfloat16", True),
        _result("nvfp4.quantize", "float32", False, "mse", (1, 16)),  # now fails on the H200: entry removed
        _result("nvfp4.fake_quantize", "bfloat16", True, "static_6", (16, 16)),
    ], **dev)
    assert json.loads(path.read_text()) == out and out["schema"] == 1
    entries = {(e["kernel"], e["device_kind"]): e for e in out["entries"]}
    assert set(entries) == {("nvfp4.quantize", "NVIDIA B200"), ("hif8.scaled_fake_quant", "NVIDIA H200"),
                            ("nvfp4.fake_quantize", "NVIDIA H200")}
    assert entries[("hif8.scaled_fake_quant", "NVIDIA H200")] == {
        "kernel": "hif8.scaled_fake_quant", "backend": "triton", "device_kind": "NVIDIA H200",
        "compute_capability": "9.0", "dtype": "bfloat16", "jax": "0.11.2", "date": "2026-01-02"}
    assert entries[("nvfp4.fake_quantize", "NVIDIA H200")]["block_shape"] == [16, 16]
    again = gc.merge_verified(path, [_result("hif8.scaled_fake_quant", "bfloat16", True)],
                              **{**dev, "date": "2026-02-03"})
    assert len(again["entries"]) == 3  # same key: replaced, not duplicated
    path.write_text(json.dumps({"schema": 2, "entries": []}))
    with pytest.raises(ValueError, match="schema"):
        gc.merge_verified(path, [], **dev)


def test_train_steps_build(monkeypatch):
    """(c) builds its steps from the public step builder (running them is for the GPU: compiling takes ~30 s here;
    the Pallas variant is built under interpret mode, the only Pallas a CPU has), with the GEMM-backend variants
    the device runs: on this CPU both low-precision backends (jax's emulation); on a stand-in A100 neither."""
    monkeypatch.setenv(gc.dispatch.INTERPRET_ENV, "1")
    recipes, skipped = gc.gemm_variants(jax.devices()[0])
    assert set(recipes) == {"fp8_delayed (dequant)", "fp8_delayed (fp8)", "NVFP4 4/6 W4A4 (dequant)",
                            "NVFP4 4/6 W4A4 (scaled_matmul)"} and not skipped
    assert recipes["fp8_delayed (fp8)"].gemm == "fp8"
    a100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100", compute_capability="8.0")
    on_a100, skipped = gc.gemm_variants(a100)
    assert set(on_a100) == {"fp8_delayed (dequant)", "NVFP4 4/6 W4A4 (dequant)"}
    assert "8.9" in skipped["fp8_delayed (fp8)"] and "10.0" in skipped["NVFP4 4/6 W4A4 (scaled_matmul)"]
    steps, tokens = gc.build_train_steps("tiny", batch=1, seq=8, backends=("triton",),
                                         overrides=dict(d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=64),
                                         recipes={"fp8_delayed (fp8)": recipes["fp8_delayed (fp8)"]})
    assert set(steps) == {"hp", "qat (jnp)", "qat (pallas, triton)", "fp8_delayed (fp8)"}
    assert tokens.shape == (1, 9) and tokens.dtype == jnp.int32


def test_packed_gemm_check_runs_on_cpu():
    """(f)'s logic at a small shape: NVFP4 and FP8, both packed backends within float32 summation order of
    fake-quant (on this CPU scaled_matmul and the float8 dot are jax's emulation, so they run, are not native and
    put no cuDNN / cuBLASLt call in the HLO), and the table renders."""
    assert all(k % 16 == 0 and n % 16 == 0 for _, k, n in gc.LLAMA8B_PROJECTIONS)
    rows = gc.packed_gemm_check(gc.SMALL_PROJECTIONS, tokens=16, reps=1)
    assert [(r["format"], r["real"]) for r in rows] == [("NVFP4 4/6 W4A4", "scaled_matmul"), ("FP8 E4M3 W8A8", "fp8")]
    for row in rows:
        assert row["real exact"] is True and row["dequant exact"] is True
        assert row["real native"] is False and row["real calls"] == 0 and row["bf16 max |err| / bound"] > 1
    table = gc.packed_gemm_table(rows)
    assert "small 64x32" in table and "fp8: " in table


def test_f8_dots_reads_operand_types_per_computation():
    """(c) and (f) count the dots that read float8 operands as they are (XLA's Triton FP8 GEMM); the names in an
    optimized HLO text repeat across computations, so the types are looked up in the dot's own computation."""
    hlo = """HloModule m

%triton_gemm (param_0: f8e4m3fn[32,64], param_1: f8e4m3fn[64,16]) -> f32[32,16] {
  %param_0 = f8e4m3fn[32,64]{1,0} parameter(0)
  %param_1 = f8e4m3fn[64,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[32,16]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_computation (param_0: f32[32,64], param_1: f32[64,16]) -> f32[32,16] {
  %param_0 = f32[32,64]{1,0} parameter(0)
  %param_1 = f32[64,16]{1,0} parameter(1)
  ROOT %dot.2 = f32[32,16]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    assert gc.f8_dots(hlo) == 1
    assert gc.f8_dots(hlo.replace("%triton_gemm", "%other").split("\n%fused")[1]) == 0
