"""packtrain/commands/check_nodes.py: the command's own sequence, with what it calls stubbed (the config with its
overrides -> the ranks up, leaving the version refusal to the check -> the check, given the config -> the group shut
down, also while a refusal is on its way out); and one real single-rank run through ``cli.main`` in this process.
The check itself (tables, refusals) is tests/ops/test_nodes.py's; its version row, tests/test_versions.py's."""

import sys
from types import SimpleNamespace

import pytest
from cli_helpers import refused, run_in_process, write_config

from packtrain.commands import check_nodes as command
from packtrain.ops.nodes import NodeMismatchError


def _stubbed(monkeypatch, fail_check=None) -> list:
    """Replace what run_check_nodes calls with recorders; ``fail_check``: an exception the check raises."""
    calls = []
    cfg = SimpleNamespace(train=SimpleNamespace(device="cpu"), ops=SimpleNamespace(collective_timeout=42.5))
    info = SimpleNamespace(rank=0, world_size=1)

    def load_config(path, overrides):
        calls.append(("load_config", path, list(overrides)))
        return cfg

    def init_distributed(device, timeout, **kwargs):
        calls.append(("init_distributed", device, timeout, kwargs))
        return info

    def check_nodes(got, **kwargs):
        calls.append(("check_nodes", got is info, {k: v is cfg for k, v in kwargs.items()}))
        if fail_check is not None:
            raise fail_check

    def shutdown():
        calls.append(("shutdown", sys.exc_info()[1]))  # what is on its way out: the real one skips its barrier then

    for name, stub in [("load_config", load_config), ("init_distributed", init_distributed),
                       ("check_nodes", check_nodes), ("shutdown", shutdown)]:
        monkeypatch.setattr(command, name, stub)
    return calls


def _args(config="run.yaml", overrides=()):
    return SimpleNamespace(config=config, overrides=list(overrides))


def test_the_steps_in_order_and_exit_0(monkeypatch):
    calls = _stubbed(monkeypatch)
    assert command.run_check_nodes(_args("c.yaml", ["lora.r=8", "ops.collective_timeout=9"])) == 0
    assert calls == [
        ("load_config", "c.yaml", ["lora.r=8", "ops.collective_timeout=9"]),  # the overrides reach the config
        # the config's device and timeout; the versions are shown in the table and refused after it, not at start
        ("init_distributed", "cpu", 42.5, {"refuse_versions": False}),
        ("check_nodes", True, {"cfg": True}),  # compared with the config and data of every rank
        ("shutdown", None),  # the barrier runs: every rank passed
    ]


def test_a_refusal_still_shuts_the_group_down_and_goes_out_unchanged(monkeypatch):
    mismatch = NodeMismatchError("ranks differ in torch", {"torch": [("2.13.0", [0]), ("2.12.0", [1])]})
    calls = _stubbed(monkeypatch, fail_check=mismatch)
    with pytest.raises(NodeMismatchError) as caught:
        command.run_check_nodes(_args())
    assert caught.value is mismatch
    # shutdown sees the refusal in flight, so it skips the barrier a rank that refused differently may never reach
    assert calls[-1] == ("shutdown", mismatch) and [c[0] for c in calls].count("shutdown") == 1


def test_one_rank_through_the_cli_prints_its_table_and_exits_0(tmp_path):
    """The real command in this process: no launcher, one rank, nothing to differ; its --set reaches the config
    row (the resolved config's hash)."""
    cfg = str(write_config(tmp_path))
    plain = run_in_process("check-nodes", cfg)
    lines = plain.stdout.splitlines()
    assert lines[0] == "check-nodes: 1 rank on 1 host (all identical)" and plain.stderr == ""
    row = {line.split()[0]: line.split()[1] for line in lines[2:] if len(line.split()) == 3}
    assert row["config"] and row["data"]
    changed = run_in_process("check-nodes", cfg, "--set", "lora.r=8").stdout
    other = {line.split()[0]: line.split()[1] for line in changed.splitlines()[2:] if len(line.split()) == 3}
    assert other["config"] != row["config"] and other["data"] == row["data"]


def test_an_unknown_override_is_refused_in_one_line(tmp_path):
    proc = run_in_process("check-nodes", str(write_config(tmp_path)), "--set", "lora.rank=8", check=False)
    assert "lora.rank" in refused(proc) and proc.stdout == ""
