# The two commands: `make demo` (the main job on its defaults) and `make test` (the whole suite).
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test setup bench clean gpu-check docs interop lint

setup:
	@bash scripts/bootstrap.sh

demo: setup
	$(PY) -m train

# docs and lint run next to the tests at the lowest CPU priority (`nice -n 19`): on CI's 2 cores they take only what
# the two pytest workers leave idle (imports, subprocess start-ups, the last worker's tail) and never slow them,
# where running them after pytest would add their whole wall time; their output comes after the tests'. Any of the
# three failing fails the target. `--dist worksteal`: a worker that runs out of tests takes queued tests from the
# other (`loadfile` pinned each long file to one worker, so one worker idled while the other ran a long file).
# `--durations=25`: CI's log names the slowest tests.
# mimalloc (the cmeel-mimalloc wheel, a test extra on Linux) is preloaded into pytest and the processes it starts
# (LD_PRELOAD is inherited):
# glibc's malloc took 14 % of the CPU samples of compile-heavy tests (`perf record`: _int_malloc, malloc_consolidate),
# and four test files (docs/performance.md) ran 7 % faster with it on average, eight pairs side by side on two cores.
# Allocation does not change any result. Elsewhere than Linux nothing is preloaded.
# PYTHONDONTWRITEBYTECODE emptied: where the environment sets it (this VM's does), each of the two workers and every
# subprocess compiled jaxlowfp's and the tests' sources again (collection 9.0 s -> 5.9 s with the bytecode cached, a
# subprocess's imports 2.1 s -> 1.9 s).
MIMALLOC = $(VENV)/lib/python3*/site-packages/cmeel.prefix/lib/libmimalloc.so.3
test: setup
	@preload=$$(ls $(MIMALLOC) 2>/dev/null | head -n 1); \
	if [ "$$(uname -s)" = Linux ] && [ -z "$$preload" ]; then \
	  echo "make test: $(MIMALLOC) is missing (the cmeel-mimalloc test extra): run 'make setup'" >&2; exit 1; fi; \
	nice -n 19 $(MAKE) --no-print-directory docs lint > .make-test-checks.log 2>&1 & checks=$$!; \
	LD_PRELOAD="$$preload$${LD_PRELOAD:+:$$LD_PRELOAD}" PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n 2 --dist worksteal --durations=25 $(PYTEST_ARGS); \
	rc=$$?; \
	wait $$checks; crc=$$?; cat .make-test-checks.log; rm -f .make-test-checks.log; \
	if [ $$crc -ne 0 ]; then echo "make test: docs or lint failed (above)"; exit 1; fi; exit $$rc

# ruff (pyflakes, pycodestyle) on the library, the kernels, train, tests, bench and scripts, and mypy on the library
# ([tool.ruff] / [tool.mypy] in pyproject.toml); `make test` runs it first
lint: setup
	$(PY) -m ruff check jaxlowfp pallas_kernels train tests bench scripts
	$(PY) -m mypy

# The API reference site (mkdocs.yml: mkdocs-material + mkdocstrings), warnings as errors; `make test` runs it first.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

bench: setup
	$(PY) bench/formats.py
	$(PY) bench/nvfp4.py
	$(PY) bench/qat_step.py

# On a GPU machine, with its own python3 and no venv or installs: kernels against their twins on the device,
# throughput, the QAT step; fills jaxlowfp/verified_kernels.json and bench/RESULTS.md (exit 2 without a GPU).
# GPU_PYTHON=.venv/bin/python to use the venv instead.
gpu-check:
	PYTHONPATH=. $${GPU_PYTHON:-python3} scripts/gpu_check.py

# The live interoperability check (issue 20): our NVFP4 exports read by compressed-tensors + transformers,
# llm-compressor's export of SmolLM2 read by us, our GGUF run by llama.cpp; rewrites tests/fixtures/interop/.
# Needs the PyTorch and llama-cpp-python venvs named in scripts/interop_live.py (CT_PY, LC_PY, LLAMA_PY).
interop: setup
	$(PY) scripts/interop_live.py

clean:
	rm -rf $(VENV) .pytest_cache runs/*/ckpt
