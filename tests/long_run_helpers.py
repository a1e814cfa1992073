"""Runs that are signalled, stopped or damaged on purpose: start the real CLI without waiting, wait for a sign
that a step finished (never a bare sleep), and look for NaN/inf in everything a run wrote."""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import torch
from cli_helpers import REPO, Ranks, start_ranks
from safetensors.torch import load_file


def start_cli(*args: str, env: dict | None = None, ranks: int = 1) -> Ranks:
    """`packtrain ARGS` running in the background, as ``ranks`` processes (one: a plain run) forked with packtrain
    imported (cli_helpers.start_ranks: read like a Popen, each rank's exit code in ``returncodes``)."""
    return start_ranks(ranks, *args, env=env)


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 180.0):
    """Poll ``condition()`` until it returns something truthy; fail if the process ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the run ended ({proc.returncode}) before {what}\n{out}\n{err[-4000:]}")
        time.sleep(0.05)
    proc.kill()
    out, err = proc.communicate()
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{out}\n{err[-4000:]}")


def steps_logged(run: Path) -> int:
    """The highest training step in metrics.jsonl (0 when none): rank 0 writes a line after each step."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # being written
            continue
        if rec.get("split") != "eval":
            steps.append(rec["step"])
    return max(steps, default=0)


def rank_pid(run: Path, rank: int) -> int | None:
    """A running rank's pid from OUTPUT/ops/rank-N.json (what `packtrain dump-stacks` reads)."""
    try:
        return json.loads((run / "ops" / f"rank-{rank}.json").read_text())["pid"]
    except (OSError, ValueError):
        return None


def finish(proc: subprocess.Popen, timeout: float = 180.0) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the run did not end within {timeout:.0f} s\n{out}\n{err[-4000:]}") from None
    return proc.returncode, out, err


def no_packtrain_traceback(stderr: str) -> bool:
    """No traceback through packtrain's code (torchrun prints its own ChildFailedError when a rank exits non-zero)."""
    ours = str(REPO / "packtrain") + "/"
    return not any(line.strip().startswith('File "') and ours in line for line in stderr.splitlines())


def _strict_json(text: str):
    def refuse(name):
        raise ValueError(f"non-finite JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def nonfinite_files(run: Path) -> list[str]:
    """Every file under ``run`` that holds a NaN or inf (tensors, JSON values, metrics lines)."""
    bad = []
    for path in sorted(p for p in run.rglob("*") if p.is_file()):
        if path.suffix == ".safetensors":
            tensors = list(load_file(str(path)).values())
        elif path.suffix == ".pt":
            tensors = list(_tensors(torch.load(path, weights_only=True)))
        elif path.suffix in (".json", ".jsonl"):
            try:
                for line in path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]:
                    values = _strict_json(line)
                    if any(isinstance(v, float) and not math.isfinite(v) for v in _floats(values)):
                        raise ValueError("overflowing float")
            except ValueError as e:
                bad.append(f"{path}: {e}")
            continue
        else:
            continue
        if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors):
            bad.append(str(path))
    return bad


def _floats(obj):
    if isinstance(obj, float):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _floats(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _floats(v)
