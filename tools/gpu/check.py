"""The GPU bring-up in two commands of at most 8 minutes each, for a lent machine with one CUDA GPU, no network and
15 minutes of device time in all (tools/gpu_check.sh runs this file; docs/operations.md, "First run on a GPU").

    bash tools/fetch_gpu_wheels.sh      # here: the wheels the device image lacks, into .whl/ (carry .whl)
    bash tools/gpu_check.sh --dry-run   # here (CI runs it): the wheels, the commands and the time budget
    bash tools/gpu_check.sh 1           # there: versions, FlexAttention, fla's GDN, the kernel that ran,
                                        #   27B-shaped bf16 parity, the gpu-marked tests
    bash tools/gpu_check.sh 2           # there: memory against --measure, positions/s and MFU, offload

Each part installs the wheels into /tmp/site (no network there), then runs its steps, each under its own time
limit, its output appended to $OUT/partN.log. A step decides verdicts (tools/gpu/verdicts.py), each written to
$OUT/verdicts.jsonl and the table $OUT/verdicts.md the moment it is decided, so a part stopped at its limit still
leaves every verdict decided before; a step that ran past its limit or failed leaves a FAIL for each verdict it
did not decide. Exit status 0 when every verdict passed. Standard library only (it runs before the wheels are in).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# What the device image lacks, or holds at a version packtrain is not tested on (FACTS: torch 2.11, triton 3.6,
# transformers 5.17, accelerate 1.15, Python 3.12): transformers at the tested version with the hub release it needs
# (and that release's click), peft pinned, fla. torch, triton and accelerate are the image's (inside the ranges).
WHEELS = [("transformers", "5.24.0"), ("huggingface-hub", "1.33.0"), ("click", "8.5.1"), ("peft", "0.21.2"),
          ("fla-core", "0.6.0"), ("flash-linear-attention", "0.6.0")]
PYTHON_TAG, PLATFORM = "cp312", "x86_64"  # the device's interpreter and processor
SITE = "/tmp/site"

# The device's limits (the device tool's README) and this check's share of them.
COMMAND_LIMIT_S = 480  # each command: at most 8 minutes (the tool allows 10)
DEVICE_S = 900  # 15 minutes of device time in all, the machine's start included
START_S = 120  # a machine's start, counted against the device time
INSTALL_S = 45  # the wheels' install at the start of each part
MAX_FILES = 6  # files that come back (the tool returns 8 at most)
CARRY_BYTES = 64 * 2 ** 20  # the working tree and carried paths together
OUTPUTS = ("verdicts.md", "verdicts.jsonl", "part1.log", "part2.log")

GPU_TESTS = ["tests/packed/kernels/test_gpu.py", "tests/ops/test_fla_tune.py", "tests/models/test_lora_compute.py",
             "tests/packed/test_tree.py"]


@dataclass
class Step:
    part: int
    name: str
    limit: int  # seconds
    argv: list[str]  # "{py}": the device's python
    verdicts: tuple[str, ...]  # what it decides (a step of verdicts.py decides its own)

    def command(self, python: str) -> list[str]:
        return [python if a == "{py}" else a for a in self.argv]


VERDICTS = ["{py}", "tools/gpu/verdicts.py"]
STEPS = [
    Step(1, "versions", 45, [*VERDICTS, "versions"], ("versions",)),
    Step(1, "kernels", 140, [*VERDICTS, "flex", "gdn"], ("flex", "gdn", "gdn_kernel")),
    Step(1, "parity", 80, [*VERDICTS, "parity"], ("parity",)),
    Step(1, "tests", 100, ["{py}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *GPU_TESTS],
         ("tests",)),
    Step(2, "memory", 170, [*VERDICTS, "memory"], ("memory",)),
    Step(2, "step", 140, [*VERDICTS, "speed", "offload"], ("speed", "offload")),
]
OWN_VERDICTS = {"tests"}  # decided here from the step's exit status and output


def limits() -> dict[str, int]:
    """Each step's limit, with GPU_CHECK_LIMITS="step=seconds,..." applied (for a slower device, and the tests)."""
    out = {s.name: s.limit for s in STEPS}
    for item in filter(None, os.environ.get("GPU_CHECK_LIMITS", "").split(",")):
        name, _, seconds = item.partition("=")
        if name not in out or not seconds.isdigit():
            raise SystemExit(f"GPU_CHECK_LIMITS: {item!r} is not step=seconds with a step of {', '.join(out)}")
        out[name] = int(seconds)
    return out


def part_seconds(part: int, lim: dict[str, int]) -> int:
    """The most a part can take: its install and every step's limit."""
    return INSTALL_S + sum(lim[s.name] for s in STEPS if s.part == part)


def wheel_dir() -> Path:
    return Path(os.environ.get("GPU_CHECK_WHEELS", REPO / ".whl"))


# -- the dry run ----------------------------------------------------------------------------------------------------
def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheel_problems(folder: Path) -> tuple[list[str], int]:
    """(what is wrong with the wheels in ``folder``, their bytes)."""
    from packtrain.versions import TESTED

    problems, size = [], 0
    files = {p.name: p for p in folder.glob("*.whl")} if folder.is_dir() else {}
    for name, version in WHEELS:
        prefix = f"{re.sub(r'[-.]+', '_', name).lower()}-{version}-"
        found = [p for n, p in files.items() if n.lower().startswith(prefix)]
        if not found:
            problems.append(f"{name}=={version} missing from {folder} (bash tools/fetch_gpu_wheels.sh)")
            continue
        path = found[0]
        size += path.stat().st_size
        tags = path.name[:-4].split("-")[-3:]  # python, abi, platform
        if not (tags[0].startswith("py3") or tags[0] == PYTHON_TAG or (tags[1] == "abi3" and tags[0] <= PYTHON_TAG)):
            problems.append(f"{path.name}: not for {PYTHON_TAG}")
        if tags[2] != "any" and PLATFORM not in tags[2]:
            problems.append(f"{path.name}: not for {PLATFORM}")
        try:
            with zipfile.ZipFile(path) as z:
                meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
                fields = dict(re.findall(r"^(Name|Version): (.+)$", z.read(meta).decode(), re.M))
        except (zipfile.BadZipFile, StopIteration, OSError) as e:
            problems.append(f"{path.name}: not a wheel ({type(e).__name__})")
            continue
        if _canonical(fields.get("Name", "")) != _canonical(name) or fields.get("Version") != version:
            problems.append(f"{path.name}: its metadata says {fields.get('Name')} {fields.get('Version')}")
        if name in TESTED and not TESTED[name][1].holds(version):
            problems.append(f"{name} {version} is outside packtrain's tested range {TESTED[name][1]}")
    return problems, size


def _tree_bytes() -> int:
    """The bytes of what travels besides the wheels: git's tracked and untracked-but-not-ignored files."""
    try:
        names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                               check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum((REPO / n).stat().st_size for n in names if n and (REPO / n).is_file())


def dry_run() -> int:
    """Every check, one line each ("ok" or what fails, naming the step); exit status 1 when any fails."""
    checks: list[tuple[str, list[str]]] = []
    lim = limits()
    parts = sorted({s.part for s in STEPS})
    for part in parts:
        steps = [s for s in STEPS if s.part == part]
        over = [] if part_seconds(part, lim) <= COMMAND_LIMIT_S else [
            f"part {part}'s steps take up to {part_seconds(part, lim)} s ({INSTALL_S} s install + "
            + " + ".join(f"{s.name} {lim[s.name]} s" for s in steps) + f"), over {COMMAND_LIMIT_S} s per command"]
        checks.append((f"budget: part {part}", over))
    both = START_S + sum(part_seconds(part, lim) for part in parts)
    checks.append(("budget: device time", [] if both <= DEVICE_S else [
        f"a start ({START_S} s) and the parts take up to {both} s, over the {DEVICE_S} s of device time"]))
    checks.append(("outputs", [] if len(OUTPUTS) <= MAX_FILES else [f"{len(OUTPUTS)} files, over {MAX_FILES}"]))
    problems, size = _wheel_problems(wheel_dir())
    tree = _tree_bytes()
    if size + tree > CARRY_BYTES:
        problems.append(f"the wheels ({size / 2**20:.1f} MiB) and the tree ({tree / 2**20:.1f} MiB) are over "
                        f"{CARRY_BYTES / 2**20:.0f} MiB")
    checks.append(("wheels", problems))
    for step in STEPS:
        checks.append((f"command: {step.name}", _command_problems(step)))
    failed = 0
    for name, problems in checks:
        print(f"{'ok  ' if not problems else 'FAIL'} {name}" + "".join(f"\n       {p}" for p in problems))
        failed += bool(problems)
    print(f"dry run: {len(checks) - failed} of {len(checks)} checks ok; the parts take at most "
          + ", ".join(f"{part_seconds(p, lim)} s" for p in parts) + f", with a start {both} s of {DEVICE_S}")
    return 1 if failed else 0


def _command_problems(step: Step) -> list[str]:
    """A step's command names files that exist and compile, and verdicts its script decides."""
    problems = []
    args = step.command(sys.executable)
    files = [a for a in args[1:] if a.endswith(".py")]
    for f in files:
        path = REPO / f
        if not path.is_file():
            problems.append(f"{f} does not exist")
            continue
        try:
            compile(path.read_text(), f, "exec")
        except SyntaxError as e:
            problems.append(f"{f} does not compile: line {e.lineno}: {e.msg}")
    if args[1:2] == ["tools/gpu/verdicts.py"] and not problems:
        listed = subprocess.run([sys.executable, str(REPO / "tools" / "gpu" / "verdicts.py"), "--list"],
                                capture_output=True, text=True, cwd=REPO).stdout.split()
        problems += [f"tools/gpu/verdicts.py decides no verdict {v!r}" for v in (*args[2:], *step.verdicts)
                     if v not in listed]
    problems += [f"{f} does not exist" for f in args if f.startswith("tests/") and not (REPO / f).is_file()]
    return problems


# -- a part on the device -------------------------------------------------------------------------------------------
def _record(out: Path, name: str, passed: bool, measured: str, bound: str, detail: str = "") -> None:
    sys.path.insert(0, str(REPO / "tools" / "gpu"))
    import verdicts

    os.environ["OUT"] = str(out)
    verdicts.record(name, passed, measured, bound, detail)


def _decided(out: Path) -> set[str]:
    path = out / "verdicts.jsonl"
    return {json.loads(x)["verdict"] for x in path.read_text().splitlines()} if path.exists() else set()


def _run(argv: list[str], limit: int, log, env) -> tuple[int, float]:
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = 124
    return rc, time.monotonic() - start


def run_part(part: int) -> int:
    out = Path(os.environ.get("OUT", "/tmp/gpu_check"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "verdicts.jsonl").unlink(missing_ok=True)
    lim = limits()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OUT": str(out)}
    with (out / f"part{part}.log").open("a") as log:
        wheels = sorted(wheel_dir().glob("*.whl"))
        if wheels:
            print(f"== install: {len(wheels)} wheels into {SITE}", file=log, flush=True)
            rc, _ = _run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--no-cache-dir", "--upgrade", "--target", SITE, *map(str, wheels)], INSTALL_S, log, env)
            if rc:
                _record(out, "wheels", False, f"pip exited {rc}", "installed", f"see part{part}.log")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (SITE if wheels else "", str(REPO),
                                                          env.get("PYTHONPATH", "")) if p)
        for step in (s for s in STEPS if s.part == part):
            print(f"== {step.name} (limit {lim[step.name]} s): {' '.join(step.command(sys.executable))}", file=log,
                  flush=True)
            start = log.tell()
            rc, seconds = _run(step.command(sys.executable), lim[step.name], log, env)
            log.flush()
            why = f"ran past its {lim[step.name]} s" if rc == 124 else f"exit {rc}"
            print(f"{step.name}: exit {rc} ({seconds:.0f} s, limit {lim[step.name]} s)", flush=True)
            if step.name in OWN_VERDICTS:
                text = (out / f"part{part}.log").read_text()[start:]
                tail = [x for x in text.splitlines() if x.strip()][-1:] or [""]
                _record(out, step.name, rc == 0, tail[0][:160], "exit 0", why if rc else f"{seconds:.0f} s")
            for missing in (v for v in step.verdicts if v not in _decided(out)):
                _record(out, missing, False, "not decided", "-", f"step {step.name} {why}")
    table = (out / "verdicts.md").read_text() if (out / "verdicts.md").exists() else "no verdict\n"
    print(table)
    rows = [json.loads(x) for x in (out / "verdicts.jsonl").read_text().splitlines()]
    return 0 if rows and all(r["pass"] for r in rows) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", nargs="?", type=int, choices=[1, 2], help="the part to run on the device")
    ap.add_argument("--dry-run", action="store_true", help="check the wheels, the commands and the time budget")
    ap.add_argument("--wheels", action="store_true", help="print the wheels to fetch, one pip requirement a line")
    args = ap.parse_args(argv)
    if args.wheels:
        print("\n".join(f"{n}=={v}" for n, v in WHEELS))
        return 0
    if args.dry_run:
        return dry_run()
    if args.part is None:
        ap.error("give a part (1 or 2), --dry-run or --wheels")
    return run_part(args.part)


if __name__ == "__main__":
    raise SystemExit(main())
