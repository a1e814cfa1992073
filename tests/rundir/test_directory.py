"""One run per output directory: the lock (live holder refused, a dead one taken over), a previous run refused
without --resume / --overwrite, --overwrite saying what it removes, and a refusal that ends both ranks. The holders
are processes; the runs they refuse run in this process."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import run_in_process, run_ranks, write_config
from long_run_helpers import finish, start_cli, steps_logged, wait_for

from packtrain.distributed import DistInfo
from packtrain.rundir.directory import LOCK, RunDirError, claim

ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def _write_lock(out, pid, host=None):
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "started": time.time(),
                                        "started_utc": "1970-01-01T00:00:00Z"}))


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid names no process now
    return proc.pid


@pytest.mark.process
def test_a_lock_from_a_dead_process_on_this_host_is_taken_over(tmp_path):
    _write_lock(tmp_path, _dead_pid())
    said = []
    lock = claim(tmp_path, resume=False, overwrite=False, info=ONE, log=said.append)
    assert any("taking over the stale lock" in s for s in said), said
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK).exists()


@pytest.mark.process
def test_a_live_holder_or_another_host_is_refused(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        _write_lock(tmp_path, sleeper.pid)
        with pytest.raises(RunDirError, match=f"in use by another run: pid {sleeper.pid} on"):
            claim(tmp_path, False, False, ONE, log=print)
    finally:
        sleeper.kill()
        sleeper.wait()
    _write_lock(tmp_path, _dead_pid(), host="some-other-node")
    with pytest.raises(RunDirError, match="cannot see processes on another host"):
        claim(tmp_path, False, False, ONE, log=print)


@pytest.mark.process
def test_a_busy_directory_then_a_previous_run_are_refused_and_overwrite_takes_over(tmp_path):
    cfg = write_config(tmp_path, train={"epochs": 2, "packs_per_step": 1, "save_every": 1}, data={"eval": None})
    run = tmp_path / "run"
    first = start_cli("train", str(cfg))
    try:
        # step 2 logged: step 1's checkpoint is complete (a save comes before the next step)
        wait_for(lambda: steps_logged(run) >= 2, first, "the first run's step 2")
        first.send_signal(signal.SIGSTOP)  # frozen mid-run, holding the lock, however slow the second start is
        second = run_in_process("train", cfg, "--resume", check=False)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"in use by another run: pid {first.pid} on {socket.gethostname()}" in second.stderr
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        finish(first)
    assert json.loads((run / LOCK).read_text())["pid"] == first.pid  # left behind by the kill
    before = {p: p.read_bytes() for p in (run / "metrics.jsonl", *sorted((run / "checkpoints").rglob("*.pt")))}

    again = run_in_process("train", cfg, check=False)  # no --resume: the killed run's work is not thrown away
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert f"taking over the stale lock {run / LOCK}: pid {first.pid}" in again.stdout
    assert re.search(r"holds a previous run \(checkpoints/ \(\d checkpoints?\), metrics.jsonl\)", again.stderr)
    assert "--resume" in again.stderr and "--overwrite" in again.stderr
    assert {p: p.read_bytes() for p in before} == before
    both = run_in_process("train", cfg, "--resume", "--overwrite", check=False)
    assert both.returncode == 2 and "contradict" in both.stderr

    fresh = run_in_process("train", cfg, "--overwrite", "--set", "train.max_steps=1")
    assert "--overwrite: removing checkpoints/, metrics.jsonl, config.yaml, base/, tokenizer/, hang/" in fresh.stdout
    assert not (run / "checkpoints").exists()  # one step, no checkpoint: the old ones are gone
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert (run / "adapter").exists() and not (run / LOCK).exists()


@pytest.mark.process
@pytest.mark.distributed
def test_a_refusal_ends_both_ranks(tmp_path):
    cfg = write_config(tmp_path, train={"max_steps": 1}, data={"eval": None})
    run_in_process("train", cfg)
    proc = run_ranks(2, "train", str(cfg), check=False, timeout=120)  # a hang would time out here
    assert proc.returncode != 0 and all(code > 0 for code in proc.returncodes), proc.returncodes  # none killed
    assert "holds a previous run" in proc.stderr and "rank 0 refused" in proc.stderr  # rank 1 got the verdict


def _contend(dirs, barrier, results, me):
    """One contender: for each directory (each holding a stale lock), wait for the others, then try to take it."""
    from packtrain.rundir.directory import RunLock

    won = []
    for d in dirs:
        barrier.wait()
        try:
            RunLock.acquire(d, log=lambda *a: None)
            won.append(True)
        except RunDirError:
            won.append(False)
    # Every contender lives until all have tried the last directory: a winner that exited first would leave a lock
    # whose holder is dead, which a slower contender then rightly takes over (a second "winner" of the last trial,
    # 1 run in a few hundred).
    barrier.wait()
    results.put((me, won))


@pytest.mark.process
def test_concurrent_takeovers_of_a_stale_lock_give_it_to_exactly_one(tmp_path):
    """A restart loop after a SIGKILL: several processes find the same dead holder at once. Before, the second to
    unlink "the stale lock" deleted the first's fresh one and both ran (7 of 40 trials). 300 trials, 3 contenders
    released together by a barrier; every trial must have exactly one winner."""
    from cli_helpers import _fork_server

    trials, contenders = 300, 3
    dead = _dead_pid()
    dirs = []
    for t in range(trials):
        d = tmp_path / f"t{t}"
        _write_lock(d, dead)
        dirs.append(d)
    ctx = _fork_server()
    barrier, results = ctx.Barrier(contenders), ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(dirs, barrier, results, i)) for i in range(contenders)]
    for p in procs:
        p.start()
    won = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * contenders
    winners = [sum(won[i][t] for i in range(contenders)) for t in range(trials)]
    doubles = sum(w > 1 for w in winners)
    several = [t for t in range(trials) if winners[t] > 1]
    assert doubles == 0 and winners == [1] * trials, f"{doubles} of {trials} trials had several winners: {several}"


def test_a_clock_stepped_between_the_write_and_the_check_leaves_a_live_holder_alive(tmp_path):
    """The holder's start through the wall clock (btime + ticks) moves when a VM's clock is stepped: a step between the
    holder's write and another process's check made the live holder look reused, and both ran (1 of 300 trials of
    test_concurrent_takeovers_of_a_stale_lock_give_it_to_exactly_one, in a shuffled run). The start in ticks since
    boot does not move."""
    from packtrain.rundir.directory import _process_start

    ticks = int(Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
    holder = {"pid": os.getppid(), "host": socket.gethostname(), "started": time.time(),
              "process_start": _process_start(os.getppid()) + 5.0,  # as read before a 5 s step of the clock
              "process_ticks": ticks, "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip()}
    (tmp_path / LOCK).write_text(json.dumps(holder))
    with pytest.raises(RunDirError, match="in use by another run"):
        claim(tmp_path, False, False, ONE, log=print)
    # another process under that pid (other ticks), or a lock from before the last boot: taken over
    for changed in ({"process_ticks": holder["process_ticks"] + 1}, {"boot_id": "another-boot"}):
        (tmp_path / LOCK).write_text(json.dumps({**holder, **changed}))
        said = []
        claim(tmp_path, False, False, ONE, log=said.append).release()
        assert any("taking over the stale lock" in s for s in said), (changed, said)


def test_a_lock_without_a_start_time_is_not_taken_from_a_live_process(tmp_path):
    """No ``started`` field (an older or hand-written lock) proves nothing about a pid reuse: a live pid holds."""
    tmp_path.joinpath(LOCK).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
    with pytest.raises(RunDirError, match=f"in use by another run: pid {os.getppid()}"):
        claim(tmp_path, False, False, ONE, log=print)


def test_an_empty_lock_is_taken_over(tmp_path):
    """A writer killed between creating the lock and writing it left an empty file that refused every later run
    ("unreadable lock file"). Writers hold the directory's flock while writing, so one found empty under it is dead."""
    (tmp_path / LOCK).write_text("")
    said = []
    lock = claim(tmp_path, False, False, ONE, log=said.append)
    assert any("taking over the empty lock" in s for s in said), said
    lock.release()
    (tmp_path / LOCK).write_text("not json")  # not packtrain's: left alone
    with pytest.raises(RunDirError, match="unreadable lock file"):
        claim(tmp_path, False, False, ONE, log=print)


def test_a_filesystem_without_flock_still_takes_the_lock(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    said = []
    lock = claim(tmp_path, False, False, ONE, log=said.append)
    assert any("has no flock (No locks available)" in s for s in said), said
    lock.release()
    _write_lock(tmp_path, os.getppid())  # a live holder: the exclusive create and the liveness check still refuse
    with pytest.raises(RunDirError, match=f"in use by another run: pid {os.getppid()}"):
        claim(tmp_path, False, False, ONE, log=print)


def test_a_reused_pid_is_told_by_its_process_start_not_the_clock(tmp_path):
    """The lock records its holder's start as read from /proc: a live pid with another start is a reused pid (taken
    over), the same start is the holder, whatever the wall clock did since boot (a VM's stepped clock made a live
    holder look reused: 1 of 300 concurrent trials)."""
    from packtrain.rundir.directory import _process_start

    holder = {"pid": os.getppid(), "host": socket.gethostname(), "started": 0.0,
              "process_start": _process_start(os.getppid())}
    (tmp_path / LOCK).write_text(json.dumps(holder))
    with pytest.raises(RunDirError, match="in use by another run"):  # "started" 0.0 alone would say reused
        claim(tmp_path, False, False, ONE, log=print)
    (tmp_path / LOCK).write_text(json.dumps({**holder, "process_start": 1.0}))
    said = []
    claim(tmp_path, False, False, ONE, log=said.append).release()
    assert any("taking over the stale lock" in s for s in said), said


def test_a_directory_that_holds_no_run_is_never_taken_over(tmp_path):
    """Before, its config.yaml was overwritten, and --overwrite deleted whole base/, ops/ and adapter/ folders of
    files packtrain never wrote."""
    cfg = write_config(tmp_path, train={"max_steps": 1}, data={"eval": None})
    run = tmp_path / "run"
    for name in ("base/weights.bin", "ops/notes.txt", "adapter/mine.txt", "config.yaml"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(name)
    for flags in ((), ("--overwrite",), ("--resume",)):
        proc = run_in_process("train", cfg, *flags, check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip() == (f"packtrain train: error: {run} is not empty and holds no packtrain run (no "
                                       f"packtrain-run.json; it holds adapter/, base/, config.yaml, ops/): choose an "
                                       f"empty or new output_dir (a run directory of a packtrain from before the "
                                       f"marker: write {{}} to {run / 'packtrain-run.json'})")
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == [
        "adapter", "adapter/mine.txt", "base", "base/weights.bin", "config.yaml", "ops", "ops/notes.txt"]
    assert (run / "config.yaml").read_text() == "config.yaml"


def test_overwrite_removes_only_what_the_run_marker_lists(tmp_path):
    cfg = write_config(tmp_path, train={"max_steps": 1}, data={"eval": None})
    run = tmp_path / "run"
    run_in_process("train", cfg)
    assert json.loads((run / "packtrain-run.json").read_text())["wrote"][:3] == ["adapter", "checkpoints",
                                                                                 "metrics.jsonl"]
    (run / "mine.txt").write_text("kept")
    (run / "packtrain-run.json").write_text(json.dumps({"wrote": ["adapter", "metrics.jsonl", "loss.png"]}))
    proc = run_in_process("train", cfg, "--overwrite")
    assert f"--overwrite: removing adapter/, metrics.jsonl, loss.png from {run}" in proc.stdout
    assert (run / "mine.txt").read_text() == "kept" and (run / "adapter").is_dir()


def test_release_leaves_a_lock_another_process_took(tmp_path):
    from packtrain.rundir.directory import RunLock

    lock = RunLock.acquire(tmp_path, log=print)
    other = {"pid": _dead_pid(), "host": socket.gethostname(), "started": time.time()}
    (tmp_path / LOCK).write_text(json.dumps(other))  # taken over meanwhile (this process looked dead)
    lock.release()
    assert json.loads((tmp_path / LOCK).read_text()) == other


def test_a_refused_claim_leaves_no_lock(tmp_path):
    (tmp_path / "packtrain-run.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("{}\n")  # a previous run, and neither --resume nor --overwrite
    with pytest.raises(RunDirError, match="holds a previous run"):
        claim(tmp_path, False, False, ONE, log=print)
    assert not (tmp_path / LOCK).exists()


@pytest.mark.process
def test_a_zombie_holder_has_exited_and_its_lock_is_taken_over(tmp_path):
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30  # the child exits at once; it stays a zombie until waited for
        stat = Path(f"/proc/{zombie.pid}/stat")
        while (tmp := stat.read_text().rsplit(")", 1)[1].split()[0]) != "Z":
            assert time.monotonic() < deadline, f"the child is still {tmp!r} after 30 s"
            time.sleep(0.01)
        _write_lock(tmp_path, zombie.pid)
        said = []
        lock = claim(tmp_path, False, False, ONE, log=said.append)
        assert any(f"taking over the stale lock {tmp_path / LOCK}: pid {zombie.pid}" in s for s in said), said
        lock.release()
    finally:
        zombie.wait()


def test_a_dangling_run_marker_link_is_named_as_one(tmp_path):
    # before: "no packtrain-run.json; it holds packtrain-run.json"
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "packtrain-run.json").symlink_to(tmp_path / "elsewhere" / "packtrain-run.json")
    with pytest.raises(RunDirError) as e:
        claim(tmp_path, True, False, ONE, log=print)
    assert str(e.value).startswith(f"{tmp_path / 'packtrain-run.json'} is a symbolic link to "
                                   f"{tmp_path / 'elsewhere' / 'packtrain-run.json'}, which does not exist"), e.value
    assert "no packtrain-run.json" not in str(e.value) and not (tmp_path / LOCK).exists()


def test_overwrite_removes_only_packtrains_own_generations(tmp_path):
    # before: --overwrite removed everything inside generations/, a user's notes included
    (tmp_path / "packtrain-run.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    gen = tmp_path / "generations"
    (gen / "mine").mkdir(parents=True)
    own = ["step-2.jsonl", "step-2.errors.md", "step-10.jsonl", "step-10.errors.md", "step-12.jsonl.tmp"]
    foreign = ["notes.md", "step-2.jsonl.bak", "summary.jsonl", "mine/x.txt"]
    for name in own + foreign:
        (gen / name).write_text(name)
    said = []
    claim(tmp_path, False, True, ONE, log=said.append).release()
    assert sorted(str(p.relative_to(gen)) for p in gen.rglob("*") if p.is_file()) == sorted(foreign)
    assert any(s == f"--overwrite: kept mine, notes.md, step-2.jsonl.bak, summary.jsonl in {gen} (not written by "
                    "packtrain)" for s in said), said
    (gen / "mine" / "x.txt").unlink()
    for name in ("mine", "notes.md", "step-2.jsonl.bak", "summary.jsonl"):
        (gen / name).rmdir() if (gen / name).is_dir() else (gen / name).unlink()
    (gen / "step-3.jsonl").write_text("")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    claim(tmp_path, False, True, ONE, log=said.append).release()
    assert not gen.exists()  # only packtrain's own files: the folder goes with them
