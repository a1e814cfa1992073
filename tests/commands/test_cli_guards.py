"""Bad values, bad data and a bad output directory through the real CLI (in this process): one clear line each, no
traceback."""

import contextlib
import json
import os
import shutil
import subprocess

import pytest
from cli_helpers import refused, run_in_process, write_config


def _error_line(proc) -> str:
    refused(proc)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("packtrain train: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("value", ["0", "-1"])
def test_max_grad_norm_must_be_positive(tmp_path, value):
    # 0 froze lora_B at zero and -1 trained uphill, both with exit 0
    err = refused(run_in_process("train", str(write_config(tmp_path)), "--set", f"optim.max_grad_norm={value}",
                           check=False))
    assert f"optim.max_grad_norm: must be positive (or null: no clipping), got {value}" in err


def _pretokenized(path, bad_line=None, bad_id=None):
    lines = []
    for i in range(4):
        rec = {"id": f"p{i}", "prefix_ids": [5, 6, 7, 8], "item_ids": [9, 10 + i], "target_ids": [11, 12, 13]}
        if i + 1 == bad_line:
            rec["target_ids"] = [11, bad_id, 13]
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_pretokenized_id_outside_the_models_vocabulary_is_refused_at_load(tmp_path):
    """No data.tokenizer: the bound is the model config's vocab_size (1024); this crashed mid-run with an
    IndexError naming no file or line."""
    data = _pretokenized(tmp_path / "ids.jsonl", bad_line=3, bad_id=1024)
    cfg = write_config(tmp_path, data={"train": str(data), "eval": None})
    line = _error_line(run_in_process("train", str(cfg), check=False))
    assert f"{data}:3: field 'target_ids': token id 1024 is not below the vocabulary size 1024" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_over_long_line_is_refused_on_its_length(tmp_path):
    """A line no pack could hold fails on its byte length before it is parsed or tokenized (a 100 MB line took
    333 s and 13 GB to reach its error). Budget 208 tokens: the limit is 32 x 208 = 6,656 bytes."""
    cfg = write_config(tmp_path, data={"eval": None}, packing={"on_overflow": "skip"})
    data = tmp_path / "train.jsonl"
    lines = data.read_text().splitlines()
    lines.insert(2, json.dumps({"system": "Rulebook A.", "item": "word " * 1_000_000, "target": "alpha"}))
    data.write_text("\n".join(lines) + "\n")
    line = _error_line(run_in_process("train", str(cfg), check=False))
    assert f"{data}:3: line longer than 6,656 bytes" in line


@contextlib.contextmanager
def _tmpfs(where, size: str, read_only: bool = False):
    """A small filesystem of its own (root only: elsewhere the test is skipped)."""
    where.mkdir()
    opts = f"size={size}" + (",ro" if read_only else "")
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                                                       capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.mark.parametrize("size, when", [("8k", "at start"), ("880k", "at the first checkpoint")])
def test_full_output_dir_says_no_space_left_with_the_path(tmp_path, size, when):
    """880k holds the random base model (786 kB) but not the step-2 checkpoint: torch.save's "enforce fail at
    inline_container.cc" or an OSError became a traceback that never said the disk was full."""
    with _tmpfs(tmp_path / "disk", size) as disk:
        cfg = write_config(tmp_path, train={"max_steps": 3, "save_every": 2}, output_dir=str(disk / "run"))
        line = _error_line(run_in_process("train", str(cfg), check=False))
    assert f"output_dir {disk / 'run'}: no space left on device" in line, (when, line)
    # no checkpoint yet in either case (the first is step 2's, and it did not fit): nothing a --resume could continue
    assert "--resume" not in line and "no checkpoint was written yet: free space and run again" in line, line


def test_read_only_output_dir_says_not_writable(tmp_path):
    with _tmpfs(tmp_path / "ro", "64k", read_only=True) as ro:
        cfg = write_config(tmp_path, output_dir=str(ro / "run"))
        line = _error_line(run_in_process("train", str(cfg), check=False))
    assert f"output_dir {ro / 'run'}: not writable" in line and "Read-only file system" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through file permissions")
def test_output_dir_without_permission_says_not_writable(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        line = _error_line(run_in_process("train", str(write_config(tmp_path, output_dir=str(locked / "run"))),
                                   check=False))
    finally:
        locked.chmod(0o700)
    assert f"output_dir {locked / 'run'}: not writable" in line and "Permission denied" in line


# -- issue 28's probes: each gave a traceback, or blamed the wrong thing ------------------------------------------
def _one_line(proc, command="train") -> str:
    refused(proc)
    lines = [x for x in proc.stderr.splitlines() if x.startswith(f"packtrain {command}: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("field", ["target", "system", "item"])
@pytest.mark.parametrize("command", ["plan", "train"])
def test_a_lone_surrogate_in_the_data_names_file_line_and_field(tmp_path, command, field):
    """JSON's "\\ud800" parses to a string no tokenizer can encode: a TypeError traceback in plan and train."""
    cfg = write_config(tmp_path, data={"eval": None})
    data = tmp_path / "train.jsonl"
    lines = data.read_text().splitlines()
    record = json.loads(lines[3])
    record[field] = record[field][:5] + "\ud800" + record[field][5:]
    lines[3] = json.dumps(record)  # ensure_ascii: the escape \ud800, as a JSON writer leaves it
    data.write_text("\n".join(lines) + "\n")
    line = (_one_line(run_in_process(command, str(cfg), check=False), command))
    assert f"{data}:4: field '{field}': holds a lone UTF-16 surrogate" in line, line


def test_a_lone_surrogate_in_a_chat_message_names_its_path(tmp_path):
    data = tmp_path / "chat.jsonl"
    ok = {"messages": [{"role": "system", "content": "Rules."}, {"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "hello"}]}
    bad = json.loads(json.dumps(ok))
    bad["messages"][1]["content"] = "h\udfffi"
    data.write_text(json.dumps(ok) + "\n" + json.dumps(bad) + "\n")
    cfg = write_config(tmp_path, data={"train": str(data), "eval": None})
    line = _one_line(run_in_process("plan", str(cfg), check=False), "plan")
    assert f"{data}:2: field 'messages[1].content': holds a lone UTF-16 surrogate" in line, line


def test_a_key_given_twice_in_the_config_is_refused_naming_both_lines(tmp_path):
    """PyYAML keeps the last of two `train:` blocks silently: save_every: 2 disappeared."""
    cfg = write_config(tmp_path)
    text = cfg.read_text()
    n = len(text.splitlines())
    cfg.write_text(text + "train:\n  save_every: 2\n")
    err = refused(run_in_process("train", str(cfg), check=False))
    first = next(i for i, x in enumerate(text.splitlines(), 1) if x == "train:")
    assert f"invalid config in {cfg}" in err
    assert f"line {n + 1}, column 1: duplicate key 'train' (first on line {first})" in err, err
    cfg.write_text(text.replace("  epochs: 1\n", "  epochs: 1\n  epochs: 2\n"))  # inside one block, too
    err = refused(run_in_process("plan", str(cfg), check=False))
    assert "duplicate key 'epochs'" in err, err


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_output_dir_that_is_a_file_or_under_one_is_one_line(tmp_path, where):
    blocker = tmp_path / "taken"
    blocker.write_text("not a directory\n")
    out = blocker if where == "a file" else blocker / "deeper" / "run"
    cfg = write_config(tmp_path, output_dir=str(out))
    line = _error_line(run_in_process("train", str(cfg), check=False))
    expected = "is a file" if where == "a file" else f"is under {blocker}, which is a file"
    assert f"output_dir {out}: {expected}" in line, line
    assert blocker.read_text() == "not a directory\n"


def test_an_unreadable_data_file_is_the_datas_error_not_output_dirs(tmp_path, monkeypatch):
    """It said "output_dir ...: not writable: <the data file>: Permission denied". Root reads through file modes,
    so there the open itself is made to fail as it does for another user."""
    cfg = write_config(tmp_path, data={"eval": None})
    data = tmp_path / "train.jsonl"
    if os.geteuid() == 0:
        import pathlib

        real_open = pathlib.Path.open

        def refusing_open(self, *args, **kwargs):
            if self == data:
                raise PermissionError(13, "Permission denied", str(self))
            return real_open(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "open", refusing_open)
    else:
        data.chmod(0)
    try:
        line = _error_line(run_in_process("train", str(cfg), check=False))
    finally:
        data.chmod(0o644)
    assert f"{data}: cannot be read: Permission denied" in line and "output_dir" not in line, line


def test_export_and_eval_of_a_truncated_adapter_name_the_file(trained, tmp_path):
    """A cut-off adapter_model.safetensors gave safetensors' SafetensorError traceback."""
    run = tmp_path / "run"
    shutil.copytree(trained().run, run)
    weights = run / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    line = _one_line(run_in_process("export", run, "--merged", tmp_path / "merged", check=False), "export")
    assert f"--adapter: {weights}: unreadable" in line, line
    assert not (tmp_path / "merged").exists()
    line = _one_line(run_in_process("eval", trained().config, "--adapter", run / "adapter", "--out",
                                    tmp_path / "eval.jsonl", check=False), "eval")
    assert f"--adapter: {weights}: unreadable" in line, line
    (run / "adapter" / "adapter_config.json").write_text("{")
    line = _one_line(run_in_process("export", run, "--merged", tmp_path / "merged", check=False), "export")
    assert f"{run / 'adapter' / 'adapter_config.json'}: unreadable" in line, line


def test_outputs_of_eval_export_and_bench_under_a_file_fail_before_the_work(trained, tmp_path):
    """`eval --out`, `export --merged` and `bench --out` under a file: tracebacks once the work was done."""
    finished = trained()
    blocker = tmp_path / "taken"
    blocker.write_text("x")
    for command, args in (("eval", (finished.config, "--adapter", finished.run / "adapter", "--out")),
                          ("export", (finished.run, "--merged")),
                          ("bench", ("--preset", "tiny", "--out"))):
        proc = run_in_process(command, *args, blocker / "out", check=False)
        line = _one_line(proc, command)
        assert f"{blocker / 'out'}: cannot be created: {blocker} is a file" in line, line
        assert "repeat" not in proc.stdout and "memory" not in proc.stdout  # refused before any work
    line = _one_line(run_in_process("eval", finished.config, "--adapter", finished.run / "adapter", "--out",
                                    tmp_path, check=False), "eval")
    assert f"--out {tmp_path}: is a directory; give a file name" in line, line


def test_a_data_directory_and_a_damaged_tokenizer_are_named(tmp_path):
    cfg = write_config(tmp_path, data={"eval": None})
    (tmp_path / "folder").mkdir()
    line = _one_line(run_in_process("plan", cfg, "--set", f"data.train={tmp_path / 'folder'}", check=False), "plan")
    assert f"{tmp_path / 'folder'}: is a directory, not a JSONL file" in line, line
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{")
    line = _one_line(run_in_process("plan", cfg, "--set", f"data.tokenizer={tok}", check=False), "plan")
    assert f"tokenizer {tok}: cannot be loaded" in line, line


def test_a_key_given_twice_in_a_data_line_is_refused(tmp_path):
    """JSON, like YAML, keeps the last of two equal keys: a second "target" replaced the first silently."""
    cfg = write_config(tmp_path, data={"eval": None})
    data = tmp_path / "train.jsonl"
    lines = data.read_text().splitlines()
    lines[1] = lines[1][:-1] + ', "target": "another target"}'
    data.write_text("\n".join(lines) + "\n")
    line = _one_line(run_in_process("plan", cfg, check=False), "plan")
    assert f"{data}:2: field 'target': given twice in one object" in line, line


def test_a_truncated_base_checkpoint_or_config_is_named_by_train_and_eval(tmp_path):
    """A cut-off shard of model.path gave safetensors' SafetensorError traceback, a damaged config.json a bare JSON
    message naming no file."""
    from checkpoints import save_checkpoint, text_config

    from packtrain.data.jsonl import BUNDLED_TOKENIZER

    base = tmp_path / "base"
    save_checkpoint(base, text_config())
    shard = sorted(base.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    cfg = write_config(tmp_path, model={"config": None, "path": str(base)}, data={"tokenizer": str(BUNDLED_TOKENIZER)})
    line = _one_line(run_in_process("train", cfg, check=False))
    assert f"model.path: {shard}: unreadable" in line, line
    line = _one_line(run_in_process("eval", cfg, "--adapter", "none", "--out", tmp_path / "e.jsonl", check=False),
                     "eval")
    assert f"model.path: {shard}: unreadable" in line, line
    (base / "config.json").write_text("{")
    line = _one_line(run_in_process("train", cfg, check=False))
    assert f"model.path: {base / 'config.json'}: unreadable" in line, line


def test_outputs_that_are_or_lie_inside_an_input_are_refused_before_the_work(trained, tmp_path):
    """`eval --out` equal to data.eval replaced the eval data with loss lines (exit 0); `--generate --out
    ADAPTER/adapter_config.json` left an adapter that no longer loads."""
    finished = trained()
    run = tmp_path / "run"
    shutil.copytree(finished.run, run)
    cfg = write_config(tmp_path)
    eval_data, adapter_config = tmp_path / "eval.jsonl", run / "adapter" / "adapter_config.json"
    before = {p: p.read_bytes() for p in (eval_data, adapter_config, tmp_path / "train.jsonl")}
    line = _one_line(run_in_process("eval", cfg, "--adapter", run / "adapter", "--out", eval_data, check=False), "eval")
    assert line == (f"packtrain eval: error: --out {eval_data}: is data.eval {eval_data}, which this command reads; "
                    "writing there would overwrite it: choose another path")
    line = _one_line(run_in_process("eval", cfg, "--adapter", run / "adapter", "--generate", "--out", adapter_config,
                                    check=False), "eval")
    assert f"--out {adapter_config}: lies inside --adapter {run / 'adapter'}, which this command reads" in line, line
    line = _one_line(run_in_process("export", run, "--merged", run / "adapter" / "merged", check=False), "export")
    assert f"--merged {run / 'adapter' / 'merged'}: lies inside --adapter {run / 'adapter'}" in line, line
    line = _one_line(run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'train.jsonl'}", check=False),
                     "train")
    assert f"output_dir {tmp_path / 'train.jsonl'}: is data.train" in line, line
    inside = tmp_path / "bench"
    inside.mkdir()
    shutil.copy(tmp_path / "train.jsonl", inside / "bench.json")
    proc = run_in_process("bench", cfg, "--set", f"data.train={inside / 'bench.json'}", "--out", inside, check=False)
    assert f"data.train {inside / 'bench.json'} is where this command writes bench.json" in _one_line(proc, "bench")
    assert "repeat" not in proc.stdout
    assert all(p.read_bytes() == b for p, b in before.items()) and not (run / "adapter" / "merged").exists()


@pytest.mark.parametrize("env, key", [
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, "model.dtype: float64 conflicts with accelerate's mixed_precision: bf16"),
    ({"ACCELERATE_MIXED_PRECISION": "fp16"}, "model.dtype: accelerate's mixed_precision: fp16"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"},
     "train: accelerate's fsdp_sharding_strategy SHARD_GRAD_OP"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": "true"}, "train.offload: accelerate's fsdp_offload_params"),
])
def test_an_accelerate_setting_packtrain_cannot_honour_is_refused_naming_the_key(tmp_path, env, key):
    # before: an accelerate config with mixed_precision or FSDP settings trained as if they were absent, exit 0
    proc = run_in_process("train", write_config(tmp_path), env=env, check=False)
    line = _one_line(proc, "train")
    assert line.startswith(f"packtrain train: error: {key}"), line
    assert not (tmp_path / "run").exists()


def test_accelerates_activation_checkpointing_and_bf16_become_packtrains_keys(tmp_path):
    cfg = write_config(tmp_path, train={"max_steps": 1}, data={"eval": None})
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_SHARDING_STRATEGY": "1",
           "ACCELERATE_MIXED_PRECISION": "bf16"}
    proc = run_in_process("train", cfg, "--set", "model.dtype=float32", env=env)
    assert "train.activation_checkpointing: true, from accelerate's fsdp_activation_checkpointing" in proc.stdout
    assert "model.dtype: bfloat16, from accelerate's mixed_precision: bf16" in proc.stdout
    import yaml

    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert written["train"]["activation_checkpointing"] is True and written["model"]["dtype"] == "bfloat16"


def test_version_prints_packtrains_version_and_exits_0():
    """`packtrain --version` was refused as an unknown flag (exit 2): it prints the package's version."""
    import packtrain

    proc = run_in_process("--version")
    assert proc.stdout == f"packtrain {packtrain.__version__}\n" and proc.stderr == ""
    from importlib.metadata import PackageNotFoundError, version

    try:
        assert version("packtrain") == packtrain.__version__  # the installed metadata says the same
    except PackageNotFoundError:
        pass
