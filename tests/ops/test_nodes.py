"""check-nodes in one process: the report, the test hook, grouping and the refusal message (tables as literals)."""

import importlib.util
import json
import sys
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


def test_fla_s_default_folder_is_reported_without_importing_fla(monkeypatch):
    # the report read "unset" until something imported fla, and fla's own folder after: it depended on the order
    cache = pytest.importorskip("fla.ops.utils.cache")
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    monkeypatch.delenv("FLA_GPU_NAME", raising=False)
    version, folder = nodes._package("fla")
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)  # as in a process that has not imported it
    assert nodes.fla_cache_fields(version, folder)["FLA_CONFIG_DIR"] == str(cache.get_fla_config_dir())
    monkeypatch.setenv("FLA_GPU_NAME", "NVIDIA H200 (141 GB)")
    named = nodes.fla_cache_fields(version, folder)["FLA_CONFIG_DIR"]
    cache.get_gpu_info.cache_clear()
    try:
        assert named == str(cache.get_fla_config_dir()) and named.endswith("NVIDIA_H200_141_GB")
    finally:
        cache.get_gpu_info.cache_clear()


def _inputs_config(tmp_path):
    """A config whose every input is a file of its own: data, template, tokenizer, processor and model.path."""
    import shutil

    from cli_helpers import write_config, write_model_dir

    from packtrain.config import load_config
    from packtrain.data.images import BUNDLED_PROCESSOR

    model = write_model_dir(tmp_path / "model")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    shutil.copytree(model, tmp_path / "tok", ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    shutil.copytree(BUNDLED_PROCESSOR, tmp_path / "proc")
    (tmp_path / "template.jinja").write_text((tmp_path / "tok" / "chat_template.jinja").read_text())
    cfg = write_config(tmp_path, model={"config": None, "path": str(model)},
                       data={"tokenizer": str(tmp_path / "tok"), "processor": str(tmp_path / "proc"),
                             "chat_template": str(tmp_path / "template.jinja")})
    return load_config(cfg)


# each input a rank reads, and the setting its digest is: the same path holding other contents must differ
INPUTS = [("train.jsonl", "data.train contents"), ("eval.jsonl", "data.eval contents"),
          ("template.jinja", "data.chat_template contents"),
          ("tok/chat_template.jinja", "tokenizer chat_template.jinja contents"),
          ("tok/tokenizer.json", "tokenizer tokenizer.json contents"),
          ("tok/tokenizer_config.json", "tokenizer tokenizer_config.json contents"),
          ("proc/preprocessor_config.json", "processor preprocessor_config.json contents"),
          ("model/config.json", "model.path config.json contents"),
          ("model/model.safetensors.index.json", "model.path model.safetensors.index.json contents")]


@pytest.mark.parametrize("name, setting", INPUTS, ids=[n for n, _ in INPUTS])
def test_every_input_file_is_in_the_digest(tmp_path, name, setting):
    cfg = _inputs_config(tmp_path)
    before = nodes.config_settings(cfg)
    path = tmp_path / name
    path.write_bytes(path.read_bytes() + b"\n")
    after = nodes.config_settings(cfg)
    assert {k for k in before if before[k] != after[k]} == {setting}


def test_the_chat_template_is_in_the_digest(tmp_path):
    # "chat_template" dropped from the files compared: two machines with other templates trained together
    from cli_helpers import write_config

    from packtrain.config import load_config

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    cfg = load_config(write_config(tmp_path, data={"chat_template": str(template)}))
    before = nodes.config_settings(cfg)
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}")
    after = nodes.config_settings(cfg)
    assert before["data.chat_template contents"] != after["data.chat_template contents"]


def test_the_bundled_tokenizer_and_the_versions_are_in_the_digest(tmp_path):
    from cli_helpers import write_config

    from packtrain.config import load_config
    from packtrain.data.jsonl import BUNDLED_TOKENIZER

    settings = nodes.config_settings(load_config(write_config(tmp_path)))
    import hashlib

    template = (BUNDLED_TOKENIZER / "chat_template.jinja").read_bytes()
    assert settings["tokenizer chat_template.jinja contents"] == hashlib.sha256(template).hexdigest()[:12]
    assert settings["version transformers"] == transformers.__version__
    assert settings["version torch"] == torch.__version__ and settings["version python"] == sys.version.split()[0]
    assert settings["version packtrain source"] == nodes.node_report(0, torch.device("cpu")).fields["packtrain source"]


def _gathered(monkeypatch, *settings):
    """check_same_config's all-gather, as if rank r reported ``settings[r]`` (from machine r)."""
    reports = [NodeReport(r, {}, machine=r, settings=s) for r, s in enumerate(settings)]
    monkeypatch.setattr(nodes, "gather_objects", lambda mine, info: reports)
    return SimpleNamespace(rank=0, world_size=len(settings), enabled=True, is_main=True)


def test_machines_whose_tokenizer_template_differs_are_refused(tmp_path, monkeypatch):
    # the same config and data, tok/chat_template.jinja edited on machine 1: both trained and exited 0 (or, when
    # their plans differed, waited until ops.collective_timeout for a gloo traceback)
    cfg = _inputs_config(tmp_path)
    mine = nodes.config_settings(cfg)
    template = tmp_path / "tok" / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|im_start|>", "<|im_start|> "))
    info = _gathered(monkeypatch, mine, nodes.config_settings(cfg))
    with pytest.raises(nodes.ConfigMismatchError) as e:
        nodes.check_same_config(cfg, info)
    text = str(e.value)
    assert list(e.value.keys) == ["tokenizer chat_template.jinja contents"] and "\n" not in text
    assert "tokenizer chat_template.jinja contents: " in text and "on rank 1 (machine 1)" in text
    assert text.endswith("give every machine the same files (data, tokenizer, chat template, processor, model "
                         "config)"), text


def test_machines_with_other_versions_are_refused_naming_them(tmp_path, monkeypatch):
    from cli_helpers import write_config

    from packtrain.config import load_config

    cfg = load_config(write_config(tmp_path))
    mine = nodes.config_settings(cfg)
    info = _gathered(monkeypatch, mine, {**mine, "version transformers": "5.17.0"})
    with pytest.raises(nodes.ConfigMismatchError, match=f"version transformers: {transformers.__version__} on rank 0 "
                       r"\(machine 0\), 5.17.0 on rank 1 \(machine 1\); give every machine the same installs"):
        nodes.check_same_config(cfg, info)


def test_accelerate_s_environment_on_one_machine_is_named_as_such(tmp_path, monkeypatch):
    # ACCELERATE_MIXED_PRECISION=bf16 on machine 0 only: the refusal named model.dtype alone and said "give every
    # machine the same config file", which every machine had
    from cli_helpers import write_config

    from packtrain.config import load_config
    from packtrain.distributed import apply_launcher_settings

    path = write_config(tmp_path, model={"dtype": "float32"})
    with_env = load_config(path)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    apply_launcher_settings(with_env, log=lambda *a: None)
    theirs = nodes.config_settings(with_env)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    plain = load_config(path)
    info = _gathered(monkeypatch, theirs, nodes.config_settings(plain))
    with pytest.raises(nodes.ConfigMismatchError) as e:
        nodes.check_same_config(plain, info)
    text = str(e.value)
    assert text.startswith("ranks were started with different configs, refusing to start (2 keys): environment "
                           "ACCELERATE_MIXED_PRECISION: bf16 on rank 0 (machine 0), (unset) on rank 1 (machine 1); "
                           'model.dtype: "bfloat16" on rank 0 (machine 0), "float32" on rank 1 (machine 1); '), text
    assert "the launcher's environment differs between machines" in text
    assert "give every machine the same accelerate config file" in text


def test_ranks_whose_plans_differ_are_refused(monkeypatch):
    reports = [("aaaa", 0), ("aaaa", 0), ("bbbb", 1)]
    monkeypatch.setattr(nodes, "gather_objects", lambda mine, info: reports)
    nodes.check_same_plan("aaaa", SimpleNamespace(enabled=False))  # one rank: nothing to compare
    with pytest.raises(nodes.ConfigMismatchError, match=r"ranks planned different packs of data.train, refusing to "
                       r"start: plan fingerprint: aaaa on ranks 0-1 \(machine 0\), bbbb on rank 2 \(machine 1\)"):
        nodes.check_same_plan("aaaa", SimpleNamespace(enabled=True))
