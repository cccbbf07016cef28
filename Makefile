# Two entry points, each creating .venv on first use: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): requirements-cpu.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements-cpu.txt
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $(STAMP)

.PHONY: demo test env
env: $(STAMP)

# Trains a tiny GPT on 4 CPU processes under V-Half, then 1F1B, and compares their memory.
demo: $(STAMP)
	$(VENV)/bin/python scripts/quickstart.py

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests
