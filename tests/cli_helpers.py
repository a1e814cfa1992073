"""Run the real `packtrain` CLI on tiny configs written to a temp directory.

- `run_in_process`: ``packtrain.cli.main`` in the pytest process, the default for a check that needs no process of
  its own (refusals, 1-rank runs; conftest.py's ``trained`` caches reference runs).
- `run_ranks` / `start_ranks`: processes forked from a server that has packtrain imported, for what needs processes
  (ranks over gloo, signals, kills); each costs no interpreter start.
- `run_cli`: a fresh interpreter (`python -m packtrain`), for what the interpreter itself does (its start, its exit,
  what it reads from the environment at import); the tests of the launcher run torchrun themselves.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

TINY_MODEL = {
    "model_type": "qwen3_5_text", "vocab_size": 1024, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
}

# TINY_MODEL's MoE form (qwen3_5_moe_text: Qwen3.6-35B-A3B's family) as a model.config, for the CLI runs of MoE
TINY_MOE = {"model_type": "qwen3_5_moe_text",
            **{k: TINY_MODEL[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                          "head_dim", "tie_word_embeddings", "linear_num_key_heads",
                                          "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                                          "rope_parameters")},
            "num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "moe_intermediate_size": 8, "shared_expert_intermediate_size": 16, "num_experts": 4,
            "num_experts_per_tok": 2}

RULEBOOKS = [
    "Rulebook A. Map each colour word to its code: red is alpha, blue is beta, green is gamma. Answer with the code.",
    "Rulebook B. Map each colour word to its code: red is gamma, blue is alpha, green is beta. Answer with the code.",
    "Rulebook C. Answer with the colour word repeated twice, separated by a space.",
]


def write_text_data(path: Path, items_per_rulebook: int = 5, offset: int = 0) -> Path:
    words = ["red", "blue", "green", "red blue", "green red", "blue green", "blue"]
    lines = []
    for r, system in enumerate(RULEBOOKS):
        for i in range(items_per_rulebook):
            w = words[(i + offset + r) % len(words)]
            lines.append({"id": f"r{r}-{i + offset}", "system": system, "item": f"Colour: {w}",
                          "target": f"code for {w} under rulebook {'ABC'[r]}"})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def write_pair_data(path: Path, items_per_rulebook: int = 3, offset: int = 0) -> Path:
    """Text preference pairs over the rulebooks of :func:`write_text_data`: the rulebook's code chosen, another
    rulebook's rejected."""
    words = ["red", "blue", "green", "red blue", "green red", "blue green", "blue"]
    lines = []
    for r, system in enumerate(RULEBOOKS):
        for i in range(items_per_rulebook):
            w = words[(i + offset + r) % len(words)]
            lines.append({"id": f"r{r}-{i + offset}", "system": system, "item": f"Colour: {w}",
                          "chosen": f"code for {w} under rulebook {'ABC'[r]}",
                          "rejected": f"code for {w} under rulebook {'ABC'[(r + 1) % 3]}"})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


# 12 steps (6 with 2 packs per step); dropout and a cosine schedule make the RNG and scheduler state part of what a
# resume must restore: the run the resume proofs (tests/commands/test_train.py, tests/run/test_preemption.py)
# compare with
RESUMED = {"train": {"epochs": 2, "packs_per_step": 1, "save_every": 2}, "lora": {"dropout": 0.1},
           "optim": {"schedule": "cosine", "warmup_steps": 2}}


def write_config(tmp: Path, name: str = "cfg.yaml", **sections) -> Path:
    cfg = {
        "model": {"config": TINY_MODEL, "seed": 0, "dtype": "float64", "kernels": "torch"},
        "data": {"train": str(write_text_data(tmp / "train.jsonl")),
                 "eval": str(write_text_data(tmp / "eval.jsonl", items_per_rulebook=2, offset=3))},
        "packing": {"mode": "shared_prefix", "token_budget": 208, "max_continuations": 3},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "init_lora_weights": False},
        "optim": {"name": "adamw", "lr": 1.0e-3, "warmup_steps": 0},
        "train": {"epochs": 1, "packs_per_step": 2, "seed": 0, "save_every": 100},
        "logging": {"progress": False},
        "output_dir": str(tmp / "run"),
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values
    path = tmp / name
    path.write_text("# packtrain train " + name + "\n" + yaml.safe_dump(cfg))
    return path


def binary_tree_config(tmp_path, depth: int = 6, prefix: int = 30):
    """Pretokenized examples whose continuations are every string of ``depth`` bits (one token each, the last one
    the target): a full binary tree after P, 2**depth leaves and 2 + 4 + ... + 2**depth one-token nodes."""
    import itertools

    lines = [{"id": f"e{i}", "prefix_ids": list(range(100, 100 + prefix)), "item_ids": [10 + b for b in bits[:-1]],
              "target_ids": [20 + bits[-1]]} for i, bits in enumerate(itertools.product((0, 1), repeat=depth))]
    data = tmp_path / "tree.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return write_config(tmp_path, data={"train": str(data), "eval": None, "format": "pretokenized"},
                        packing={"mode": "tree", "token_budget": 100_000, "max_continuations": 90})


@contextlib.contextmanager
def _environment(env: dict | None):
    """``env`` set in os.environ for the block, then put back as it was."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_in_process(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """`packtrain ARGS` as ``packtrain.cli.main([...])`` in this process, read like :func:`run_cli`: its exit code
    (argparse's own exit 2 included) and what it printed. ``env`` holds for the call only, and torch's thread count
    is put back after it (bench sets its own). An exception that ``main`` does not turn into an exit code (a
    traceback in a process) propagates, with what the command printed before it."""
    import torch

    from packtrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    code = None
    try:
        with _environment(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse: a bad flag
                code = e.code if isinstance(e.code, int) else 2
    except BaseException:
        sys.stdout.write(out.getvalue())
        sys.stderr.write(err.getvalue())
        raise
    finally:
        torch.set_num_threads(threads)
        if code != 0:  # what a process frees at exit: a failed run's frames hold its open files in reference
            gc.collect()  # cycles (a tmpfs with one of them open cannot be unmounted)
    proc = subprocess.CompletedProcess(["packtrain", *map(str, args)], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"packtrain {' '.join(proc.args[1:])} exited {code}\n{proc.stdout}\n{proc.stderr}")
    return proc


def _cli_env(env: dict | None) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}


def _checked(proc: subprocess.CompletedProcess, args, check: bool) -> subprocess.CompletedProcess:
    if check and proc.returncode != 0:
        raise AssertionError(f"packtrain {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_cli(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """`packtrain ARGS` in a fresh interpreter, with one torch thread like every run of the suite (conftest.py)."""
    proc = subprocess.run([sys.executable, "-m", "packtrain", *args], capture_output=True, text=True,
                          env=_cli_env(env), cwd=REPO, check=False)
    return _checked(proc, args, check)


# A rank forked from the suite's rank server that forks `packtrain ARGS` and reports its peak resident set as wait4
# counts it. A child of the test process would carry the test process's own high-water mark (a fork's address space
# is its parent's, over 1 GiB late in the suite); the rank server's is its imports' alone, the same for every run,
# so differences between runs are the runs' own. No interpreter start and no import: each run costs its work only.
_PEAK_RSS_RANK = """
import os, sys, traceback
pid = os.fork()
if pid == 0:
    code = 1
    try:
        from packtrain.cli import main
        code = main(sys.argv[1:]) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
_, status, usage = os.wait4(pid, 0)
print(f"peak-rss-kib {usage.ru_maxrss}", file=sys.stderr)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def peak_rss_cli(*runs: list[str], env: dict | None = None, check: bool = True, threads: int = 1
                 ) -> list[tuple[subprocess.CompletedProcess, int]]:
    """Several `packtrain ARGS` at once, each a process of its own, and each process's peak resident set in bytes as
    the kernel counted it for that process alone (``wait4``'s ``ru_maxrss``, taken by its parent: see
    ``_PEAK_RSS_RANK``)."""
    started = [(args, start_ranks(1, *args, env=env, script=_PEAK_RSS_RANK, threads=threads)) for args in runs]
    results = []
    for args, ranks in started:
        try:
            out, err = ranks.communicate(600)
        except subprocess.TimeoutExpired:
            ranks.kill()
            raise AssertionError(f"packtrain {' '.join(map(str, args))} ran past 600 s") from None
        err, _, peak = err.rstrip("\n").rpartition("peak-rss-kib ")
        proc = subprocess.CompletedProcess(["packtrain", *args], ranks.returncode, out, err)
        _checked(proc, args, check)
        results.append((proc, int(peak) * 1024 if peak else 0))  # kilobytes on Linux
    return results


_next_port = None


def free_port() -> int:
    """A port no other test worker hands out: each xdist worker takes its own range below the kernel's ephemeral
    ports (20000 + 4000 x its number), in turn, skipping one that is bound."""
    import itertools
    import socket

    global _next_port
    if _next_port is None:
        worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
        _next_port = itertools.cycle(range(20000 + 4000 * worker, 24000 + 4000 * worker))
    for port in _next_port:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


# What a rank imports as it runs a command (its arguments read, its model built and wrapped by peft, its loss plot
# drawn): loaded once, in the fork server, not in every rank (a 1-rank run of the demo's first 3 steps took 1.8 s
# with the first six alone, 1.0 s with all); none of them imports fla (tests/packed/kernels/test_hf_route.py)
_RANK_PRELOAD = ["cli_helpers", "packtrain.cli", "packtrain.commands.train", "packtrain.commands.check_nodes",
                 "packtrain.run.trainer", "packtrain.packed.patch", "packtrain.packed.lm", "packtrain.models.build",
                 "packtrain.models.wrap", "packtrain.models.offload", "packtrain.commands.eval",
                 "packtrain.commands.export", "packtrain.commands.smoke", "peft", "matplotlib.figure",
                 "matplotlib.backends.backend_agg"]
_ranks_context = None


def _fork_server():
    """multiprocessing's fork server, started once per session with packtrain imported: each rank is a fork of that
    one-threaded process, so a 2-rank run costs no interpreter start and no import."""
    global _ranks_context
    if _ranks_context is None:
        import multiprocessing
        from multiprocessing import forkserver

        _ranks_context = multiprocessing.get_context("forkserver")
        _ranks_context.set_forkserver_preload(_RANK_PRELOAD)
        # PASSIVE: a thread of a rank run at 2 threads that waits for work sleeps rather than spins (OpenMP reads it
        # once, where torch loads: in the server); spinning threads on the suite's two busy cores took 3x the time
        with _environment({"OMP_WAIT_POLICY": "PASSIVE"}):
            forkserver.ensure_running()
    return _ranks_context


def _rank_main(rank: int, world: int, port: int, args: list[str], env: dict, script: str | None, out: str,
               err: str, threads: int) -> None:
    """One rank, as torchrun starts it (the same environment variables), its output in two files, on ``threads``
    torch threads. What the rank inherits from the server (packtrain and its imports) lives as long as the rank: out
    of the garbage collector's reach (conftest.py's pytest_collection_finish does the same in the test workers)."""
    import gc

    import torch

    gc.freeze()
    os.environ.update({**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(threads)
    with open(out, "w") as fo, open(err, "w") as fe:
        os.dup2(fo.fileno(), 1)
        os.dup2(fe.fileno(), 2)
    code = 1
    try:
        if script is None:
            from packtrain.cli import main

            code = main(args)
        else:
            sys.argv = ["rank-script", *args]
            exec(compile(script, "<rank script>", "exec"), {"__name__": "__main__"})  # noqa: S102 - the test's own
            code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a traceback, as a process would print it
        import traceback

        traceback.print_exc()
    sys.exit(code)  # multiprocessing flushes the streams and runs the exit handlers (its semaphores' unlinking)


class Ranks:
    """Ranks forked by :func:`start_ranks`, running in the background, read like the ``subprocess.Popen`` of a
    torchrun job (or, with one rank, of the process): ``poll()``, ``communicate(timeout)``, ``kill()``,
    ``send_signal(sig)`` and ``pid`` (rank 0's), ``returncode`` (the first non-zero exit code of a rank), and
    ``returncodes`` (each rank's). stdout and stderr are the ranks' in rank order. A rank that is still running
    ``GRACE`` seconds after another failed is killed, as torchrun stops a job whose worker failed."""

    GRACE = 30.0

    def __init__(self, procs, folder: str, args: list[str]):
        self.procs, self.folder, self.args = procs, folder, args
        self.returncode = self.returncodes = None
        self._failed_at = None

    def poll(self) -> int | None:
        import time

        codes = [p.exitcode for p in self.procs]
        if None in codes:
            if self._failed_at is None and any(c not in (None, 0) for c in codes):
                self._failed_at = time.monotonic()
            if self._failed_at is not None and time.monotonic() > self._failed_at + self.GRACE:
                self.kill()
            return None
        self.returncodes = codes
        self.returncode = next((c for c in codes if c), 0)
        return self.returncode

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
        for p in self.procs:
            p.join()
        self.poll()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        import shutil
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        outs = []
        for rank in range(len(self.procs)):
            outs.append(tuple(Path(self.folder, f"{kind}-{rank}").read_text() for kind in ("out", "err")))
        shutil.rmtree(self.folder, ignore_errors=True)
        return "".join(o for o, _ in outs), "".join(e for _, e in outs)


def start_ranks(nproc: int, *args: str, env: dict | None = None, script: str | None = None,
                world: int | None = None, threads: int = 1) -> Ranks:
    """`packtrain ARGS` (or the Python ``script``, ARGS its sys.argv) on ``nproc`` ranks over gloo, in the background:
    each rank a process forked from a server with packtrain imported (:func:`_fork_server`), in the environment
    torchrun gives a rank (torchrun itself: tests/test_distributed.py's launch script). ``world``: the world size the
    ranks are told (default ``nproc``; more: ranks that never start). ``threads``: each rank's torch threads (a
    fork of the server, which never ran a parallel region, runs as many as it is set to)."""
    import tempfile

    ctx = _fork_server()
    port = free_port()
    folder = tempfile.mkdtemp(prefix="ranks-")
    full_env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads), **(env or {})}
    argv = [str(a) for a in args]
    procs = [ctx.Process(target=_rank_main, args=(r, world or nproc, port, argv, full_env, script,
                                                  os.path.join(folder, f"out-{r}"), os.path.join(folder, f"err-{r}"),
                                                  threads))
             for r in range(nproc)]
    for p in procs:
        p.start()
    return Ranks(procs, folder, ["ranks", str(nproc), *argv])


def run_ranks(nproc: int, *args: str, env: dict | None = None, check: bool = True, timeout: float = 240,
              script: str | None = None, world: int | None = None, threads: int = 1) -> subprocess.CompletedProcess:
    """:func:`start_ranks`, waited for (killed past ``timeout`` seconds): a CompletedProcess, with ``returncodes``."""
    ranks = start_ranks(nproc, *args, env=env, script=script, world=world, threads=threads)
    try:
        out, err = ranks.communicate(timeout)
    except subprocess.TimeoutExpired:
        ranks.kill()
        out, err = ranks.communicate()
        raise AssertionError(f"{nproc} ranks of {' '.join(ranks.args[2:])} ran past {timeout} s (exit codes "
                             f"{ranks.returncodes})\n{out}\n{err[-4000:]}") from None
    proc = subprocess.CompletedProcess(ranks.args, ranks.returncode, out, err)
    proc.returncodes = ranks.returncodes
    if check and proc.returncode != 0:
        raise AssertionError(f"{nproc} ranks of {' '.join(ranks.args[2:])} exited {ranks.returncodes}\n{out}\n"
                             f"{err[-4000:]}")
    return proc


def write_model_dir(path: Path, seed: int = 0) -> Path:
    """A local model directory as `model.path` expects one: a tiny random Qwen3.5 text model (TINY_MODEL,
    `save_pretrained`) with the bundled tokenizer beside it."""
    import torch
    from transformers import AutoConfig, Qwen3_5ForCausalLM

    from packtrain.data.jsonl import load_tokenizer

    raw = dict(TINY_MODEL)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(seed)
    Qwen3_5ForCausalLM(config).save_pretrained(path)
    load_tokenizer().save_pretrained(path)
    return path


# SGD without clipping: a trained adapter is a plain function of the summed gradients, so two runs that should
# compute the same gradients can be compared through their adapters (AdamW's first step would amplify rounding).
SGD = {"name": "sgd", "lr": 0.5, "warmup_steps": 0, "max_grad_norm": None}


def adapter_of(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def metrics_of(run_dir: Path) -> list[dict]:
    """A run's ``metrics.jsonl``, one dict per line."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list:
    return [r["loss"] for r in metrics_of(run_dir) if r.get("split") != "eval"]


def refused(proc) -> str:
    """The stderr of a command refused as a user error: exit 2, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


def assert_equal_adapters(a: dict, b: dict) -> None:
    """Bit for bit: the same tensor names (at least one) and every tensor equal."""
    import torch

    assert a.keys() == b.keys() and a
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


def adapter_rel(a: dict, b: dict) -> float:
    """The largest over two adapters' tensors of max|a - b| / max|b|. Unlike parity.max_rel it has no floor: a tensor
    that is zero in ``b`` makes it nan, and the comparison fails."""
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in a)


def assert_tree_shared(cfg: Path, run_dir: Path, *sets: str) -> None:
    """The tree run in ``run_dir`` (one pass over ``cfg``'s training data, ``sets``: its ``--set`` values besides
    packing.mode) computed fewer buffer positions than the flat packs of packing.mode shared_prefix hold (`packtrain
    plan`: each P once per pack, each continuation whole). A run whose packs shared nothing past P (a planner or a
    kind fallen back to flat packs) trains the standalone update too, and fails here."""
    steps = [r for r in metrics_of(run_dir) if r.get("split") != "eval"]
    flat = json.loads(run_in_process("plan", cfg, "--json", "--set", "packing.mode=shared_prefix",
                                     *(x for value in sets for x in ("--set", value))).stdout)
    assert sum(r["examples"] for r in steps) == flat["examples"], "not one pass over the training data"
    computed = sum(r["positions"] for r in steps)
    assert computed < flat["positions_packed"], (f"the tree shared nothing: {computed} positions computed, the flat "
                                                 f"packs hold {flat['positions_packed']}")


def assert_tree_trains_as_standalone(cfg: Path, tmp: Path, examples: int, *standalone: str) -> None:
    """``cfg`` (one SGD step) trained under packing.mode tree and standalone (``standalone``: its extra ``--set``
    values) gives the same adapter and loss, the tree having shared positions (:func:`assert_tree_shared`), and the
    tree's adapter evaluates the same ``examples`` per-example losses in both modes. Tolerances: float64 except
    transformers' float32 casts (RMSNorm, gated norm, GDN gate), measured 1.4e-8 on the adapter."""
    tree = run_in_process("train", cfg, "--set", f"output_dir={tmp / 'tree'}", "--set", "packing.mode=tree")
    assert "mode tree" in tree.stdout
    assert_tree_shared(cfg, tmp / "tree")
    sets = [x for value in standalone for x in ("--set", value)]
    run_in_process("train", cfg, "--set", f"output_dir={tmp / 'alone'}", "--set", "packing.mode=standalone", *sets)
    assert adapter_rel(adapter_of(tmp / "tree"), adapter_of(tmp / "alone")) < 1e-6
    (a,), (b,) = train_losses(tmp / "tree"), train_losses(tmp / "alone")
    assert abs(a - b) < 1e-9 * abs(b)
    rows = {}
    for mode in ("tree", "standalone"):
        out = tmp / f"{mode}.jsonl"
        run_in_process("eval", cfg, "--adapter", tmp / "tree" / "adapter", "--out", out,
                       "--set", f"packing.mode={mode}", *sets)
        rows[mode] = {r["id"]: r["loss"] for r in map(json.loads, out.read_text().splitlines())}
    assert rows["tree"].keys() == rows["standalone"].keys() and len(rows["tree"]) == examples
    assert all(abs(rows["tree"][k] - v) < 1e-9 * abs(v) for k, v in rows["standalone"].items())


def seed_unit_shape():
    """The seed-like pack of tools/data/make_seed_data.py as the memory estimate sizes it: P 64,000 + 80 continuations of
    400-700 + 200-400 tokens."""
    from packtrain.memory.estimate import UnitShape

    sys.path.insert(0, str(REPO / "tools" / "data"))
    from make_seed_data import seed_records

    records = list(seed_records(64_000, 80, 248_320, 0))
    return UnitShape(64_000, [len(r["item_ids"]) + len(r["target_ids"]) for r in records],
                     [len(r["target_ids"]) for r in records])
