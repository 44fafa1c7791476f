"""The Pallas kernels compile, not only lower, for A100 (sm_80), H100 (sm_90a) and B200 (sm_100a) on this CPU host,
without register spills or shared-memory overflow (scripts/compile_kernels.py): every configuration for sm_80, every
kernel for each target (test_every_kernel_compiles_for_every_target_without_spills says why not all 126 compiles;
``scripts/compile_kernels.py`` runs that full sweep).

Triton's GPU passes and ptxas run for real against XLA's own description of each GPU; one subprocess per target.
Needs the gpu-compile extra (part of the test extras): a missing wheel fails here with the install command.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compile_kernels.py"


def _script():
    spec = importlib.util.spec_from_file_location("compile_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


ck = _script()

# Real `ptxas -v` output (12.9, sm_90a) for a kernel that spills and one that does not.
PTXAS_SPILL = """\
ptxas warning : Registers are spilled to local memory in function 'nvfp4_fake_quantize_mse', 17208 bytes spill stores, \
22496 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'nvfp4_fake_quantize_mse' for 'sm_90a'
ptxas info    : Function properties for nvfp4_fake_quantize_mse
    6880 bytes stack frame, 17208 bytes spill stores, 22496 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 6880 bytes cumulative stack size
ptxas info    : Compile time = 1991.677 ms
"""
PTXAS_CLEAN = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'hif8_scaled_fake_quant' for 'sm_80'
ptxas info    : Function properties for hif8_scaled_fake_quant
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 113 registers, used 1 barriers, 1024 bytes smem, 416 bytes cmem[0]
ptxas info    : Compile time = 98.876 ms
ptxas info    : Compiling entry function 'loop_select_fusion' for 'sm_80'
ptxas info    : Function properties for loop_select_fusion
ptxas info    : Used 12 registers, used 0 barriers, 376 bytes cmem[0]
"""
THUNKS = """\
001: kCustomKernel [source       | next=002 (1)] input_concatenate_fusion grid: [1, 1, 1] threads: [1, 1, 1]  \
shared_memory: 0 bytes
002: kCustomKernel [prev=001 (1) | next=003 (1)] hif8_scaled_fake_quant grid: [256, 1, 1] threads: [256, 1, 1]  \
shared_memory: 32 bytes
"""


def test_parse_ptxas_report():
    info = ck.parse_ptxas(PTXAS_SPILL + PTXAS_CLEAN)
    spill = info["nvfp4_fake_quantize_mse"]
    assert (spill.arch, spill.registers, spill.spill_stores, spill.spill_loads, spill.stack_frame) == (
        "sm_90a", 32, 17208, 22496, 6880)
    clean = info["hif8_scaled_fake_quant"]
    assert (clean.registers, clean.spill_stores, clean.spill_loads, clean.static_smem) == (113, 0, 0, 1024)
    assert info["loop_select_fusion"].registers == 12
    assert ck.parse_launches(THUNKS)["hif8_scaled_fake_quant"] == ((256, 1, 1), 256, 32)


def _stats(**kw):
    base = dict(target="sm_90 (H100)", config=ck.all_configs()[0], name="k", arch="sm_90a", registers=100,
                spill_stores=0, spill_loads=0, stack_frame=0, smem=1024, smem_limit=232448, threads=128,
                grid=(1, 1, 1), other_spills=(), seconds=1.0)
    return ck.KernelStats(**{**base, **kw})


def test_spills_and_shared_memory_overflow_are_problems():
    assert _stats().problems() == []
    (msg,) = _stats(spill_stores=8, spill_loads=4).problems()
    assert "spills registers" in msg and "sm_90 (H100)" in msg and "hif8.scaled_fake_quant" in msg
    (msg,) = _stats(smem=300_000).problems()
    assert "300000 bytes of shared memory" in msg and "allows 232448" in msg
    assert "input_reduce_fusion" in _stats(other_spills=("input_reduce_fusion",)).problems()[0]


# compile_target must run in a fresh process (jax registers the CUDA plugin's topology once, when it first
# discovers plugins; a pytest worker may have started jax before this file put the plugin on sys.path)
BAD_KERNEL = """
import importlib.util, json, sys
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
spec = importlib.util.spec_from_file_location("compile_kernels", sys.argv[1])
ck = importlib.util.module_from_spec(spec); sys.modules[spec.name] = ck; spec.loader.exec_module(ck)

def body(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

def bad_kernel(config):  # a 3-element block: Triton needs power-of-two sizes
    spec = pl.BlockSpec((3,), lambda i: (0,))
    fn = pl.pallas_call(body, grid=(1,), in_specs=[spec], out_specs=spec,
                        out_shape=jax.ShapeDtypeStruct((3,), jnp.float32),
                        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1))
    return fn, (jax.ShapeDtypeStruct((3,), jnp.float32),)

ck.build = bad_kernel
config = ck.all_configs()[0]
stats, errors = ck.compile_target("sm_80 (A100)", [config], log=lambda s: None)
print(json.dumps({"label": config.label, "stats": len(stats), "errors": errors}))
"""


def test_compile_error_names_kernel_configuration_and_target():
    """A kernel that fails to compile for the target is reported with its configuration, not raised."""
    import json
    import os
    import subprocess

    p = subprocess.run([sys.executable, "-c", BAD_KERNEL, str(SCRIPT)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["stats"] == 0 and len(got["errors"]) == 1, got
    error = got["errors"][0]
    assert error.startswith(f"{got['label']} for sm_80 (A100): compile error:") and "power of 2" in error, error


def test_configurations_cover_every_kernel_rule_block_and_dtype():
    from jaxlowfp import dispatch, nvfp4

    configs = ck.all_configs()
    assert len(configs) == len(set(configs)) and {c.backend for c in configs} == {"triton"}
    both = ck.all_configs(("triton", "mosaic"))
    assert {(c.kernel, c.backend) for c in both} == {(k, b) for k in dispatch.KERNELS for b in dispatch.KERNELS[k]}
    assert {c.kernel for c in configs} == set(dispatch.KERNELS)
    want = {(k, r, tuple(b), d) for k in ("nvfp4.quantize", "nvfp4.fake_quantize") for r in nvfp4.KERNEL_RULES
            for b in nvfp4.BLOCK_SHAPES for d in ("float32", "bfloat16")}
    assert {(c.kernel, c.rule, c.block_shape, c.dtype) for c in configs if c.rule} == want
    assert {c.dtype for c in configs if c.rule is None} == {"float32", "bfloat16"}
    for c in configs:  # ragged against the default tiles: a partial last tile
        assert c.shape[1] % 512 and (c.shape[0] * c.shape[1]) % 8192
        assert c.block_shape == (16, 16) or c.shape[0] % 16


FULL_SWEEP_TARGET = "sm_80 (A100)"
# (kernel, rule, block shape, dtype) compiled on the other targets: one per kernel and target, the two targets
# together covering both dtypes and both block shapes of each kernel, 4/6 rules where the most registers are used
# (bench/RESULTS.md: HiF8 float32 125-128, NVFP4 fake_quantize mae/mse 1x16 bfloat16 44-48, quantize abs_max/mae
# 16x16 40-48 registers)
SPOT_CHECKS = {
    "sm_90 (H100)": [("hif8.scaled_fake_quant", None, None, "float32"),
                     ("nvfp4.quantize", "mse", (16, 16), "bfloat16"),
                     ("nvfp4.fake_quantize", "mse", (1, 16), "bfloat16")],
    "sm_100 (B200)": [("hif8.scaled_fake_quant", None, None, "bfloat16"),
                      ("nvfp4.quantize", "mae", (1, 16), "float32"),
                      ("nvfp4.fake_quantize", "abs_max", (16, 16), "float32")],
}


def _selection() -> dict:
    configs = ck.all_configs()
    key = {(c.kernel, c.rule, c.block_shape, c.dtype): c for c in configs}
    return {FULL_SWEEP_TARGET: configs, **{t: [key[k] for k in ks] for t, ks in SPOT_CHECKS.items()}}


def test_every_kernel_compiles_for_every_target_without_spills():
    """Every configuration (kernel x rule x block shape x dtype, 42) compiles without spills on sm_80 (A100), the
    target whose ptxas uses the most registers in nearly every configuration (bench/RESULTS.md); every kernel
    compiles on sm_90a and sm_100a too, in the configurations of SPOT_CHECKS. The configurations differ in their
    Triton code (rule, block shape and dtype are all compiled into the kernel), but their register use moves little
    between targets, so compiling each of the 42 on all three (126 compiles, about a second of CPU each) added
    little; the full sweep on every target is the command ``scripts/compile_kernels.py`` (it rewrites the table in
    bench/RESULTS.md; ``--no-write`` only prints)."""
    select = _selection()
    configs = ck.all_configs()
    assert set(select) == set(ck.TARGETS) and select[FULL_SWEEP_TARGET] == configs
    for target, chosen in select.items():
        assert {c.kernel for c in chosen} == {c.kernel for c in configs}, f"{target}: every kernel on every target"
    for kernel in {c.kernel for c in configs}:  # the spot checks: both dtypes and (NVFP4) both block shapes
        spots = [c for t in SPOT_CHECKS for c in select[t] if c.kernel == kernel]
        assert {c.dtype for c in spots} == {"float32", "bfloat16"}, kernel
        assert {c.block_shape for c in spots} == ({None} if kernel in ck.HIF8_KERNELS else {(1, 16), (16, 16)})
    try:
        stats, errors, _ = ck.run_targets(list(ck.TARGETS), jobs=2, select=select)
    except ck.CompileCheckError as e:
        pytest.fail(str(e))
    if errors:
        pytest.fail(f"{len(errors)} problem(s) compiling the Pallas kernels for real GPUs "
                    "(scripts/compile_kernels.py prints the full table):\n" + "\n".join(f"- {e}" for e in errors))
    arch = {"sm_80 (A100)": "sm_80", "sm_90 (H100)": "sm_90a", "sm_100 (B200)": "sm_100a"}
    for target in ck.TARGETS:
        got = [s for s in stats if s.target == target]
        assert sorted(s.config.label for s in got) == sorted(c.label for c in select[target]), (
            f"{target}: not every selected configuration was compiled")
        assert {s.arch for s in got} == {arch[target]}, f"{target}: ptxas compiled for {({s.arch for s in got})}"
        assert all(s.registers > 0 and s.threads > 0 for s in got)
