# servegate — the two set-up commands a new user needs are `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
DEMO_ARGS ?=
BENCH_ARGS ?=

.PHONY: install demo test lint format bench bench-gateway bench-scheduler clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

demo: install
	$(VENV)/bin/servegate demo $(DEMO_ARGS)

lint: install
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format src tests bench
	$(VENV)/bin/ruff check --fix src tests bench

test: install lint
	$(PY) -m pytest

bench-scheduler: install
	$(PY) bench/bench_scheduler.py

bench-gateway: install
	$(PY) bench/gateway_overhead.py

bench: install
	$(VENV)/bin/servegate bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache src/*.egg-info
