"""Hang watchdog and stack dumps in one process: fires once per silence, re-arms, and names the stuck frame."""

import faulthandler
import os
import signal
import threading
import time

from packtrain.commands.dump_stacks import catches_signal
from packtrain.ops import watchdog
from packtrain.ops.watchdog import HangWatchdog


def sleeping_step(seconds):
    time.sleep(seconds)


def test_fires_once_per_silence_and_rearms_after_a_step():
    fired = []
    dog = HangWatchdog(0.2, lambda reason: fired.append(reason) or "path", log=lambda _: None)
    dog.start()
    try:
        time.sleep(0.7)
        assert len(fired) == 1 and "ops.hang_timeout=0.2" in fired[0] and "last completed: start" in fired[0]
        dog.beat("step 1")
        time.sleep(0.1)
        assert len(fired) == 1  # a step completed: quiet again
        time.sleep(0.5)
        assert len(fired) == 2 and "last completed: step 1" in fired[1]
    finally:
        dog.stop()


def test_a_steady_run_never_fires():
    fired = []
    dog = HangWatchdog(0.3, fired.append, log=lambda _: None)
    dog.start()
    try:
        for i in range(8):
            time.sleep(0.08)
            dog.beat(f"step {i}")
    finally:
        dog.stop()
    assert fired == []


def test_dump_names_the_frame_another_thread_is_stuck_in(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no py-spy, no nvidia-smi
    stuck = threading.Thread(target=sleeping_step, args=(1.0,), name="trainer")
    stuck.start()
    time.sleep(0.1)
    path = watchdog.write_dump(tmp_path / "hang" / "rank-3.txt", "test reason", rank=3, local_rank=3)
    stuck.join()
    text = path.read_text()
    assert "rank 3, pid" in text and "test reason" in text
    assert "Thread trainer" in text and "in sleeping_step" in text and "time.sleep(seconds)" in text
    assert "py-spy not installed" in text and "nvidia-smi: not found" in text


def test_gpu_status_reads_nvidia_smi_when_present(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'index, utilization.gpu [%], power.draw [W]'\necho '0, 100 %, 121.00 W'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    status = watchdog.gpu_status(local_rank=0)
    assert "0, 100 %, 121.00 W" in status and "collective" in status


def test_catches_signal_reads_the_process_mask(tmp_path):
    with open(tmp_path / "f.txt", "w") as f:
        assert not catches_signal(os.getpid(), signal.SIGUSR2)
        faulthandler.register(signal.SIGUSR2, file=f, all_threads=True, chain=False)
        try:
            assert catches_signal(os.getpid(), signal.SIGUSR2)
        finally:
            faulthandler.unregister(signal.SIGUSR2)
