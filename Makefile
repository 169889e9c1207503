# `make test`: create .venv from the repository's files and run the test suite.
# `make lint`: create .venv and run ruff (lint and format check) and mypy on the package.
# `make demo`: create .venv and run the main job (train a small transformer, tracked).
# `make docs`: create .venv and build the documentation site into site/ (warnings are errors).
# `make test-lowest`: the suite in .venv-lowest, every declared dependency at its floor.
PY ?= python3
VENV := .venv

$(VENV)/.installed: requirements-dev.txt requirements-torch.txt requirements-jax.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements-dev.txt
	touch $@

.PHONY: test lint demo docs test-lowest
test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q --durations=15 -n auto --dist loadfile --no-loadscope-reorder

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy tandv

demo: $(VENV)/.installed
	$(VENV)/bin/tandv demo

# mkdocs.yml at the root; --strict makes a broken link, anchor or snippet an error
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The floors in pyproject.toml are honest only if the suite passes with them installed.
test-lowest:
	rm -rf .venv-lowest
	$(PY) -m venv .venv-lowest
	.venv-lowest/bin/pip install -q --upgrade pip
	$(PY) .ci/floors.py > .venv-lowest/floors.txt
	.venv-lowest/bin/pip install -q -r requirements-dev.txt -c .venv-lowest/floors.txt
	.venv-lowest/bin/python -m pytest -q
