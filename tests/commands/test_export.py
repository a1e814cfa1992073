"""`packtrain export OUTPUT_DIR --merged DIR`: transformers loads DIR and gives the logits of base + adapter (peft's
own unmerged forward), every tensor the adapter does not touch keeps its bytes, the adapter directory is unchanged.
The real CLI, in this process."""

import filecmp
import hashlib
import json

import torch
import yaml
from checkpoints import MTP_TENSORS, hf_model, save_checkpoint, text_config, vlm_config
from cli_helpers import run_in_process, write_config
from safetensors import safe_open

# routes transformers' CPU kernels (its reference forwards here), as every packtrain process does: with fla
# installed they would otherwise reach fla's kernels, which fail uncompiled on CPU ("0 active drivers")
import packtrain.packed.patch  # noqa: F401


def _tensors(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for key, shard in index.items():
        with safe_open(str(path / shard), framework="pt") as f:
            out[key] = f.get_tensor(key)
    return out


def _digest(directory):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir())}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


def _check_merged(base_dir, adapter_dir, merged_dir, cls, touched_min):
    from peft import PeftModel

    ids = torch.randint(0, 1000, (2, 17), generator=torch.Generator().manual_seed(0))
    base = _logits(cls.from_pretrained(base_dir, dtype=torch.float32).eval(), ids)
    reference = PeftModel.from_pretrained(cls.from_pretrained(base_dir, dtype=torch.float32), adapter_dir).eval()
    expected = _logits(reference, ids)
    merged = _logits(cls.from_pretrained(merged_dir, dtype=torch.float32).eval(), ids)
    # float32: W + BA rounded once against x W + (x A) B through a few layers differ by ~2e-5 here; a delta
    # missed or misplaced moves the logits by more than 1e-2
    assert (expected - base).abs().max() > 1e-2
    torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-4)
    before, after = _tensors(base_dir), _tensors(merged_dir)
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8))]
    assert len(changed) >= touched_min
    for key in MTP_TENSORS:  # not loaded by the class: carried over byte for byte
        assert after[key].dtype == before[key].dtype
        assert torch.equal(after[key].view(torch.uint8), before[key].view(torch.uint8))
    assert all(not k.startswith("mtp.") for k in changed)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(base_dir / name, merged_dir / name, shallow=False), name
    return changed


def test_export_text_model_after_training(tmp_path):
    from transformers import Qwen3_5ForCausalLM

    base_dir = save_checkpoint(tmp_path / "base", text_config())
    cfg = write_config(tmp_path, model={"path": str(base_dir), "config": None, "dtype": "float32"},
                       lora={"init_lora_weights": False, "modules_to_save": ["lm_head"]},
                       train={"max_steps": 1}, data={"eval": None})
    run_in_process("train", cfg)
    adapter = tmp_path / "run" / "adapter"
    adapter_before = _digest(adapter)
    out = run_in_process("export", tmp_path / "run", "--merged", tmp_path / "merged")
    assert "tensors merged" in out.stdout
    changed = _check_merged(base_dir, adapter, tmp_path / "merged", Qwen3_5ForCausalLM, touched_min=8)
    assert "lm_head.weight" in changed
    assert _digest(adapter) == adapter_before
    # shards the adapter does not touch are the same files
    shards = json.loads((base_dir / "model.safetensors.index.json").read_text())["weight_map"]
    untouched = {s for s in shards.values()} - {shards[k] for k in changed}
    assert untouched and all(filecmp.cmp(base_dir / s, tmp_path / "merged" / s, shallow=False) for s in untouched)
    again = run_in_process("export", tmp_path / "run", "--merged", tmp_path / "merged", check=False)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_export_vision_language(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForConditionalGeneration

    base_dir = save_checkpoint(tmp_path / "base", vlm_config())
    model = Qwen3_5ForConditionalGeneration.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                  target_modules=["q_proj", "v_proj", "gate_proj", "in_proj_qkv"]))
    run = tmp_path / "run"
    peft_model.save_pretrained(run / "adapter")
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(base_dir), "config": None}}))
    run_in_process("export", run, "--merged", tmp_path / "merged")
    changed = _check_merged(base_dir, run / "adapter", tmp_path / "merged", Qwen3_5ForConditionalGeneration,
                            touched_min=6)
    assert all(k.startswith("model.language_model.") for k in changed)  # the vision tower is untouched


def test_export_random_base_from_model_config(tmp_path):
    """A run whose base came from model.config: the base is OUTPUT_DIR/base, the tokenizer the run's (bundled)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import Qwen3_5ForCausalLM

    run = tmp_path / "run"
    hf_model(text_config(), seed=3).save_pretrained(run / "base")
    base = Qwen3_5ForCausalLM.from_pretrained(run / "base", dtype=torch.float32)
    torch.manual_seed(2)
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                    target_modules=["q_proj", "o_proj", "out_proj"])).save_pretrained(run / "adapter")
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": None, "config": text_config()}}))
    run_in_process("export", run, "--merged", tmp_path / "merged")
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(0))
    base = Qwen3_5ForCausalLM.from_pretrained(run / "base", dtype=torch.float32)
    expected = _logits(PeftModel.from_pretrained(base, run / "adapter").eval(), ids)
    merged = _logits(Qwen3_5ForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval(), ids)
    torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-4)
