"""The fault-injection hooks the tests use to make a run fail as real runs fail, in one place.

Each is an environment variable read at one point of the run; unset, nothing changes.
"""

from __future__ import annotations

import os
import signal

NAN_AT = "PACKTRAIN_TEST_NAN_AT"  # "RANK:STEP": that rank's loss is NaN in that step (a bad pack on one rank)
KILL_AFTER_CHECKPOINT = "PACKTRAIN_KILL_AFTER_CHECKPOINT"  # "STEP": SIGKILL right after step STEP's checkpoint


def nan_scale(rank: int, step: int, scale: float) -> float:
    """``scale``, or NaN when :data:`NAN_AT` names this rank and step."""
    return float("nan") if os.environ.get(NAN_AT) == f"{rank}:{step}" else scale


def after_checkpoint(step: int) -> None:
    """Die like a preempted job (SIGKILL: no cleanup, no final save) when :data:`KILL_AFTER_CHECKPOINT` is ``step``."""
    if os.environ.get(KILL_AFTER_CHECKPOINT) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
