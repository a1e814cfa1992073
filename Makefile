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

# The oldest versions packtrain admits (packtrain/versions.py: torch 2.11, the GPU image's; transformers, peft,
# accelerate, triton and fla at their floors), in a second venv: the version-sensitive tests (the cache and the
# patched forward, FSDP, the kernels under Triton's interpreter, generation, loading). .ci/run runs it after `make
# test`. torch 2.11 comes from PyPI as a CUDA build (about 4.6 GB with its CUDA libraries; it runs on CPU): pip's
# cache keeps the download between runs on one machine.
FLOOR := .venv-floor
FLOOR_TESTS := tests/test_versions.py tests/packed tests/run/test_generate.py tests/models/test_loading.py \
	tests/models/test_lora_compute.py tests/models/test_offload.py tests/test_distributed.py \
	tests/commands/test_context_grad_cli.py tests/commands/test_families_cli.py tests/commands/test_groups_cli.py \
	tests/commands/test_tree_cli.py tests/commands/test_walk_cli.py  # the packed computation through the CLI
$(FLOOR)/.installed: pyproject.toml packtrain/versions.py
	$(PY) -m venv $(FLOOR)
	PYTHONPATH=. $(PY) -m packtrain.versions --floor > $(FLOOR)/floor.txt
	$(FLOOR)/bin/pip install -q -c $(FLOOR)/floor.txt -e '.[dev,fla]'
	touch $(FLOOR)/.installed

test-floor: $(FLOOR)/.installed
	$(FLOOR)/bin/python -m packtrain.versions
	$(FLOOR)/bin/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder $(FLOOR_TESTS)

SEED ?= 47
test-shuffled: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder -p randomly --randomly-seed=$(SEED)

# the in-process tier: no test that starts processes (ranks, signals, kills, the launcher; pyproject.toml's markers)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not process"

.PHONY: install demo test test-shuffled test-fast test-floor
