"""The packed-GEMM backends compile, deviceless, to the GPUs' low-precision GEMMs (scripts/compile_backends.py):
NVFP4 (standard and Four Over Six activations, 1x16 and 16x16 weights) and MXFP8 W4A4 / W8A8 on sm_100a become
cuDNN's block-scaled GEMM (MXFP4 does not: XLA expands it into a float32 dot, and "auto" does not claim it), FP8
W8A8 on sm_90a cuBLASLt's FP8 GEMM (or XLA's Triton GEMM on the float8 operands, its default without autotuning), with
no float dot of dequantized values left; ``gemm="auto"`` picks them on those devices.

XLA's GPU compiler runs for real against its own description of a B200 and an H100 (one subprocess); no GPU and
no cuDNN library are needed to emit the cuDNN call, so what this cannot show is cuDNN accepting the plan at load
time and the numbers on the device: ``make gpu-check`` (scripts/gpu_check.py) does that on a GPU. Needs the
gpu-compile extra, as tests/test_gpu_compile.py.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compile_backends.py"


def _script():
    spec = importlib.util.spec_from_file_location("compile_backends", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


cb = _script()


@pytest.fixture(scope="module")
def compiled():
    return cb.run()


BLOCK_SCALED = [n for n, c in cb.CASES.items() if c[0] == "sm_100 (B200)" and not n.startswith(("mxfp4", "QAT"))]


@pytest.mark.parametrize("name", BLOCK_SCALED)
def test_block_scaled_products_become_cudnn_block_scaled_gemm_on_sm100(compiled, name):
    r = compiled[name]
    assert r["backend"] == "scaled_matmul" and r["native"]  # what auto picked on a B200
    assert r["lowered_custom_calls"] == ["__op$block_scaled_dot"]
    elem = "f8E4M3FN" if name.startswith("mxfp8") else "f4E2M1FN"
    scale = "f8E8M0FNU" if name.startswith("mxfp8") else "f8E4M3FN"
    types = r["lowered_operand_types"][0]
    assert types.count(elem) >= 2 and scale in types, types  # the codes and the block scales, not floats
    assert "__cudnn$blockScaledDot" in r["optimized_custom_calls"]
    assert r["entry_dots"] == 0 and r["gemm_fusions"] == []  # no float GEMM of dequantized values


def test_fp8_products_become_fp8_gemms_on_sm90(compiled):
    lt = compiled["fp8 W8A8 (cuBLASLt: no Triton GEMM)"]
    assert lt["backend"] == "fp8" and lt["native"]
    assert "__cublas$lt$matmul$f8" in lt["optimized_custom_calls"] and lt["entry_dots"] == 0
    rows = compiled["fp8 W8A8, per-token scales (cuBLASLt)"]  # each row's scale outside the GEMM
    assert rows["backend"] == "fp8" and "__cublas$lt$matmul$f8" in rows["optimized_custom_calls"]
    assert rows["entry_dots"] == 0
    default = compiled["fp8 W8A8 (XLA's default GEMM)"]
    assert default["gemm_fusions"] and default["fused_dot_float8"] and default["entry_dots"] == 0
    assert not any("cublas" in t and "f8" not in t for t in default["optimized_custom_calls"])


def test_mxfp4_is_not_sent_to_cudnn_and_auto_does_not_claim_it(compiled):
    """jax 0.12's XLA expands an MXFP4 scaled_matmul (E2M1 codes, E8M0 scales per 32) on sm_100a into convert,
    multiply and a float32 dot: no cuDNN block-scaled GEMM. So `backends.plan` reports it not native and "auto"
    takes the dequant backend; if a newer XLA sends MXFP4 to cuDNN, this test fails and the claim can be made."""
    r = compiled["mxfp4 W4A4 (scaled_matmul asked for)"]
    assert r["backend"] == "scaled_matmul" and not r["native"]  # what the plan says of it on a B200
    assert r["lowered_custom_calls"] == ["__op$block_scaled_dot"]
    assert "__cudnn$blockScaledDot" not in r["optimized_custom_calls"] and r["gemm_fusions"] == []


def test_qat_steps_run_their_forward_on_the_low_precision_gemm(compiled):
    """A QAT step (forward and backward of qat.linear) with ``Recipe(gemm=...)``: the forward product is the FP8 /
    block-scaled GEMM on the quantizers' codes; the backward keeps its bfloat16 GEMMs (the fake-quant VJP)."""
    fp8 = compiled["QAT fp8_delayed step, gemm='fp8'"]
    assert fp8["backend"] == "fp8" and fp8["native"]
    assert "__cublas$lt$matmul$f8" in fp8["optimized_custom_calls"]
    assert "__cublas$lt$matmul" in fp8["optimized_custom_calls"]  # the backward's bfloat16 GEMMs
    nv = compiled["QAT NVFP4 4/6 W4A4 step, gemm='scaled_matmul'"]
    assert nv["backend"] == "scaled_matmul" and nv["native"]
    assert "__op$block_scaled_dot" in nv["lowered_custom_calls"]
    assert "__cudnn$blockScaledDot" in nv["optimized_custom_calls"]
    assert nv["gemm_fusions"]  # the backward's bfloat16 GEMMs (XLA's Triton GEMM)
    moe = compiled["QAT MoE experts step, gemm='fp8'"]  # lax.ragged_dot on the E4M3 codes: cuBLASLt FP8 GEMMs
    assert moe["backend"] == "fp8" and moe["native"] and "__cublas$lt$matmul$f8" in moe["optimized_custom_calls"]
