"""The fault-injection hooks (packtrain/faults.py) read from the environment: the NaN step of one named rank only,
the SIGTERM step, a rank's check-nodes override, and the SIGKILL after one step's checkpoint (os.kill stood in for).
The runs that use them: tests/run/test_finite.py, test_preemption.py, test_signals.py, tests/ops/test_nodes.py."""

import os
import signal

import pytest

from packtrain import faults


@pytest.mark.parametrize("nan_at, term, rank, expected", [
    (None, None, 0, (None, None)),
    ("1:5", None, 1, (5, None)),
    ("1:5", "4", 0, (None, 4)),  # another rank's NaN
    ("11:5", None, 1, (None, None)),  # rank 11's, not 1's
    ("1:5", None, 11, (None, None)),
    ("1", None, 1, (None, None)),  # no step: nothing
])
def test_the_nan_step_is_one_rank_s_and_the_sigterm_step_every_rank_s(monkeypatch, nan_at, term, rank, expected):
    for name, value in ((faults.NAN_AT, nan_at), (faults.SIGTERM_IN_STEP, term)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert faults.in_steps(rank) == expected


def test_a_node_override_names_its_rank(monkeypatch):
    monkeypatch.setenv("PACKTRAIN_TEST_OVERRIDE_RANK2", "torch=2.0")
    monkeypatch.setenv("PACKTRAIN_TEST_OVERRIDE_RANK3", "")
    assert faults.node_override(2) == ("PACKTRAIN_TEST_OVERRIDE_RANK2", "torch=2.0")
    assert faults.node_override(3) == ("PACKTRAIN_TEST_OVERRIDE_RANK3", None)


def test_the_kill_comes_after_the_named_step_s_checkpoint_only(monkeypatch):
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setenv(faults.KILL_AFTER_CHECKPOINT, "3")
    for step in (1, 30, 3):
        faults.after_checkpoint(step)
    faults.sigterm()
    assert sent == [(os.getpid(), signal.SIGKILL), (os.getpid(), signal.SIGTERM)]
