# omni-mesh developer targets; CI calls `make test` (see .ci/run).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install lint typecheck test check run clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,dev]'
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(BIN)/ruff check omni_mesh tests benchmarks
	$(BIN)/ruff format --check omni_mesh tests benchmarks

typecheck: install
	$(BIN)/mypy

test: install
	$(BIN)/pytest -q -p no:cacheprovider

check: lint typecheck test

clean:
	rm -rf $(VENV) *.egg-info .mypy_cache .ruff_cache .pytest_cache

run: install
	bash scripts/run-demo.sh
