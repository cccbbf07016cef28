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

demo: $(STAMP)
	$(VENV)/bin/megatron-vshape compare --pp 8 --microbatches 24 --costs 2,2.2,1.6,0.05
	$(VENV)/bin/megatron-vshape plan --schedule v-half --pp 8 --microbatches 24 --picture out/v-half-pp8-m24.svg

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests
