# `make test`: create .venv from the repository's files and run the test suite.
# `make lint`: create .venv and run ruff (lint and format check) and mypy on the package.
# `make demo`: create .venv and run the main job (train a small transformer, tracked).
PY ?= python3
VENV := .venv

$(VENV)/.installed: requirements-dev.txt requirements-torch.txt requirements-jax.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements-dev.txt
	touch $@

.PHONY: test lint demo
test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy tandv

demo: $(VENV)/.installed
	$(VENV)/bin/tandv demo
