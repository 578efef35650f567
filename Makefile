# Quick start: `make demo` (install + the main job) and `make test` (install + the whole test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sv-attention-installed

.PHONY: install test demo lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# Install the CPU torch wheel first when no torch is present, so pip never pulls a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

demo: install
	# One BLAS thread per process: the twins train side by side on the 2 cores.
	OMP_NUM_THREADS=1 $(VENV)/bin/sv-attention quickstart

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
