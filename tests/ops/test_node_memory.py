"""What a node holds for its ranks: `plan --memory --ranks-per-node N --host-memory-per-node GIB` prints the offload
pools of a node's ranks together (each rank's checkpointed layer inputs in whole 64 MiB chunks), `train` refuses at
start a run whose pools would not fit, and `check-nodes` groups its table by machine."""

import json
import math

from cli_helpers import TINY_MODEL, run_in_process, write_config

from packtrain.ops import nodes

OFFLOAD = {"activation_checkpointing": True, "offload": True, "device": "cpu"}


def _pool_by_hand(positions: int) -> int:
    """One rank's pool: each of the 3 layers' float64 input [T, 32] in whole 64 MiB chunks."""
    layer_input = positions * TINY_MODEL["hidden_size"] * 8
    return TINY_MODEL["num_hidden_layers"] * math.ceil(layer_input / 2**26) * 2**26


def test_plan_prints_the_offload_pool_per_node(tmp_path):
    cfg = write_config(tmp_path, train=OFFLOAD)
    out = json.loads(run_in_process("plan", cfg, "--json", "--memory", "--ranks-per-node", "8",
                                    "--host-memory-per-node", "0.25").stdout)
    node = out["memory"]["node"]
    largest = max(out["pack_positions"])
    assert node["host_per_rank_bytes"] == _pool_by_hand(largest) == 3 * 2**26  # one chunk per layer
    assert node["host_per_node_bytes"] == 8 * node["host_per_rank_bytes"]  # 1.5 GiB: 8 ranks x 3 chunks
    assert (node["ranks_per_node"], node["host_memory_per_node_bytes"], node["fits"]) == (8, 2**28, False)
    table = run_in_process("plan", cfg, "--memory", "--ranks-per-node", "8", "--host-memory-per-node", "0.25").stdout
    assert ("offload pool per node: 8 ranks x 0.19 GiB = 1.50 GiB of host memory, does not fit 0.25 GiB: 1.25 GiB "
            "short") in table
    fits = run_in_process("plan", cfg, "--memory", "--ranks-per-node", "2", "--host-memory-per-node", "1").stdout
    assert "2 ranks x 0.19 GiB = 0.38 GiB of host memory, fits 1.00 GiB (0.62 GiB left)" in fits


def test_train_refuses_an_offload_pool_the_node_cannot_hold(tmp_path):
    cfg = write_config(tmp_path, train=OFFLOAD, ops={"host_memory_per_node_gib": 0.1})
    proc = run_in_process("train", cfg, check=False)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "train.offload: offload pool per node: 1 rank x 0.19 GiB = 0.19 GiB of host memory, does not fit " \
           "0.10 GiB: 0.09 GiB short" in line
    assert not (tmp_path / "run" / "adapter").exists()


def _report(rank, machine, host="h", **fields):
    return nodes.NodeReport(rank, {"host": host, "torch": "2.13.0", **fields}, machine=machine)


def test_check_nodes_groups_its_table_by_machine():
    reports = [_report(r, r // 4) for r in range(8)]
    reports[6].fields["torch"] = "2.11.0"
    lines = nodes.format_table(reports).splitlines()
    assert lines[0] == "check-nodes: 8 ranks on 2 machines, 1 host (1 field differs, marked !)"
    assert lines[1] == "  machine 0 (h): ranks 0-3, as the majority"
    assert lines[2] == "  machine 1 (h): ranks 4-7, differs in torch"
    one_machine = nodes.format_table([_report(0, 0), _report(1, 0)]).splitlines()
    assert one_machine[0] == "check-nodes: 2 ranks on 1 host (all identical)"
    assert not any(line.startswith("  machine ") for line in one_machine)
