"""Writes to output_dir that fail for the disk's sake end in one line naming the path (packtrain/rundir/disk.py):
the errors as each writer raises them, turned into that line or passed through; outputs that would overwrite an
input, or cannot be created, refused before any work."""

import errno
from pathlib import Path

import pytest

from packtrain.rundir.disk import (
    OutputDirError,
    check_not_an_input,
    check_output_path,
    check_writable,
    describe,
    left_untouched_if_refused,
    output_errors,
)


def test_a_full_disk_names_the_file_and_the_free_bytes(tmp_path):
    err = describe(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "adapter" / "x")), tmp_path)
    assert isinstance(err, OutputDirError)
    assert f"no space left on device writing {tmp_path / 'adapter' / 'x'}" in str(err)
    assert "bytes free" in str(err) and "no checkpoint was written yet" in str(err)


def test_a_full_disk_with_a_checkpoint_says_resume_continues(tmp_path):
    (tmp_path / "checkpoints" / "step-2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-2" / "state.json").write_text('{"step": 2}')
    err = describe(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path)
    assert "`packtrain train --resume` continues" in str(err)


def test_torchs_writer_without_an_errno_and_safetensors_text_are_recognised(tmp_path):
    torch_full = RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 128")
    err = describe(torch_full, tmp_path)  # free space is plenty here: a failed checkpoint write, named as such
    assert "a checkpoint write failed ([enforce fail at inline_container.cc:603]" in str(err)
    assert "no space left" in str(describe(RuntimeError("Error while serializing: StorageFull"), tmp_path))


def test_a_read_only_output_names_the_path_and_the_cause(tmp_path):
    err = describe(PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "metrics.jsonl")), tmp_path)
    assert str(err) == f"output_dir {tmp_path}: not writable: {tmp_path / 'metrics.jsonl'}: Permission denied"


def test_an_error_about_another_file_or_not_about_the_disk_passes_through(tmp_path):
    elsewhere = OSError(errno.ENOSPC, "No space left on device", "/data/train.jsonl")
    assert describe(elsewhere, tmp_path) is None  # never blamed on output_dir
    assert describe(ValueError("bad value"), tmp_path) is None
    with pytest.raises(KeyError), output_errors(tmp_path):
        raise KeyError("x")
    with pytest.raises(OutputDirError, match="no space left"), output_errors(tmp_path):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_an_output_dir_that_is_a_file_or_under_one_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputDirError, match=r"output_dir .*/f: is a file; choose a directory"):
        check_writable(tmp_path / "f")
    with pytest.raises(OutputDirError, match=r"is under .*/f, which is a file"):
        check_writable(tmp_path / "f" / "run")
    check_writable(tmp_path / "new" / "run")  # created, and the probe removed
    assert list((tmp_path / "new" / "run").iterdir()) == []


def test_an_output_path_of_the_wrong_kind_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    with pytest.raises(OutputDirError, match=r"--out .*/f/x.jsonl: cannot be created: .*/f is a file"):
        check_output_path(tmp_path / "f" / "x.jsonl", "--out", directory=False)
    with pytest.raises(OutputDirError, match="is a directory; give a file name"):
        check_output_path(tmp_path / "d", "--out", directory=False)
    with pytest.raises(OutputDirError, match="is a file, not a directory"):
        check_output_path(tmp_path / "f", "--merged", directory=True)
    check_output_path(tmp_path / "d" / "new.jsonl", "--out", directory=False)


def test_an_output_that_is_or_holds_an_input_is_refused(tmp_path):
    data = tmp_path / "data" / "eval.jsonl"
    data.parent.mkdir()
    data.write_text("{}\n")
    inputs = [("data.eval", data), ("model.path", None)]
    with pytest.raises(OutputDirError, match=r"--out .*eval.jsonl: is data.eval .*which this command reads"):
        check_not_an_input(data, "--out", inputs)
    with pytest.raises(OutputDirError, match="lies inside data.eval"):
        check_not_an_input(data / "x", "--out", inputs)
    with pytest.raises(OutputDirError, match="is where this command writes eval.jsonl"):
        check_not_an_input(tmp_path / "data", "--merged", inputs, writes=("eval.jsonl",))
    check_not_an_input(tmp_path / "out", "--out", inputs, writes=("eval.jsonl",))


def test_folders_a_refused_command_created_are_removed_and_full_ones_kept(tmp_path):
    out = tmp_path / "a" / "b" / "run"
    with pytest.raises(RuntimeError), left_untouched_if_refused(out):
        out.mkdir(parents=True)
        raise RuntimeError("refused")
    assert not (tmp_path / "a").exists()
    with pytest.raises(RuntimeError), left_untouched_if_refused(out):
        out.mkdir(parents=True)
        (tmp_path / "a" / "keep.txt").write_text("x")
        raise RuntimeError("refused")
    assert (tmp_path / "a" / "keep.txt").exists() and not (tmp_path / "a" / "b").exists()
    assert Path(tmp_path).exists()
