PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench models clean

# Idempotent: rebuilds only when the project metadata changes.
install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

serve: install
	$(BIN)/python -m gateway --config config.yaml

test: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python -m bench.engine

# Retrains the demo models (about an hour on 2 cores); resumes from models/.train if interrupted.
models: install
	$(BIN)/python -m workers.train_demo --out models

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
