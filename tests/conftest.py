"""Session setup for every test file, and the reference runs shared between files.

Tiers (markers registered in pyproject.toml): a test marked ``process`` starts processes of its own (ranks over
gloo, signals, kills, the launcher, a fresh interpreter); everything else runs in this process (`make test-fast`).
``distributed`` marks the multi-rank ones among the processes, ``gpu`` those that need CUDA.
"""

import gc
import json
import os

import pytest

# Transformers' kernel-hub lookups and telemetry must never touch the network in tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

# tests/models/test_serving_vllm.py drives vLLM in a venv of its own (`make test-serve`, which names it): collected
# only then
collect_ignore = [] if os.environ.get("PACKTRAIN_VLLM_PYTHON") else ["models/test_serving_vllm.py"]

# fla's kernels run on CPU only under Triton's interpreter, and Triton reads this when fla is imported (with
# transformers' Qwen3.5 module), so it is set before any test module imports either; with CUDA the GPU tests run
# fla compiled. See packtrain/packed/kernels/interpreter.py and tests/packed/kernels/test_fla_interpreter.py.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# One torch thread here and in every process the tests start (cli_helpers, long_run_helpers): torch's CPU kernels
# do not round the same with 1 and 2 threads (tools/experiments/thread_rounding.py), and runs trained in this process
# are compared bit for bit with runs in processes.
torch.set_num_threads(1)

# transformers' log handler keeps the stream it was made with: made now, it writes to pytest's capture for the whole
# session, never to a buffer of one test (capsys, an in-process CLI call) that is closed after it.
from transformers.utils import logging as hf_logging

hf_logging.get_logger("transformers")


class Trained:
    """A finished run: its config file, its output directory and what `packtrain train` printed."""

    def __init__(self, config, run, proc):
        self.config, self.run, self.stdout, self.stderr = config, run, proc.stdout, proc.stderr


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """``trained(**sections)``: a 1-rank `packtrain train` of ``write_config(dir, **sections)``, run in this process
    once per session and shared by every test that asks for the same sections. Read it; copy it to change it."""
    from cli_helpers import run_in_process, write_config

    runs = {}

    def train(**sections) -> Trained:
        key = json.dumps(sections, sort_keys=True)
        if key not in runs:
            tmp = tmp_path_factory.mktemp("trained")
            cfg = write_config(tmp, **sections)
            runs[key] = Trained(cfg, tmp / "run", run_in_process("train", cfg))
        return runs[key]

    return train


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session):
    """What is alive once the suite is collected (torch, transformers, packtrain, every test's item) lives until the
    end: moved out of the garbage collector's reach, its full collections walk only what the tests made since. A
    worker holds about a million objects by then, and the full collections over them took 17% of its CPU time."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """`make test` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup --no-loadscope-reorder``): a
    test file is one unit of work (its module fixtures built once), and the files of ``process`` tests are dealt
    into two units, ``process-0`` and ``process-1`` (alternately, in name order), each of which one worker runs one
    test at a time. Under xdist the process tests come first, so that the two longest units (together about 40% of
    the suite's time) start at once, one on each worker; without xdist the order is the files'. Two process tests
    at once do not share a port: each worker hands out its own range (``cli_helpers.free_port``). A test marked
    ``xdist_group("process")`` itself (one sharing a process test's module fixture) runs in its file's unit."""
    process_files = sorted({item.nodeid.split("::", 1)[0] for item in items
                            if item.get_closest_marker("process") is not None})
    half = {f: f"process-{i % 2}" for i, f in enumerate(process_files)}
    for item in items:
        file = item.nodeid.split("::", 1)[0]
        process = item.get_closest_marker("process") is not None
        marker = item.get_closest_marker("xdist_group")
        if marker is None:
            item.add_marker(pytest.mark.xdist_group(half[file] if process else file))
        elif marker.args[0] == "process":  # in front of the test's own marker: the closest one
            item.add_marker(pytest.mark.xdist_group(half.get(file, "process-0")), append=False)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: not item.get_closest_marker("xdist_group").args[0].startswith("process"))
