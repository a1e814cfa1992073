"""`packtrain dump-stacks`' own logic in this process (packtrain/commands/dump_stacks.py): which registered ranks it
dumps (this host's, alive, those of ``--pid``), each dump taken with py-spy where it works, else by SIGUSR1 to a
process that catches it, never to one that does not. Its run on a stuck rank process: tests/ops/test_runtime.py."""

import argparse
import faulthandler
import json
import os
import signal
import socket

import pytest
from cli_helpers import write_config

from packtrain.commands import dump_stacks

NO_PY_SPY = "py-spy not installed: no native frames (pip install py-spy)"


def _entry(tmp_path, rank=0, pid=None, host=None):
    return {"rank": rank, "pid": os.getpid() if pid is None else pid, "host": host or socket.gethostname(),
            "local_rank": rank, "stacks": str(tmp_path / f"rank-{rank}.txt")}


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(dump_stacks, "gpu_status", lambda local_rank=None: f"GPU of local rank {local_rank}")


def test_py_spys_stacks_are_appended_with_a_header_and_the_gpu(tmp_path, monkeypatch, no_gpu):
    monkeypatch.setattr(dump_stacks, "native_stacks", lambda pid: f"Thread {pid} (idle): main\n")
    entry = _entry(tmp_path, rank=3)
    (tmp_path / "rank-3.txt").write_text("earlier dump\n")
    assert dump_stacks.dump_one(entry) == "py-spy"
    text = (tmp_path / "rank-3.txt").read_text()
    assert text.startswith("earlier dump\n")
    assert f"rank 3, pid {os.getpid()}" in text and "packtrain dump-stacks" in text
    assert text.endswith(f"--- py-spy (native + Python) ---\nThread {os.getpid()} (idle): main\n"
                         "--- GPU ---\nGPU of local rank 3\n")


def test_without_py_spy_a_process_that_catches_sigusr1_writes_its_own_stacks(tmp_path, monkeypatch, no_gpu):
    """The rank registers faulthandler on SIGUSR1 into its stacks file, as a training process does."""
    monkeypatch.setattr(dump_stacks, "native_stacks", lambda pid: NO_PY_SPY)
    entry = _entry(tmp_path)
    with open(entry["stacks"], "a") as f:
        faulthandler.register(dump_stacks.DUMP_SIGNAL, file=f, all_threads=True, chain=False)
        try:
            assert dump_stacks.dump_one(entry, wait=5.0) == "SIGUSR1 (faulthandler)"
        finally:
            faulthandler.unregister(dump_stacks.DUMP_SIGNAL)
    text = (tmp_path / "rank-0.txt").read_text()
    assert "test_without_py_spy_a_process_that_catches_sigusr1" in text  # faulthandler's Python stack of this test
    assert f"(the Python stacks above came from SIGUSR1; {NO_PY_SPY})\n--- GPU ---\n" in text


def test_a_process_that_does_not_catch_sigusr1_is_never_signalled(tmp_path, monkeypatch, no_gpu):
    """SIGUSR1's default action ends a process; here it is ignored, so a signal sent by mistake would be harmless."""
    monkeypatch.setattr(dump_stacks, "native_stacks", lambda pid: NO_PY_SPY)
    sent = []
    monkeypatch.setattr(dump_stacks.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    previous = signal.signal(dump_stacks.DUMP_SIGNAL, signal.SIG_IGN)
    try:
        with pytest.raises(ValueError, match=f"^rank 0 \\(pid {os.getpid()}\\) does not catch SIGUSR1 and py-spy"):
            dump_stacks.dump_one(_entry(tmp_path))
    finally:
        signal.signal(dump_stacks.DUMP_SIGNAL, previous)
    assert sent == []


def test_only_this_hosts_living_ranks_are_dumped_and_pid_narrows_them(tmp_path, monkeypatch, capsys):
    cfg = write_config(tmp_path)
    ops = tmp_path / "run" / "ops"
    ops.mkdir(parents=True)
    mine, elsewhere, gone = (_entry(tmp_path, 0), _entry(tmp_path, 1, host="another-host"),
                             _entry(tmp_path, 2, pid=2**31 - 1))  # no such process
    for entry in (mine, elsewhere, gone):
        (ops / f"rank-{entry['rank']}.json").write_text(json.dumps(entry))
    dumped = []
    monkeypatch.setattr(dump_stacks, "dump_one", lambda entry: dumped.append(entry) or "py-spy")
    args = argparse.Namespace(config=str(cfg), overrides=[], pid=None)
    assert dump_stacks.run_dump_stacks(args) == 0
    assert dumped == [mine]
    assert capsys.readouterr().out == f"rank 0 (pid {os.getpid()}): py-spy -> {mine['stacks']}\n"
    args.pid = [os.getpid() + 1]
    with pytest.raises(ValueError, match=f"^no running rank of {tmp_path / 'run'} on {socket.gethostname()}"):
        dump_stacks.run_dump_stacks(args)


def test_without_a_config_it_dumps_the_pids_given_here_and_needs_one(monkeypatch, capsys):
    monkeypatch.setattr(dump_stacks, "native_stacks", lambda pid: f"stacks of {pid}\n")
    assert dump_stacks.run_dump_stacks(argparse.Namespace(config=None, overrides=[], pid=[11, 12])) == 0
    out = capsys.readouterr().out
    assert "pid 11 on" in out and "stacks of 11\n" in out and out.index("stacks of 11") < out.index("pid 12 on")
    with pytest.raises(ValueError, match="^give CONFIG"):
        dump_stacks.run_dump_stacks(argparse.Namespace(config=None, overrides=[], pid=None))
