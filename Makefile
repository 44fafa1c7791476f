# The two commands: `make demo` (the main job on its defaults) and `make test` (the whole suite).
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test setup bench clean

setup:
	@bash scripts/bootstrap.sh

demo: setup
	$(PY) -m train

test: setup
	$(PY) -m pytest -n 2 --dist loadfile $(PYTEST_ARGS)

bench: setup
	$(PY) bench/formats.py
	$(PY) bench/nvfp4.py
	$(PY) bench/qat_step.py

clean:
	rm -rf $(VENV) .pytest_cache runs/*/ckpt
