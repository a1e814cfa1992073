"""What the savings must fit (packtrain/memory/budget.py): plan's budget from its flags, the reserve, the host's
sources in their order, the CPU's memory shared by the node's ranks, and a node's offload pools."""

import json

import pytest

from packtrain.config import config_from_dict
from packtrain.memory import budget as b
from packtrain.memory.estimate import GiB


def _cfg(device="cuda", host_gib=None):
    return config_from_dict({"train": {"device": device}, "ops": {"host_memory_per_node_gib": host_gib}})


def test_the_reserve_is_two_gib_and_five_percent():
    assert b.device_reserve(80 * GiB) == 2 * GiB + 4 * GiB
    assert b.device_reserve(0) == 2 * GiB


def test_plan_takes_the_gpu_it_is_given_less_the_reserve():
    got = b.plan_budget(_cfg(), world_size=64, gpu_memory_gib=40)
    assert (got.device, got.device_total, got.device_bytes) == ("cuda", 40 * GiB, 40 * GiB - 4 * GiB)
    assert got.ranks_per_node == 8 and got.host_per_node is None  # up to 8 ranks a node; the host not limited
    assert b.plan_budget(_cfg(), world_size=3, gpu_memory_gib=40).ranks_per_node == 3
    assert b.plan_budget(_cfg(), 64, 40, ranks_per_node=4).ranks_per_node == 4
    # a GPU smaller than the reserve holds nothing
    assert b.plan_budget(_cfg(), 1, 1.0).device_bytes == 0


def test_without_a_gpu_size_plan_assumes_80_gib_and_says_so():
    got = b.plan_budget(_cfg(), world_size=8)
    assert got.device_total == 80 * GiB and "assumed" in got.device_source


@pytest.mark.parametrize("flag, ops, expected, source", [
    (None, None, None, "--host-memory-per-node GIB: not given"),
    (None, 512, 512 * GiB, "ops.host_memory_per_node_gib"),
    (256, 512, 256 * GiB, "--host-memory-per-node"),  # the flag over the config
])
def test_the_host_limit_comes_from_the_flag_then_the_config(flag, ops, expected, source):
    got = b.plan_budget(_cfg(host_gib=ops), 64, 80, 8, flag)
    assert (got.host_per_node, got.host_source) == (expected, source)


def test_on_the_cpu_the_hosts_available_memory_is_shared_by_its_ranks(monkeypatch):
    monkeypatch.setattr(b, "available_host_memory", lambda: 20 * GiB)
    got = b.plan_budget(_cfg("cpu"), world_size=2, ranks_per_node=2)
    reserve = b.device_reserve(20 * GiB)
    assert (got.device, got.reserve, got.device_bytes) == ("cpu", reserve, (20 * GiB - reserve) // 2)
    monkeypatch.setattr(b, "available_host_memory", lambda: None)
    assert b.plan_budget(_cfg("cpu"), 1).device_bytes is None  # unknown: not limited


def test_a_nodes_pools_fit_or_say_how_much_is_short():
    fits = b.node_pool(10 * GiB, 8, 100 * GiB)
    assert fits["host_per_node_bytes"] == 80 * GiB and fits["fits"] is True
    assert "fits 100.00 GiB (20.00 GiB left)" in b.format_node_pool(fits)
    short = b.node_pool(10 * GiB, 8, 64 * GiB)
    assert short["fits"] is False and "16.00 GiB short" in b.format_node_pool(short)
    assert b.node_pool(10 * GiB, 8, None)["fits"] is None


def test_the_budget_says_what_it_holds():
    text = b.plan_budget(_cfg(), 64, 40, 8, 256).describe()
    assert "36.00 GiB per GPU" in text and "256.00 GiB of host memory per node" in text and "8 ranks per node" in text
    # plan --json's form of it: the figures the line above says, JSON-able as they are
    as_json = b.plan_budget(_cfg(), 1, 40).as_json()
    assert json.loads(json.dumps(as_json)) == as_json
    assert as_json == {"device": "cuda", "device_bytes": 36 * GiB, "device_total": 40 * GiB, "reserve": 4 * GiB,
                       "device_source": "--gpu-memory 40", "host_per_node": None,
                       "host_source": "--host-memory-per-node GIB: not given", "ranks_per_node": 1}
