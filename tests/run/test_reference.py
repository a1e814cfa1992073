"""dpo's precomputed reference (packtrain.run.reference): the digests see a change of the data, the base and the
tokenizer, and a cache computed from others is refused, naming what changed."""

import json
import shutil
from pathlib import Path

import pytest

from packtrain.config import config_from_dict
from packtrain.data.jsonl import BUNDLED_TOKENIZER, load_examples
from packtrain.run import reference

SYSTEM = "You are terse."


def _data(tmp_path, answer="toma"):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"id": "a", "system": SYSTEM, "item": "x", "chosen": answer, "rejected": "kelu"}) + "\n")
    return load_examples(path)


def test_the_digests_see_each_change(tmp_path):
    cfg = config_from_dict({"model": {"config": {"model_type": "qwen3_5_text", "hidden_size": 8}}})
    base = reference.digests(cfg, _data(tmp_path))
    assert reference.digests(cfg, _data(tmp_path)) == base  # the same inputs, the same digests
    assert reference.digests(cfg, _data(tmp_path, "tomas"))["data"] != base["data"]
    reseeded = config_from_dict({"model": {"config": {"model_type": "qwen3_5_text", "hidden_size": 8}, "seed": 1}})
    assert reference.digests(reseeded, _data(tmp_path))["base"] != base["base"]
    bf16 = config_from_dict({"model": {"config": {"model_type": "qwen3_5_text", "hidden_size": 8}, "dtype": "bfloat16"}})
    assert reference.digests(bf16, _data(tmp_path))["base"] != base["base"]  # another dtype: other log-probabilities
    tok = tmp_path / "tok"
    shutil.copytree(BUNDLED_TOKENIZER, tok)
    other = config_from_dict({"model": {"config": {"model_type": "qwen3_5_text", "hidden_size": 8}},
                              "data": {"tokenizer": str(tok)}})
    assert reference.digests(other, _data(tmp_path))["tokenizer"] == base["tokenizer"]  # a copy is the same
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages }}"
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    assert reference.digests(other, _data(tmp_path))["tokenizer"] != base["tokenizer"]


def test_the_data_digest_sees_an_image_repainted_at_the_same_size(tmp_path):
    """An image's path and grid were the digest's: a VLM dpo run resumed after an image was repainted in place (the
    same size, so the same grid) reused a reference of the old picture."""
    from types import SimpleNamespace

    from packtrain.data.images import ImageRef

    image = tmp_path / "a.png"
    image.write_bytes(bytes(range(256)) * 4)
    ex = SimpleNamespace(id="a:chosen", prefix_ids=(1,), item_ids=(2,), target_ids=(3,), spans=(),
                         images=(ImageRef(str(image), (1, 2, 2)),))
    before = reference.data_digest([ex])
    assert reference.data_digest([ex]) == before
    image.write_bytes(bytes(range(256)) * 3 + bytes(255 - i for i in range(256)))  # same size, other pixels
    assert reference.data_digest([ex]) != before
    image.unlink()
    assert reference.data_digest([ex]) != before


def test_a_checkpoints_weights_are_in_the_base_digest(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(bytes(300_000))
    cfg = config_from_dict({"model": {"path": str(model)}})
    before = reference.base_digest(cfg)
    shutil.copytree(model, tmp_path / "copy")
    assert reference.base_digest(config_from_dict({"model": {"path": str(tmp_path / "copy")}})) == before
    raw = bytearray(300_000)
    raw[150_000] = 1  # one byte in the middle of the file
    (model / "model.safetensors").write_bytes(bytes(raw))
    assert reference.base_digest(cfg) != before


def test_the_cache_round_trips_and_refuses_other_inputs(tmp_path):
    digests = {"data": "d1", "base": "b1", "tokenizer": "t1"}
    table = {"a:chosen": -1.0 / 3.0, "a:rejected": -12.345678901234567}
    assert reference.read(tmp_path, digests) is None
    reference.write(tmp_path, digests, table)
    assert reference.read(tmp_path, digests) == table  # bit for bit
    for name, words in [("data", "training data"), ("base", "base model"), ("tokenizer", "tokenizer")]:
        with pytest.raises(ValueError, match=f"another {words}.*remove reference.json"):
            reference.read(tmp_path, {**digests, name: "changed"})
    Path(tmp_path / reference.FILE).write_text("{not json")
    with pytest.raises(ValueError, match="unreadable reference cache"):
        reference.read(tmp_path, digests)


def test_a_run_computes_the_reference_once_and_refuses_it_for_another_base(tmp_path):
    """dpo precompute in-process, the base a checkpoint directory (model.path): a run's setup writes
    OUTPUT/reference.json with the base's log-probabilities (an entry checked against the model alone with its
    adapter off), a resumed run reads it, and one whose base changed under the same model.path is refused naming
    it."""
    import torch
    from cli_helpers import write_config, write_pair_data
    from safetensors.torch import load_file, save_file

    from packtrain.config import load_config
    from packtrain.models.build import build_base_model
    from packtrain.run.objective import adapters_disabled
    from packtrain.run.trainer import Trainer

    pairs = write_pair_data(tmp_path / "pairs.jsonl")
    seeded = load_config(write_config(tmp_path, "seeded.yaml"))
    build_base_model(seeded, save_to=tmp_path / "base")
    path = write_config(tmp_path, data={"train": str(pairs), "eval": None, "tokenizer": str(BUNDLED_TOKENIZER)},
                        model={"path": str(tmp_path / "base"), "config": None, "dtype": "float64", "kernels": "torch"},
                        train={"objective": "dpo", "max_steps": 1})
    logs = []
    trainer = Trainer(load_config(path), log=logs.append)
    table = json.loads((tmp_path / "run" / reference.FILE).read_text())["log_probs"]
    assert len(table) == 2 * 9 and any("log-probabilities of the base model" in line for line in logs)
    ex = next(e for e in trainer.train_examples if e.id == "r1-0:rejected")
    ids = torch.tensor([list(ex.prefix_ids + ex.item_ids + ex.target_ids)])
    with torch.no_grad(), adapters_disabled(trainer.lm):
        logits = trainer.model(input_ids=ids).logits[0].to(torch.float64)
    start = len(ex.prefix_ids) + len(ex.item_ids)
    logp = torch.log_softmax(logits[start - 1:-1], -1).gather(1, ids[0, start:, None]).sum()
    # float64 as shipped keeps transformers' float32 casts (norms, the GDN gate), which the packed and the alone
    # forward round apart: measured 1.5e-10 here (tests/packed/test_families.py bounds such runs at 5e-6); the
    # adapter left on moves it by 1e-2
    assert table[ex.id] == pytest.approx(float(logp), rel=1e-8)
    trainer._close()
    logs.clear()
    Trainer(load_config(path), resume=True, log=logs.append)._close()
    assert any("read from" in line for line in logs)
    weights = next((tmp_path / "base").glob("*.safetensors"))
    state = load_file(weights)
    name = next(n for n in state if "lm_head" in n)
    state[name] = state[name] * 1.01
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="another base model"):
        Trainer(load_config(path), resume=True, log=logs.append)


def test_an_edited_or_damaged_reference_table_is_refused_on_resume(tmp_path):
    """A dpo run stopped after step 1 (its reference.json written), each copy's table edited, then `train --resume`:
    a value set to -Infinity (that pair's loss 0 and its gradient gone) or NaN, an entry removed (a traceback when
    its unit was built, hours in), every value doubled, chosen +5 and rejected -5: each refused in one line naming
    the file and the entry or the digest, before any step; the unedited copy resumes. A table without the content
    digest (an older packtrain's) is computed again."""
    from cli_helpers import run_in_process, write_config, write_pair_data

    from packtrain.faults import SIGTERM_IN_STEP

    pairs = write_pair_data(tmp_path / "pairs.jsonl")
    cfg = write_config(tmp_path, data={"train": str(pairs), "eval": None},
                       train={"objective": "dpo", "max_steps": 2, "save_every": 1})
    stopped = run_in_process("train", cfg, env={SIGTERM_IN_STEP: "1"}, check=False)
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    raw = json.loads((tmp_path / "run" / reference.FILE).read_text())
    one = sorted(raw["log_probs"])[3]

    def edited(log_probs, **extra):
        return {**raw, "log_probs": log_probs, **extra}

    lp = raw["log_probs"]
    edits = {
        "-inf": (edited({**lp, one: float("-inf")}), f"log_probs['{one}'] is -inf, not a finite log-probability"),
        "nan": (edited({**lp, one: float("nan")}), f"log_probs['{one}'] is nan, not a finite log-probability"),
        "missing": (edited({k: v for k, v in lp.items() if k != one}), f"log_probs has no entry for example '{one}'"),
        "doubled": (edited({k: 2 * v for k, v in lp.items()}), "log_probs no longer match the digest"),
        "shifted": (edited({k: v + (5 if k.endswith(":chosen") else -5) for k, v in lp.items()}),
                    "log_probs no longer match the digest"),
    }
    for name, (table, message) in edits.items():
        run = tmp_path / name
        shutil.copytree(tmp_path / "run", run)
        (run / reference.FILE).write_text(json.dumps(table))
        proc = run_in_process("train", cfg, "--resume", "--set", f"output_dir={run}", check=False)
        assert proc.returncode == 2, (name, proc.stdout[-2000:], proc.stderr[-2000:])
        assert f"{run / reference.FILE}: {message}" in proc.stderr and "remove reference.json" in proc.stderr, (
            name, proc.stderr[-2000:])
        assert "step 2" not in proc.stdout and len(proc.stderr.strip().splitlines()) == 1, (name, proc.stderr)

    older = tmp_path / "older"  # no content digest: computed again, then trained on
    shutil.copytree(tmp_path / "run", older)
    (older / reference.FILE).write_text(json.dumps({k: v for k, v in raw.items() if k != "content"}))
    resumed = run_in_process("train", cfg, "--resume", "--set", f"output_dir={older}")
    assert "log-probabilities of the base model" in resumed.stdout + resumed.stderr
    assert json.loads((older / reference.FILE).read_text()) == raw
    same = run_in_process("train", cfg, "--resume")  # the unedited table is read and trained on
    assert "log-probabilities read from" in same.stdout + same.stderr


def test_sigterm_in_the_reference_pass_keeps_what_is_done_and_a_resume_computes_the_rest(tmp_path):
    """SIGTERM during the pass's second batch (of one pack each, one rank): acted on before the third, exit 75,
    reference.json keeps the finished batches' entries (marked partial); `train --resume` reads them, computes the
    rest and trains: its table and adapter are the uninterrupted run's, bit for bit. The pass used to run to its end
    first (a 27B's pass outlives a launcher's 30 s grace) and keep nothing when killed."""
    from cli_helpers import adapter_of, assert_equal_adapters, run_in_process, write_config, write_pair_data

    from packtrain.exits import PREEMPTED_EXIT
    from packtrain.faults import SIGTERM_IN_REFERENCE

    pairs = write_pair_data(tmp_path / "pairs.jsonl")
    cfg = write_config(tmp_path, data={"train": str(pairs), "eval": None},
                       train={"objective": "dpo", "max_steps": 2}, packing={"max_continuations": 2})
    straight = tmp_path / "straight"
    run_in_process("train", cfg, "--set", f"output_dir={straight}")
    whole = json.loads((straight / reference.FILE).read_text())
    stopped = run_in_process("train", cfg, env={SIGTERM_IN_REFERENCE: "2"}, check=False)
    assert stopped.returncode == PREEMPTED_EXIT, stopped.stderr[-2000:]
    assert "during the dpo reference pass" in stopped.stderr and "--resume" in stopped.stderr, stopped.stderr
    kept = json.loads((tmp_path / "run" / reference.FILE).read_text())
    assert kept["partial"] is True and 0 < len(kept["log_probs"]) < len(whole["log_probs"])
    assert all(whole["log_probs"][k] == v for k, v in kept["log_probs"].items())
    assert not (tmp_path / "run" / "adapter").exists()
    resumed = run_in_process("train", cfg, "--resume")
    assert f"{len(kept['log_probs']):,} log-probabilities read from" in resumed.stdout + resumed.stderr
    done = json.loads((tmp_path / "run" / reference.FILE).read_text())
    assert "partial" not in done and done["log_probs"] == whole["log_probs"]
    assert_equal_adapters(adapter_of(straight), adapter_of(tmp_path / "run"))


def test_a_vlm_dpo_resume_after_an_image_was_repainted_is_refused(tmp_path):
    """The VLM demo's model on preference pairs with images (dpo, precompute), stopped after step 1; one image
    repainted in place at the same size (the same grid and tokens): the resume is refused naming the training data
    (it reused the reference of the old picture). Unrepainted, it resumes."""
    from cli_helpers import REPO, run_in_process
    from PIL import Image

    from packtrain.exits import PREEMPTED_EXIT
    from packtrain.faults import SIGTERM_IN_STEP

    for k in (1, 2):
        shutil.copy(REPO / "data" / "vlm_demo" / "images" / f"sign-000{k}.png", tmp_path / f"sign-{k}.png")
    system = json.loads((REPO / "data" / "vlm_demo" / "train.jsonl").read_text().splitlines()[0])["system"]
    rows = [{"id": f"p{i}", "system": system, "images": [f"sign-{1 + i % 2}.png"], "item": "What does it mean?",
             "chosen": answer, "rejected": other} for i, (answer, other) in enumerate([("go", "stop"), ("up", "left")])]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["train", str(REPO / "configs" / "vlm_demo.yaml"), *(x for s in (
        f"data.train={data}", "data.eval=null", "generate.every=null", "train.objective=dpo", "train.max_steps=2",
        "train.save_every=1", "packing.mode=tree", f"output_dir={tmp_path / 'run'}", "logging.progress=false")
        for x in ("--set", s))]
    stopped = run_in_process(*args, env={SIGTERM_IN_STEP: "1"}, check=False)
    assert stopped.returncode == PREEMPTED_EXIT, stopped.stderr[-2000:]
    kept = (tmp_path / "sign-1.png").read_bytes()
    with Image.open(tmp_path / "sign-1.png") as im:
        repainted = Image.new(im.mode, im.size, (0, 0, 255) if im.mode == "RGB" else 0)
    repainted.save(tmp_path / "sign-1.png")
    refused = run_in_process(*args, "--resume", check=False)
    assert refused.returncode == 2 and "computed with another training data" in refused.stderr, refused.stderr[-2000:]
    (tmp_path / "sign-1.png").write_bytes(kept)
    resumed = run_in_process(*args, "--resume")
    assert "log-probabilities read from" in resumed.stdout + resumed.stderr
