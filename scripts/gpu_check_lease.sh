#!/usr/bin/env bash
# `make gpu-check` split for a short GPU lease (one `run` call of the device tool, about 8 minutes of device time):
# the GEMM phases first, then the Pallas kernels, so a lease cut short still returns the newest work. Uses the GPU
# machine's own python3 and JAX (jax >= 0.11.2, no installs). Logs, bench/RESULTS.md and the verified table are
# copied to $OUT (the device tool's return folder) when it is set.
#   1. (c) QAT train steps (HiF8, and FP8 delayed / NVFP4 4/6 W4A4 on each GEMM backend the device has) and
#      (f) packed NVFP4 / FP8 GEMMs against fake-quant and bf16, printed only (no kernel configuration checked);
#   2. (f) FP8 again with XLA's Triton GEMM off, so the product is cuBLASLt's FP8 GEMM;
#   3. (a) every Pallas kernel configuration against its twin, writing jaxlowfp/verified_kernels.json and the
#      "GPU check" section of bench/RESULTS.md (paste the (c) / (f) tables of steps 1-2 into it afterwards).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=.
out=${OUT:-/tmp/gpu_check_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout "${T_CF:-230}" python3 scripts/gpu_check.py --only NO_KERNEL --skip-throughput --no-write 2>&1 | tee "$out/cf.log"
echo "steps (c)+(f) rc=${PIPESTATUS[0]}"
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout "${T_F:-70}" python3 scripts/gpu_check.py --only NO_KERNEL \
  --skip-throughput --skip-train --packed-formats fp8 --no-write 2>&1 | tee "$out/f_cublas.log"
echo "step (f) cuBLASLt rc=${PIPESTATUS[0]}"
timeout "${T_A:-200}" python3 scripts/gpu_check.py --skip-train --skip-packed --skip-throughput 2>&1 | tee "$out/a.log"
echo "step (a) rc=${PIPESTATUS[0]}"
cp bench/RESULTS.md jaxlowfp/verified_kernels.json "$out/"
