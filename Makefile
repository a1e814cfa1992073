# Two entry points for a fresh machine with only Python: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# the pinned CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	# fla + triton: CI runs fla's kernels on CPU under Triton's interpreter (tests/packed/kernels/test_fla_interpreter*.py)
	$(BIN)/pip install -q -e '.[dev,fla]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/packtrain train configs/demo.yaml --overwrite  # a second `make demo` starts over

# in file order (pyproject.toml's addopts turn pytest-randomly off); `make test-shuffled SEED=N`: the same suite in
# an order shuffled by N (files, and the tests in each), which passes as well
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder

SEED ?= 47
test-shuffled: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder -p randomly --randomly-seed=$(SEED)

# the in-process tier: no test that starts processes (ranks, signals, kills, the launcher; pyproject.toml's markers)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not process"

.PHONY: install demo test test-shuffled test-fast
