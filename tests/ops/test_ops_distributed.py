"""check-nodes and the hang watchdog over two gloo ranks: fresh interpreters under torchrun where the exit itself is
checked, ranks forked with packtrain imported (cli_helpers.run_ranks) elsewhere."""

import os
import subprocess
import sys

import pytest
from cli_helpers import REPO, free_port, run_ranks, write_config

pytestmark = [pytest.mark.distributed, pytest.mark.process]


_CHECK_NODES_THEN_COUNT_THREADS = """
import os, sys
from packtrain.cli import main
rc = main(["check-nodes", sys.argv[1]])
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(f"rank {os.environ['RANK']}: rc {rc}, gloo threads left {[n for n in names if 'gloo' in n]}", flush=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names from /proc (Linux)")
def test_identical_ranks_pass_and_leave_no_gloo_worker_at_exit(tmp_path):
    """Two identical ranks pass check-nodes, and both interpreters exit 0. That was flaky: rank 0 aborted at exit
    ("terminate called without an active exception", SIGABRT) on 3 of 16 runs, 2 of 10 here; after the fix, 40
    two-rank runs of `packtrain check-nodes` in a row exited 0: ``bash tools/experiments/loop_check_nodes.sh 40``.

    The cause, checked here without luck: gloo's worker threads were still alive when the interpreter shut down
    (the default group was pinned by torch.distributed.nn's default arguments, imported by peft after init), and
    one still releasing the last all_gather's tensors needs the GIL, which a finalizing interpreter never gives
    back: it is killed inside a C++ destructor -> std::terminate. Now the group is destroyed for real, which joins
    the workers before ``main`` returns."""
    script = tmp_path / "check_nodes_threads.py"
    script.write_text(_CHECK_NODES_THEN_COUNT_THREADS)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), str(write_config(tmp_path))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]  # no rank aborted at exit
    assert "check-nodes: 2 ranks on 1 host (all identical)" in proc.stdout, proc.stdout[-2000:]
    for rank in (0, 1):
        assert f"rank {rank}: rc 0, gloo threads left []" in proc.stdout, proc.stdout[-2000:]


def test_a_rank_seeing_another_transformers_is_refused_naming_field_and_ranks(tmp_path):
    import transformers

    proc = run_ranks(2, "check-nodes", str(write_config(tmp_path)), check=False,
                     env={"PACKTRAIN_TEST_OVERRIDE_RANK1": "transformers=5.0.0"})
    assert proc.returncode != 0
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert ["transformers", "!", transformers.__version__, "0"] in rows and ["!", "5.0.0", "1"] in rows
    assert f"transformers: {transformers.__version__} on rank 0; 5.0.0 on rank 1" in proc.stderr


_HANGING_RANK = """
import sys, time
from pathlib import Path
from packtrain.config import config_from_dict
from packtrain.distributed import barrier, init_distributed, shutdown
from packtrain.ops.runtime import RunOps

def sleeping_step():
    time.sleep(2.5)

out = Path(sys.argv[1])
cfg = config_from_dict({"output_dir": str(out), "ops": {"hang_timeout": 0.5}})
info = init_distributed("cpu")
ops = RunOps(cfg, info, out)
ops.start()  # check-nodes over both ranks first
sleeping_step()
barrier(info)
ops.close()
shutdown()
"""


def test_a_step_past_the_timeout_leaves_a_stack_file_per_rank(tmp_path):
    proc = run_ranks(2, tmp_path / "run", script=_HANGING_RANK, timeout=120, check=False)
    assert proc.returncodes == [0, 0], proc.stderr[-3000:]
    assert "check-nodes: 2 ranks on 1 host (all identical)" in proc.stdout
    for rank in (0, 1):
        text = (tmp_path / "run" / "hang" / f"rank-{rank}.txt").read_text()
        assert f"rank {rank}, pid" in text and "no step completed for" in text and "in sleeping_step" in text


def test_train_refuses_mismatched_ranks_before_step_0(tmp_path):
    cfg = write_config(tmp_path, train={"max_steps": 1})
    proc = run_ranks(2, "train", str(cfg), check=False, env={"PACKTRAIN_TEST_OVERRIDE_RANK1": "transformers=5.0.0"})
    assert proc.returncode != 0 and "5.0.0 on rank 1" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


_RANK_WITH_ITS_OWN_HOME = """
import os, sys
from packtrain.cli import main
os.environ["HOME"] = sys.argv[1 + int(os.environ["RANK"])]  # data.tokenizer "~/tok": each rank its own folder
sys.exit(main(["train", sys.argv[3]]))
"""


def test_machines_whose_tokenizer_differs_refuse_before_writing_anything(tmp_path):
    # one path, data.tokenizer ~/tok, two contents (tok/chat_template.jinja edited on one machine): both trained and
    # exited 0, or waited until ops.collective_timeout (an hour) for a gloo traceback when their plans differed
    import shutil

    from packtrain.data.jsonl import BUNDLED_TOKENIZER

    homes = [tmp_path / "home0", tmp_path / "home1"]
    for home in homes:
        shutil.copytree(BUNDLED_TOKENIZER, home / "tok")
    template = homes[1] / "tok" / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|im_start|>", "<|im_start|> "))
    cfg = write_config(tmp_path, data={"tokenizer": "~/tok", "eval": None}, train={"max_steps": 1})
    proc = run_ranks(2, *map(str, homes), str(cfg), script=_RANK_WITH_ITS_OWN_HOME, check=False, timeout=120)
    assert proc.returncodes == [2, 2], (proc.returncodes, proc.stderr[-3000:])
    assert proc.stderr.count("tokenizer chat_template.jinja contents: ") == 2, proc.stderr[-3000:]
    assert "give every machine the same files" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
