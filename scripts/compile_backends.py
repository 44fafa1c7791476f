"""Compile the packed-GEMM backends (`jaxlowfp.backends`) for Blackwell and Hopper on a host without a GPU, and show
what XLA made of the product: cuDNN's block-scaled GEMM, cuBLASLt's FP8 GEMM, or a float dot.

The mechanism of ``scripts/compile_kernels.py`` (reused from it): a compile-only CUDA device built from XLA's own
target description (``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)``), a jit
lowered under a mesh of it and ``.compile()``d: XLA's GPU pipeline runs for real (GEMM rewriting, cuDNN custom-call
rewriting, fusion, Triton, ptxas), with no device and no cuDNN library (XLA emits the cuDNN call; cuDNN itself
builds its kernel plan when the executable is loaded on a GPU, which is what ``make gpu-check`` does).

Cases (M = 256 tokens, a 1024 x 2048 projection), each with ``gemm="auto"`` on the target's device, so the
choice is asserted too:
  - ``nvfp4 W4A4 static_6`` and ``nvfp4 W4A4 4/6 (mse)`` (activations quantized by jaxlowfp's quantizer, Four Over
    Six included, inside the program), ``nvfp4 16x16 weights``, ``mxfp8 W8A8``, and ``nvfp4 W4A4 4/6, per-token
    scales`` (`backends.scaled_matmul_rows`: each row quantized with its own global scale, factored out of the
    product; what a packed layer with ``activation_scale="token"`` runs on "scaled_matmul"): sm_100a (B200);
  - ``mxfp4 W4A4`` with ``gemm="scaled_matmul"`` asked for: XLA expands it into a float32 dot on sm_100a (no
    cuDNN call), which is why "auto" takes "dequant" for MXFP4 and the plan does not call it native;
  - ``fp8 W8A8``: sm_90a (H100), with XLA's default GEMM choice (deviceless: no autotuning, so its Triton GEMM
    emitter, which keeps the float8 operands) and with ``xla_gpu_enable_triton_gemm=False`` (cuBLASLt);
  - ``fp8 W8A8, per-token scales`` (`backends.fp8_rows`: each row's E4M3 codes with its own scale, applied to the
    output; what a packed FP8 layer with ``activation_scale="token"`` or ``"static"`` runs on "fp8"): sm_90a;
  - QAT: the gradient of ``sum(qat.linear(x, w))`` (forward and backward) for ``fp8_delayed`` with
    ``Recipe(gemm="fp8")`` on sm_90a and NVFP4 4/6 W4A4 with ``gemm="scaled_matmul"`` on sm_100a: the forward
    product becomes the FP8 / block-scaled GEMM, the backward's GEMMs stay in bfloat16 (the straight-through
    backward is the fake-quant product's); and an MoE layer's grouped GEMM (``ops.ragged_dot``, 8 experts) with
    ``gemm="fp8"`` on sm_90a.

For each: the custom-call targets of the lowered StableHLO and of the optimized HLO, the GEMM fusions' kinds and
whether their operands are float8, and the number of plain ``dot`` instructions left outside them.

    .venv/bin/python scripts/compile_backends.py          # prints the table (needs the gpu-compile extra)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import compile_kernels as ck  # noqa: E402  (also puts the gpu-compile directory on sys.path)

M, K, N = 256, 1024, 2048
ROWS = "scaled_matmul_rows"  # the backend field of a case run by backends.scaled_matmul_rows
FP8_ROWS = "fp8_rows"  # ... by backends.fp8_rows (per-token activation scales on the float8 GEMM)
# name -> (target, weight format, activation format, backend, compiler options)
CASES: dict[str, tuple[str, str, str, str, dict]] = {
    "nvfp4 W4A4 static_6": ("sm_100 (B200)", "nvfp4-static_6", "nvfp4-static_6", "auto", {}),
    "nvfp4 W4A4 4/6 (mse)": ("sm_100 (B200)", "nvfp4-mse", "nvfp4-mse", "auto", {}),
    "nvfp4 16x16 weights, 4/6 activations": ("sm_100 (B200)", "nvfp4-mse-16x16", "nvfp4-mse", "auto", {}),
    "mxfp8 W8A8": ("sm_100 (B200)", "mxfp8", "mxfp8", "auto", {}),
    "mxfp4 W4A4 (scaled_matmul asked for)": ("sm_100 (B200)", "mxfp4", "mxfp4", "scaled_matmul", {}),
    "nvfp4 W4A4 4/6, per-token scales": ("sm_100 (B200)", "nvfp4-mse", "nvfp4-mse", ROWS, {}),
    "fp8 W8A8 (XLA's default GEMM)": ("sm_90 (H100)", "fp8", "fp8", "auto", {}),
    "fp8 W8A8 (cuBLASLt: no Triton GEMM)": ("sm_90 (H100)", "fp8", "fp8", "auto",
                                            {"xla_gpu_enable_triton_gemm": False}),
    "fp8 W8A8, per-token scales (cuBLASLt)": ("sm_90 (H100)", "fp8", "fp8", FP8_ROWS,
                                              {"xla_gpu_enable_triton_gemm": False}),
    # a QAT training step's gradient (qat.linear under jax.value_and_grad) with the forward product on a backend
    "QAT fp8_delayed step, gemm='fp8'": ("sm_90 (H100)", "fp8", "", "qat:fp8", {"xla_gpu_enable_triton_gemm": False}),
    "QAT NVFP4 4/6 W4A4 step, gemm='scaled_matmul'": ("sm_100 (B200)", "nvfp4", "", "qat:scaled_matmul", {}),
    # the experts' grouped GEMM (ops.ragged_dot, 8 experts) of a QAT step on the E4M3 codes
    "QAT MoE experts step, gemm='fp8'": ("sm_90 (H100)", "fp8", "", "qat_experts:fp8",
                                         {"xla_gpu_enable_triton_gemm": False}),
}
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_STABLEHLO_CALL = re.compile(r"stablehlo\.custom_call @([\w$.]+)\(.*?:\s*\(([^)]*)\)")
_KIND = re.compile(r'"kind":"(__[\w$]+)"')


def analyse(lowered: str, optimized: str) -> dict:
    """What the product became: custom-call targets (lowered / optimized), GEMM fusion kinds, whether the fused
    GEMMs' computations take float8 operands, and plain dots left in the entry computation."""
    calls = [(m.group(1), m.group(2)) for m in _STABLEHLO_CALL.finditer(lowered)]
    comps = re.split(r"\n(?=\S)", optimized)  # one HLO computation per chunk
    gemm_comps = [c for c in comps if " dot(" in c and "fused" in c.split("\n", 1)[0]]
    entry = next((c for c in comps if c.startswith("ENTRY")), "")
    return {
        "lowered_custom_calls": [name for name, _ in calls],
        "lowered_operand_types": [types for _, types in calls],
        "optimized_custom_calls": sorted(set(_TARGET.findall(optimized))),
        "gemm_fusions": sorted(set(_KIND.findall(optimized))),
        "fused_dot_float8": bool(gemm_comps) and all(re.search(r"f8e4m3fn\[", c) for c in gemm_comps),
        "entry_dots": len(re.findall(r" dot\(", entry)),
        "native": None,
    }


def compile_cases(names: list[str]) -> dict[str, dict]:
    """Compile `names` in this process (a fresh one: see ``scripts/compile_kernels.py``)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxlowfp import backends, packed, qat
    from jaxlowfp.scaling import CurrentScaling

    jax.config.update("jax_enable_compilation_cache", False)
    ck.check_toolchain()
    out = {}
    for name in names:
        target, wf, af, backend, options = CASES[name]
        text = ck.target_config({**ck.TARGETS, **ck.EXTRA_TARGETS}[target])
        topo = topologies.get_topology_desc(platform="cuda", target_config=text, topology="1x1x1")
        mesh = topologies.make_mesh(topo, (1,), ("x",))
        device = topo.devices[0]
        rep = NamedSharding(mesh, PartitionSpec())
        if backend.startswith(("qat:", "qat_experts:")):
            out[name] = _compile_qat(name, qat, jax, jnp, mesh, rep, device)
            continue
        # only the shapes, dtypes and static metadata are used: traced, not run (no CPU compile of the quantizer)
        w = jax.eval_shape(lambda: packed.pack(jnp.zeros((K, N), jnp.float32), wf))
        abstract_w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), w)
        x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=rep)
        plan = backends.plan(w, af, {ROWS: "scaled_matmul", FP8_ROWS: "fp8"}.get(backend, backend), device=device)

        def fn(x, w):
            if backend in (ROWS, FP8_ROWS):  # per-token amax, as PackedLinear computes it
                amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
                if backend == FP8_ROWS:
                    return backends.fp8_rows(x, w, CurrentScaling(target_max=448.0, granularity="token"), amax)
                return backends.scaled_matmul_rows(x, w, packed.as_format(af).rule, amax)
            return backends.packed_dot_general(x, w, (((1,), (0,)), ((), ())), gemm=backend, activation=af,
                                               device=device)

        out[name] = _compiled(jax, fn, (x, abstract_w), mesh, rep, options, target, plan)
    return out


def _compiled(jax: Any, fn: Any, args: tuple, mesh: Any, rep: Any, options: dict, target: str, plan: Any) -> dict:
    """`analyse` of ``jit(fn)`` lowered on `args` under `mesh` and compiled for the target with `options`."""
    with tempfile.TemporaryDirectory() as tmp, jax.set_mesh(mesh):
        lowered = jax.jit(fn, in_shardings=(rep,) * len(args)).lower(*args)
        compiled = lowered.compile(compiler_options={"xla_gpu_cuda_data_dir": str(
            ck._cuda_dir(Path(tmp) / "cuda", ck.check_toolchain())), **options})
        res = analyse(lowered.as_text(), compiled.as_text())
    res.update(target=target, backend=plan.backend, native=plan.native, options=options)
    return res


def _compile_qat(name: str, qat: Any, jax: Any, jnp: Any, mesh: Any, rep: Any, device: Any) -> dict:
    import dataclasses

    from jaxlowfp import ops

    target, fmt, _, backend, options = CASES[name]
    recipe = dataclasses.replace(qat.named_recipe(fmt), gemm=backend.split(":", 1)[1])
    experts = backend.startswith("qat_experts:")
    if experts:  # the forward's recipe of an MoE layer: per-tensor (per-expert) scales, no gradient quantization
        recipe = dataclasses.replace(recipe, grad=None)
    plan = (qat.gemm.grouped_plan if experts else qat.gemm.plan)(recipe, device=device)
    groups = jnp.full((8,), M // 8, jnp.int32)

    def step(x, w):
        def loss(x, w):
            if experts:
                y, _, _ = ops.ragged_dot(x, w, groups, recipe=recipe)
            else:
                y, _, _ = qat.linear(x, w, recipe=recipe, state=recipe.init())
            return jnp.sum(y.astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1))(x, w)

    x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=rep)
    w = jax.ShapeDtypeStruct((8, K, N) if experts else (K, N), jnp.bfloat16, sharding=rep)
    return _compiled(jax, step, (x, w), mesh, rep, options, target, plan)


def run(names: list[str] | None = None, timeout: float = 1200.0) -> dict[str, dict]:
    """Compile `names` (default all) in one subprocess; raises ck.CompileCheckError with its stderr on failure."""
    ck.check_toolchain()
    names = list(CASES) if names is None else names
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.run([sys.executable, __file__, "--worker-out", str(out), "--cases", json.dumps(names)],
                              env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)
        if proc.returncode != 0 or not out.exists():
            raise ck.CompileCheckError(f"the compile worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def table(results: dict[str, dict]) -> str:
    sys.path.insert(0, str(ROOT / "bench"))
    from _results import markdown_table

    rows = [[name, r["target"], f"{r['backend']}{' (native)' if r['native'] else ''}",
             ", ".join(r["lowered_custom_calls"]) or "-", ", ".join(r["optimized_custom_calls"]) or "-",
             ", ".join(r["gemm_fusions"]) or "-", "yes" if r["fused_dot_float8"] else "-", r["entry_dots"]]
            for name, r in results.items()]
    return markdown_table(["case", "target", "auto picked", "lowered custom call", "optimized custom calls",
                           "GEMM fusions", "fused GEMM on float8", "plain dots"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--cases", type=json.loads, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_out:
        args.worker_out.write_text(json.dumps(compile_cases(args.cases)))
        return 0
    try:
        print(table(run()))
    except ck.CompileCheckError as e:
        print(f"scripts/compile_backends.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
