"""Stalls end: the watchdog aborts a process that stays silent ops.hang_abort seconds after its stacks were written
(a rank waiting forever for a stopped peer), and the rendezvous gives up after ops.collective_timeout. The stalls
are processes (a rank that never arrives, a rank stopped by SIGSTOP under torchrun); the watchdog's timing is
checked in this process."""

import os
import signal
import threading
import time

import pytest
from cli_helpers import run_ranks, write_config
from long_run_helpers import finish, rank_pid, start_cli, steps_logged, wait_for

from packtrain.exits import STALLED_EXIT
from packtrain.ops.watchdog import HangWatchdog


def test_abort_follows_the_dump_after_hang_abort_more_seconds():
    events, aborted = [], threading.Event()
    t0 = time.monotonic()
    dog = HangWatchdog(0.2, lambda reason: events.append(("dump", time.monotonic() - t0)) or "path",
                       log=lambda _: None, abort_after=0.3,
                       abort=lambda reason: events.append(("abort", time.monotonic() - t0, reason)) or aborted.set())
    dog.start()
    try:
        assert aborted.wait(30), events
    finally:
        dog.stop()
    assert [e[0] for e in events] == ["dump", "abort"]
    assert events[0][1] >= 0.2 and events[1][1] >= 0.5
    assert "ops.hang_abort=0.3" in events[1][2] and "last completed: start" in events[1][2]


@pytest.mark.process
def test_a_rank_that_never_arrives_ends_the_rendezvous(tmp_path):
    cfg = write_config(tmp_path, train={"max_steps": 1})
    t0 = time.monotonic()
    # rank 0 of a world of 2; rank 1 is never started
    proc = run_ranks(1, "train", str(cfg), "--set", "ops.collective_timeout=3", world=2, check=False)
    assert proc.returncode == STALLED_EXIT, proc.stderr[-3000:]
    assert "did not meet within ops.collective_timeout=3.0 s" in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 120  # torch's default would wait 30 minutes


@pytest.mark.process
@pytest.mark.distributed
def test_a_stopped_rank_makes_the_other_abort_after_its_stacks(tmp_path):
    # generous timeouts: model setup on a loaded machine must not count as a stall
    cfg = write_config(tmp_path, train={"epochs": 4, "packs_per_step": 2}, data={"eval": None})
    run = tmp_path / "run"
    proc = start_cli("train", str(cfg), "--set", "ops.hang_timeout=8", "--set", "ops.hang_abort=4", ranks=2)
    stopped = None
    try:
        stopped = wait_for(lambda: steps_logged(run) >= 1 and rank_pid(run, 1), proc, "step 1 and rank 1's pid")
        rank0 = rank_pid(run, 0)
        os.kill(stopped, signal.SIGSTOP)  # rank 0 now waits in a collective for a peer that never comes
        wait_for(lambda: not os.path.exists(f"/proc/{rank0}"), proc, "rank 0 to abort", timeout=120)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGKILL)  # torchrun would wait 30 s for a stopped rank to take its SIGTERM
    _, _, err = finish(proc)
    assert proc.returncodes[0] == STALLED_EXIT, proc.returncodes
    assert "rank 0 stalled: no progress for" in err and f"aborting (exit {STALLED_EXIT})" in err
    assert "(ops.hang_timeout=8 + ops.hang_abort=4)" in err  # the timing itself: the in-process test above
    stacks = (run / "hang" / "rank-0.txt").read_text()
    assert "no step completed for" in stacks  # the evidence came first


@pytest.mark.process
@pytest.mark.distributed
def test_a_killed_rank_ends_its_peer_with_one_line_and_the_retryable_code(tmp_path):
    """SIGKILL on rank 1 mid-run (its machine lost): rank 0's next collective fails. Before, that was gloo's
    "Connection closed by peer" traceback with exit 1, which a restart script must not retry, and rank 1's empty
    stacks file stayed in OUTPUT/hang/."""
    cfg = write_config(tmp_path, train={"epochs": 4, "packs_per_step": 2}, data={"eval": None})
    run = tmp_path / "run"
    proc = start_cli("train", str(cfg), ranks=2)
    killed = wait_for(lambda: steps_logged(run) >= 1 and rank_pid(run, 1), proc, "step 1 and rank 1's pid")
    os.kill(killed, signal.SIGKILL)
    _, _, err = finish(proc, timeout=120)
    assert proc.returncodes == [STALLED_EXIT, -signal.SIGKILL], (proc.returncodes, err[-3000:])
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines == [(f"packtrain train: rank 1 on machine 0 stopped answering (pid {killed} on this host is gone); "
                      "the checkpoints so far are kept: restart every machine with `packtrain train CONFIG --resume` "
                      f"(exit {STALLED_EXIT})")], err[-3000:]
    left = sorted((str(p.relative_to(run)), p.stat().st_size) for p in run.rglob("*")
                  if p.parent.name in ("hang", "ops"))
    assert not (run / "hang").exists() and not (run / "ops").exists(), left
