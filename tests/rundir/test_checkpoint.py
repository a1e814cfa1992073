"""Checkpoints that can be trusted, through the real CLI (in this process): retention, digests (a changed byte in
any file is found, though torch.load would read it), fallback past damaged checkpoints to the uninterrupted run's
adapter, no code run from a crafted pickle, leftovers and a cut-off metrics line."""

import json
import os
import pickle
import shutil
import struct
import zipfile

import pytest
import torch
from cli_helpers import adapter_of, run_in_process
from safetensors.torch import load_file

from packtrain.rundir.checkpoint import CheckpointDamaged, checkpoints, file_digest, verify_checkpoint, write_state

# 6 steps with a checkpoint after every step (dropout and a cosine schedule: RNG and scheduler state matter on
# resume); keep_checkpoints left at its default, 3
FINISHED = {"train": {"epochs": 1, "packs_per_step": 1, "save_every": 1}, "lora": {"dropout": 0.1},
            "optim": {"schedule": "cosine", "warmup_steps": 2}}
LR = 1.0e-3  # write_config's optim.lr: the scheduler's base_lrs


@pytest.fixture
def finished(trained):
    """The finished run (trained once per session): (config, output_dir). Read it; `_copy` it to change it."""
    run = trained(**FINISHED)
    return run.config, run.run


def _copy(finished, tmp_path):
    cfg, run = finished
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    return cfg, copy


def _flip_bit(path, offset):
    """One bit of ``path`` flipped: the same length, another digest."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _member_payload(path, member):
    """Where the stored bytes of zip member ``member`` (torch.save's records, uncompressed) start, and their size."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(member))
    header = path.read_bytes()[info.header_offset: info.header_offset + 30]
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def _flip_in_record(path, member):
    """A bit in the middle of one tensor's bytes: torch.load reads the file as before (it checks no CRC), with one
    value changed."""
    start, size = _member_payload(path, member)
    _flip_bit(path, start + size // 2)
    torch.load(path, weights_only=True)


def _flip_base_lr(path):
    """The lowest bit of the scheduler's base learning rate (a pickled big-endian double): the file loads, and the
    resumed schedule would be one ulp off."""
    at = path.read_bytes().index(struct.pack(">d", LR))
    _flip_bit(path, at + 7)
    assert torch.load(path, weights_only=True)["base_lrs"] != [LR]


def test_only_the_newest_three_checkpoints_are_kept(finished):
    _, run = finished
    assert [p.name for p in checkpoints(run)] == ["step-5", "step-4", "step-3"]
    assert not any(p.name.startswith((".tmp-", ".old-")) for p in (run / "checkpoints").iterdir())


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_damaged_checkpoints_fall_back_to_the_newest_valid_one_and_no_pickle_runs(finished, tmp_path):
    cfg, run = _copy(finished, tmp_path)
    marker = tmp_path / "pwned"
    sched = run / "checkpoints/step-5/scheduler.pt"
    sched.write_bytes(pickle.dumps({"last_epoch": _RunsCode(marker)}))
    state_file = run / "checkpoints/step-5/state.json"
    state = json.loads(state_file.read_text())
    state["files"]["scheduler.pt"] = file_digest(sched)  # whoever can write the file can write its digests too
    write_state(state_file.parent, state)
    weights = run / "checkpoints/step-4/trainable.safetensors"
    data = bytearray(weights.read_bytes())
    data[-9] ^= 0x01  # one bit of one tensor value: same length, another digest
    weights.write_bytes(bytes(data))
    for leftover in ("checkpoints/.tmp-step-6", "checkpoints/.old-step-2-77", ".tmp-adapter-5"):
        (run / leftover).mkdir()
        (run / leftover / "x").write_text("half-written")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "epoch": 0, "lo')  # a kill mid-line
    (run / "adapter").rename(run / "adapter-straight")

    proc = run_in_process("train", cfg, "--resume", "--set", f"output_dir={run}", "--set", "train.save_every=2")
    out = proc.stdout
    assert not marker.exists(), "torch.load ran the pickle's code"
    assert "step-5 is damaged" in out and "scheduler.pt: unreadable (a pickle that holds more than tensors" in out, out
    assert "weights_only" not in out and "will likely succeed" not in out  # torch's advice, without its warning
    assert "step-4 is damaged" in out and "trainable.safetensors: contents differ from the digest" in out
    assert "falling back to step-3" in out and "continuing from" in out and "step-3 (step 3" in out
    assert "changed since the checkpoint (allowed)" in out and "train.save_every: 1 -> 2" in out
    assert "metrics.jsonl: line" in out and "is damaged" in out
    for name in ("damaged-step-5", "damaged-step-4"):
        assert (run / "checkpoints" / name).is_dir()
    assert not any(p.name.startswith((".tmp-", ".old-")) for d in (run, run / "checkpoints") for p in d.iterdir())
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]  # every line parses
    assert [x["step"] for x in lines if x.get("split") != "eval"] == [1, 2, 3, 4, 5, 6]
    straight, resumed = load_file(str(run / "adapter-straight" / "adapter_model.safetensors")), adapter_of(run)
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name  # bitwise: step 3's state was restored whole


def test_a_changed_byte_in_the_scheduler_or_rng_state_falls_back_to_the_uninterrupted_adapter(finished, tmp_path):
    """Same-length damage that torch.load reads without complaint: only the digests can tell. step-5's scheduler
    starts from another learning rate, step-4's RNG would draw other dropout masks; the resume passes both and
    continues from step-3, bit for bit the uninterrupted run."""
    cfg, run = _copy(finished, tmp_path)
    _flip_base_lr(run / "checkpoints/step-5/scheduler.pt")
    _flip_in_record(run / "checkpoints/step-4/rng-rank-0.pt", "data/0")
    (run / "adapter").rename(run / "adapter-straight")
    out = run_in_process("train", cfg, "--resume", "--set", f"output_dir={run}").stdout
    assert "step-5 is damaged" in out and "scheduler.pt: contents differ from the digest" in out, out
    assert "step-4 is damaged" in out and "rng-rank-0.pt: contents differ from the digest" in out, out
    assert "falling back to step-3" in out and "step-3 (step 3" in out, out
    straight, resumed = load_file(str(run / "adapter-straight" / "adapter_model.safetensors")), adapter_of(run)
    assert straight.keys() == resumed.keys() and straight
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def test_what_verify_reports(finished, tmp_path):
    _, run = _copy(finished, tmp_path)
    ckpt = run / "checkpoints/step-3"
    assert verify_checkpoint(ckpt)["step"] == 3
    # one changed bit, the length kept, in each kind of file a resume reads with torch.load
    for name, damage in (("optimizer.pt", lambda p: _flip_in_record(p, "data/10")), ("scheduler.pt", _flip_base_lr),
                         ("rng-rank-0.pt", lambda p: _flip_in_record(p, "data/0"))):
        kept = run / "checkpoints/step-5" / name
        original = kept.read_bytes()
        damage(kept)
        assert kept.stat().st_size == len(original) and kept.read_bytes() != original
        with pytest.raises(CheckpointDamaged, match=f"{name}: contents differ from the digest"):
            verify_checkpoint(kept.parent)
        kept.write_bytes(original)
    assert verify_checkpoint(run / "checkpoints/step-5")["step"] == 5
    optim = run / "checkpoints/step-4/optimizer.pt"
    optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])  # cut off, as by a full disk
    with pytest.raises(CheckpointDamaged, match="optimizer.pt: contents differ from the digest"):
        verify_checkpoint(optim.parent)
    (ckpt / "rng-rank-0.pt").unlink()
    with pytest.raises(CheckpointDamaged, match="rng-rank-0.pt: missing"):
        verify_checkpoint(ckpt)
    (ckpt / "state.json").write_text("")
    with pytest.raises(CheckpointDamaged, match="state.json: unreadable"):
        verify_checkpoint(ckpt)
    (ckpt / "state.json").unlink()
    with pytest.raises(CheckpointDamaged, match="state.json: missing"):
        verify_checkpoint(ckpt)


def test_every_checkpoint_damaged_refuses_and_moves_nothing(finished, tmp_path):
    cfg, run = _copy(finished, tmp_path)
    for ckpt in checkpoints(run):
        (ckpt / "state.json").write_text("{")
    proc = run_in_process("train", cfg, "--resume", "--set", f"output_dir={run}", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "every checkpoint is damaged" in proc.stderr and proc.stderr.count("state.json: unreadable") == 3
    assert [p.name for p in checkpoints(run)] == ["step-5", "step-4", "step-3"]



def test_an_adapter_config_is_the_same_bytes_whatever_order_peft_wrote_target_modules_in(tmp_path):
    """peft writes target_modules from a set, in the order of the interpreter's string hashing: two runs of the demo
    (8c6d197) wrote adapter_config.json files that differ only there. peft's own file written with the modules in two
    orders (what two interpreters write), then sorted: the same bytes."""
    from peft import LoraConfig

    from packtrain.rundir.checkpoint import _sorted_target_modules

    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "in_proj_qkv", "in_proj_z", "out_proj"]
    LoraConfig(r=4, target_modules=modules).save_pretrained(tmp_path / "peft")
    written = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    files = []
    for order in (modules, modules[::-1]):
        path = tmp_path / f"{len(files)}.json"
        path.write_text(json.dumps({**written, "target_modules": order}, indent=2, sort_keys=True))
        files.append(path)
    assert files[0].read_bytes() != files[1].read_bytes()  # the order alone changes peft's bytes
    for path in files:
        _sorted_target_modules(path)
    assert files[0].read_bytes() == files[1].read_bytes()
    config = json.loads(files[0].read_text())
    assert config["target_modules"] == sorted(modules) and config["r"] == 4


def test_a_runs_adapter_config_lists_its_target_modules_sorted(finished):
    _, run = finished
    for config in [run / "adapter" / "adapter_config.json", *run.glob("checkpoints/step-*/adapter/adapter_config.json")]:
        modules = json.loads(config.read_text())["target_modules"]
        assert len(modules) > 1 and modules == sorted(modules), (config, modules)
