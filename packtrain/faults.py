"""The fault-injection hooks the tests use to make a run fail as real runs fail, in one place.

Each is an environment variable read at one point of the run (the step's, once, when the step is made); unset,
nothing changes.
"""

from __future__ import annotations

import os
import signal

NAN_AT = "PACKTRAIN_TEST_NAN_AT"  # "RANK:STEP": that rank's loss is NaN in that step (a bad pack on one rank)
KILL_AFTER_CHECKPOINT = "PACKTRAIN_KILL_AFTER_CHECKPOINT"  # "STEP": SIGKILL right after step STEP's checkpoint
SIGTERM_IN_STEP = "PACKTRAIN_TEST_SIGTERM_IN_STEP"  # "STEP": SIGTERM to this process during step STEP, before its update
# "N": SIGTERM to this process during the N-th batch (from 1) of the dpo reference pass (packtrain/run/reference.py)
SIGTERM_IN_REFERENCE = "PACKTRAIN_TEST_SIGTERM_IN_REFERENCE"
# "field=value[;field=value]": rank N's check-nodes report says value for field (packtrain/ops/nodes.py); the rank in
# the name, so a stray variable in a shared environment changes one named rank, and the table says so
OVERRIDE_RANK = "PACKTRAIN_TEST_OVERRIDE_RANK{rank}"


def in_steps(rank: int) -> tuple[int | None, int | None]:
    """(the step whose loss is NaN on ``rank`` by :data:`NAN_AT`, the step :data:`SIGTERM_IN_STEP` sends SIGTERM in),
    each None when unset: read once, when a run's step is made."""
    rank_step = os.environ.get(NAN_AT, "").partition(":")
    nan = int(rank_step[2]) if rank_step[1] and rank_step[0] == str(rank) else None
    term = os.environ.get(SIGTERM_IN_STEP)
    return nan, int(term) if term else None


def node_override(rank: int) -> tuple[str, str | None]:
    """(the variable's name for ``rank``, its value or None)."""
    name = OVERRIDE_RANK.format(rank=rank)
    return name, os.environ.get(name) or None


def after_checkpoint(step: int) -> None:
    """Die like a preempted job (SIGKILL: no cleanup, no final save) when :data:`KILL_AFTER_CHECKPOINT` is ``step``."""
    if os.environ.get(KILL_AFTER_CHECKPOINT) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def sigterm() -> None:
    """A scheduler's SIGTERM arriving while a step runs (:data:`SIGTERM_IN_STEP`)."""
    os.kill(os.getpid(), signal.SIGTERM)


def reference_batch(n: int) -> None:
    """SIGTERM while the reference pass runs its ``n``-th batch, when :data:`SIGTERM_IN_REFERENCE` is ``n``."""
    if os.environ.get(SIGTERM_IN_REFERENCE) == str(n):
        sigterm()
