"""Bad values, bad data and a bad output directory through the real CLI (in this process): one clear line each, no
traceback."""

import contextlib
import json
import os
import shutil
import subprocess

import pytest
from cli_helpers import run_in_process, write_config


def _refused(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


def _error_line(proc) -> str:
    _refused(proc)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("packtrain train: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("value", ["0", "-1"])
def test_max_grad_norm_must_be_positive(tmp_path, value):
    # 0 froze lora_B at zero and -1 trained uphill, both with exit 0
    err = _refused(run_in_process("train", str(write_config(tmp_path)), "--set", f"optim.max_grad_norm={value}",
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
