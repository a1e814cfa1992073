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

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder

# the in-process tier: no test that starts processes (ranks, signals, kills, the launcher; pyproject.toml's markers)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not process"

.PHONY: install demo test test-fast
