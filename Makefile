# `make test`: create .venv from the repository's files and run the test suite.
# `make demo`: create .venv and run the main job (train a small transformer, tracked).
PY ?= python3
VENV := .venv

$(VENV)/.installed: requirements-dev.txt requirements-torch.txt requirements-jax.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements-dev.txt
	touch $@

.PHONY: test demo
test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q

demo: $(VENV)/.installed
	$(VENV)/bin/tandv demo
