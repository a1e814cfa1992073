"""check-nodes in one process: the report, the test hook, grouping and the refusal message (tables as literals)."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from packtrain.ops import nodes
from packtrain.ops.nodes import NodeMismatchError, NodeReport

ONE = SimpleNamespace(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), is_main=True, enabled=False)


def _report(rank, **fields):
    base = {"host": "a", "python": "3.11.7", "torch": "2.13.0", "transformers": "5.24.0"}
    return NodeReport(rank, {**base, **fields})


def test_the_report_is_what_this_process_imports(monkeypatch):
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    f = nodes.node_report(0, torch.device("cpu")).fields
    assert f["torch"] == torch.__version__ and f["transformers"] == transformers.__version__
    assert f["transformers path"] == str(Path(transformers.__file__).resolve().parent)
    for name in nodes.PACKAGES:
        assert name in f and f"{name} path" in f
    assert f["gpu"] == "none (cpu)" and f["nccl"] == "none"
    assert f["FLA_CACHE_MODE"] == "disabled"
    if importlib.util.find_spec("fla") is None:
        assert f["fla"] == "not installed" and f["fla path"] == "-" and f["FLA_CONFIG_DIR"] == "unset"
    else:  # fla installed (the `fla` extra make test installs): its own default folder
        from fla.ops.utils import cache

        assert f["FLA_CONFIG_DIR"] == str(cache.get_fla_config_dir())


def test_override_hook_needs_the_rank_in_its_name(monkeypatch):
    monkeypatch.setenv("PACKTRAIN_TEST_OVERRIDE_RANK1", "transformers=5.0.0")
    r0, r1 = _report(0), _report(1)
    nodes.apply_test_override(r0)
    nodes.apply_test_override(r1)
    assert r0.fields["transformers"] == "5.24.0" and r0.overridden == []
    assert r1.fields["transformers"] == "5.0.0" and r1.overridden == ["transformers"]


def test_override_of_an_unknown_field_is_an_error(monkeypatch):
    monkeypatch.setenv("PACKTRAIN_TEST_OVERRIDE_RANK0", "transformer=5.0.0")
    with pytest.raises(ValueError, match="PACKTRAIN_TEST_OVERRIDE_RANK0"):
        nodes.apply_test_override(_report(0))


def test_rank_list():
    assert nodes.rank_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert nodes.rank_list([3]) == "3"


def test_differences_group_ranks_by_value_and_ignore_the_host():
    reports = [_report(0, host="a"), _report(1, host="a", transformers="5.0.0"), _report(2, host="b"),
               _report(3, host="b", torch="2.11.0")]
    assert nodes.differences(reports) == {
        "torch": [("2.13.0", [0, 1, 2]), ("2.11.0", [3])],
        "transformers": [("5.24.0", [0, 2, 3]), ("5.0.0", [1])],
    }


def test_table_marks_each_differing_field_with_its_ranks():
    reports = [_report(0), _report(1, transformers="5.0.0"), _report(2)]
    reports[1].overridden = ["transformers"]
    lines = nodes.format_table(reports).splitlines()
    assert lines[0] == "check-nodes: 3 ranks on 1 host (1 field differs, marked !)"
    rows = [line.split() for line in lines[2:]]
    assert ["torch", "2.13.0", "all"] in rows
    assert ["transformers", "!", "5.24.0", "0,2"] in rows and ["!", "5.0.0", "1"] in rows
    assert lines[-1] == "  rank 1: transformers set by PACKTRAIN_TEST_OVERRIDE_RANK1"


def test_mismatch_error_names_field_values_and_ranks():
    err = nodes.mismatch_error(nodes.differences([_report(0), _report(1, transformers="5.0.0")]))
    assert isinstance(err, ValueError)
    assert "  transformers: 5.24.0 on rank 0; 5.0.0 on rank 1" in str(err).splitlines()
    assert err.fields == {"transformers": [("5.24.0", [0]), ("5.0.0", [1])]}


def test_check_nodes_alone_passes_and_prints_the_table():
    lines = []
    reports = nodes.check_nodes(ONE, lines.append)
    assert len(reports) == 1 and lines[0].startswith("check-nodes: 1 rank on 1 host (all identical)")


def test_check_nodes_refuses_a_difference(monkeypatch):
    other = _report(1, transformers="5.0.0")
    monkeypatch.setattr(nodes, "gather_objects", lambda report, info: [report, other])
    with pytest.raises(NodeMismatchError) as e:
        nodes.check_nodes(ONE, lambda _: None)
    assert "transformers" in e.value.fields


def test_fla_configs_are_reported_by_digest(tmp_path, monkeypatch):
    entry = {"kwargs": {"BT": 32}, "num_warps": 4, "num_stages": 2, "num_ctas": 1}
    (tmp_path / "l2norm_bwd_kernel.json").write_text(json.dumps({"autotune_entries": {}, "default_config": entry}))
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("FLA_CACHE_MODE", "default")
    first = nodes.fla_cache_fields(nodes.NOT_INSTALLED)
    assert first["FLA_CACHE_MODE"] == "default" and first["FLA_CONFIG_DIR"] == str(tmp_path)
    assert first["FLA default configs"].startswith("1 kernel, digest ")
    entry["num_warps"] = 8
    (tmp_path / "l2norm_bwd_kernel.json").write_text(json.dumps({"autotune_entries": {}, "default_config": entry}))
    assert nodes.fla_cache_fields(nodes.NOT_INSTALLED)["FLA default configs"] != first["FLA default configs"]
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path / "missing"))
    assert nodes.fla_cache_fields(nodes.NOT_INSTALLED)["FLA default configs"] == "folder missing"


def test_fla_pinning_note():
    fields = {"fla": "0.6.0", "FLA_CACHE_MODE": "disabled", "FLA_CONFIG_DIR": "unset", "FLA default configs": "-"}
    assert "pretune-fla" in nodes.fla_pinning_note(fields)
    fields.update({"FLA_CACHE_MODE": "default", "FLA default configs": "none"})
    assert "no pinned configs" in nodes.fla_pinning_note(fields)
    fields["FLA default configs"] = "3 kernels, digest 0123456789ab"
    assert nodes.fla_pinning_note(fields) is None
    assert nodes.fla_pinning_note({**fields, "fla": "not installed", "FLA_CACHE_MODE": "disabled"}) is None


def test_check_nodes_shows_and_refuses_ranks_with_different_configs(monkeypatch, tmp_path):
    # two machines started with different --set options: a row per differing key, and a refusal naming key and ranks
    from cli_helpers import write_config

    from packtrain.config import load_config

    cfg = load_config(write_config(tmp_path))
    mine = nodes.config_settings(cfg)
    other = NodeReport(1, {}, machine=1, settings={**mine, "optim.lr": "0.5"})
    other_fields = nodes.node_report(0, torch.device("cpu"), cfg).fields
    other.fields = {**other_fields, "config": "0123456789ab"}
    monkeypatch.setattr(nodes, "gather_objects", lambda report, info: [report, other])
    lines = []
    with pytest.raises(nodes.ConfigMismatchError) as e:
        nodes.check_nodes(ONE, lines.append, cfg)
    assert str(e.value).startswith("ranks were started with different configs, refusing to start (1 key): "
                                   "optim.lr: 0.001 on rank 0 (machine 0), 0.5 on rank 1 (machine 1);")
    assert "\n" not in str(e.value) and e.value.keys == {"optim.lr": [("0.001", [0]), ("0.5", [1])]}
    rows = [line.split() for line in lines[0].splitlines()]
    assert ["config:", "optim.lr", "!", "0.001", "0"] in rows and ["!", "0.5", "1"] in rows
    assert ["config", "!", other_fields["config"], "0"] in rows and ["data", other_fields["data"], "all"] in rows


def test_the_same_data_path_with_other_contents_is_a_config_difference(tmp_path):
    from cli_helpers import write_config

    from packtrain.config import load_config

    cfg = load_config(write_config(tmp_path))
    before = nodes.config_settings(cfg)
    Path(cfg.data.train).write_text(Path(cfg.data.train).read_text().replace("red", "pink"))
    after = nodes.config_settings(cfg)
    assert {k for k in before if before[k] != after[k]} == {"data.train contents"}
