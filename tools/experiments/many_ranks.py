"""8 ranks as 2 machines x 4 processes on this host, launched the way users launch: two `accelerate launch` invocations
of launch/cpu_two_machines.yaml (gloo, the tiny float64 test model; steps of 4 packs on 8 ranks, so most ranks run
dummy units). Too slow for CI on 2 cores (about 10 minutes), so a tool whose recorded run is in docs/distributed.md,
"Eight ranks on one machine".

Checks, each printed with its verdict:
1. the 8-rank adapter equals the 1-rank adapter (float64; only the order of cross-rank sums differs);
2. `check-nodes` on the 8 ranks groups its table by machine;
3. SIGTERM to machine 1's launcher stops every rank after the same step with one checkpoint;
4. `--resume` of that checkpoint on 4 ranks (one machine) and then, after a second SIGTERM, on 1 rank, ends with the
   uninterrupted 1-rank adapter (float64: compared to 1e-10; bitwise where the world size is the same);
5. the hang watchdog ends the job when one rank of machine 1 is stopped (SIGSTOP).

    python tools/experiments/many_ranks.py            # exit 0 when every check holds
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from cli_helpers import SGD, adapter_of, free_port, adapter_rel, write_config  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
          str(REPO / "launch" / "cpu_two_machines.yaml")]
results: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    results.append((name, ok, detail))
    print(f"[{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)


def machines(args: list[str], n_machines: int = 2, per_machine: int = 4) -> list[subprocess.Popen]:
    port = str(free_port())
    return [subprocess.Popen([*LAUNCH, "--num_machines", str(n_machines), "--num_processes",
                              str(n_machines * per_machine), "--machine_rank", str(r), "--main_process_port", port,
                              "-m", "packtrain", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=ENV, cwd=REPO, start_new_session=True)
            for r in range(n_machines)]


def one_rank(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packtrain", *args], capture_output=True, text=True, env=ENV,
                          cwd=REPO, check=False)


def wait_all(procs, timeout=900) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            stdout, stderr = p.communicate()
        out.append((p.returncode, stdout, stderr))
    return out


def steps_done(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return 0
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return max((r["step"] for r in rows if r.get("split") is None and "step" in r), default=0)


def checkpoints(run: Path) -> list[str]:
    folder = run / "checkpoints"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="many-ranks-"))
    # 15 examples -> 6 packs; 4 packs per step on 8 ranks: at least 4 ranks run a dummy unit every step
    cfg = write_config(tmp, optim=SGD, data={"eval": None},
                       train={"epochs": 4, "packs_per_step": 4, "save_every": 1000, "keep_checkpoints": None},
                       ops={"hang_timeout": 20, "hang_abort": 10, "collective_timeout": 120})
    train = ["train", str(cfg)]
    print(f"config {cfg}; 8 ranks = 2 machines x 4 processes via accelerate launch", flush=True)

    # 1. 8 ranks == 1 rank
    ref = one_rank([*train, "--set", f"output_dir={tmp / 'one'}"])
    runs = wait_all(machines([*train, "--set", f"output_dir={tmp / 'eight'}"]))
    ok = all(code == 0 for code, _, _ in runs) and ref.returncode == 0
    diff = adapter_rel(adapter_of(tmp / "eight"), adapter_of(tmp / "one")) if ok else float("nan")
    check("8 ranks give the 1-rank adapter", ok and diff < 1e-10,
          f"max relative difference {diff:.1e}; exits {[c for c, _, _ in runs]}")

    # 2. check-nodes grouped by machine
    runs = wait_all(machines(["check-nodes", str(cfg)]))
    table = runs[0][1]
    lines = [line for line in table.splitlines() if line.startswith("check-nodes:") or "machine " in line]
    check("check-nodes groups its table by machine",
          runs[0][0] == 0 and "on 2 machines" in table and "machine 1" in table, " | ".join(lines[:3]))

    # 3. SIGTERM to machine 1's launcher
    run = tmp / "preempted"
    procs = machines([*train, "--set", f"output_dir={run}"])
    while steps_done(run) < 3 and all(p.poll() is None for p in procs):
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGTERM)
    codes = [c for c, _, _ in wait_all(procs)]
    stopped, ckpts = steps_done(run), checkpoints(run)
    check("SIGTERM on machine 1's launcher: every rank stops at one step, with its checkpoint",
          ckpts == [f"step-{stopped}"] and stopped < 12, f"exits {codes}, metrics to step {stopped}, {ckpts}")

    # 4. resume on 4 ranks (one machine), SIGTERM again, resume on 1 rank
    procs = machines([*train, "--set", f"output_dir={run}", "--resume"], n_machines=1, per_machine=4)
    while steps_done(run) < stopped + 2 and procs[0].poll() is None:
        time.sleep(0.5)
    procs[0].send_signal(signal.SIGTERM)
    code4 = wait_all(procs)[0][0]
    mid = steps_done(run)
    last = one_rank([*train, "--set", f"output_dir={run}", "--resume"])
    diff = adapter_rel(adapter_of(run), adapter_of(tmp / "one")) if last.returncode == 0 else float("nan")
    check("--resume on 4 ranks, then 1 rank: the uninterrupted adapter", last.returncode == 0 and diff < 1e-10,
          f"stopped at step {stopped} (8 ranks), {mid} (4 ranks, exit {code4}), 1 rank exit {last.returncode}; "
          f"max relative difference {diff:.1e}")

    # 5. the watchdog: SIGSTOP one worker of machine 1
    run = tmp / "stalled"
    procs = machines([*train, "--set", f"output_dir={run}", "--set", "train.epochs=50"])
    while steps_done(run) < 2 and all(p.poll() is None for p in procs):
        time.sleep(0.5)
    workers = subprocess.run(["pgrep", "-P", str(procs[1].pid)], capture_output=True, text=True).stdout.split()
    started = time.time()
    if workers:
        os.kill(int(workers[-1]), signal.SIGSTOP)
    runs = wait_all(procs, timeout=300)
    if workers:
        try:
            os.kill(int(workers[-1]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    took = time.time() - started
    said = next((line for _, _, err in runs for line in err.splitlines() if "watchdog" in line.lower()), "")
    check("the hang watchdog ends the job when a rank of machine 1 stops",
          bool(workers) and all(c != 0 for c, _, _ in runs) and took < 200,
          f"exits {[c for c, _, _ in runs]} after {took:.0f} s; {said[:160]}")

    print(f"{sum(ok for _, ok, _ in results)}/{len(results)} checks hold ({time.time() - t0:.0f} s; {tmp})")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
