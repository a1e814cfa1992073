"""`packtrain train` on a tiny model of every family (the real CLI, in this process; two ranks as processes), and
clear refusals of anything else."""


import pytest
import torch
from cli_helpers import REPO, TINY_MODEL, TINY_MOE, adapter_of, metrics_of, run_in_process, run_ranks, write_config

from packtrain.packed.families import FAMILIES as FAMILY_TABLE

SHAPE = {k: TINY_MODEL[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                    "head_dim", "tie_word_embeddings")}
L, F = "linear_attention", "full_attention"
EXPERT_LORA = {"target_modules": ["q_proj", "v_proj", "in_proj_qkv", "gate_proj", "down_proj"],
               "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
FAMILIES = {
    "qwen3_5_moe_text": (TINY_MOE, EXPERT_LORA),
    "qwen3_next": ({**TINY_MOE, "model_type": "qwen3_next", "rope_parameters": None, "intermediate_size": 24,
                    "layer_types": [F, L, L], "decoder_sparse_step": 2, "tie_word_embeddings": True},
                   {"target_parameters": ["mlp.experts.gate_up_proj"]}),  # default target_modules
    "qwen3": ({"model_type": "qwen3", **SHAPE, "intermediate_size": 40, "num_hidden_layers": 2}, {}),
}


def _trains_and_loads(model_type, tmp_path, **sections):
    """One CLI run of a family's tiny config; checks the header, the steps, and that peft loads the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_cfg, lora = FAMILIES[model_type]
    model_cfg = {k: v for k, v in model_cfg.items() if v is not None}
    cfg = write_config(tmp_path, model={"config": model_cfg}, lora=lora, train={"max_steps": 2, "eval_every": 2},
                       **sections)
    proc = run_in_process("train", cfg)
    assert f"model: {model_type}" in proc.stdout, proc.stdout
    run = tmp_path / "run"
    steps = [m for m in metrics_of(run) if m.get("split") != "eval"]
    assert [m["step"] for m in steps] == [1, 2] and all(m["grad_norm"] > 0 for m in steps)
    adapter = adapter_of(run)
    if lora.get("target_parameters"):
        assert any("experts" in k for k in adapter), sorted(adapter)
    assert not any(".mlp.gate." in k for k in adapter)
    # transformers' default grouped_mm experts have no float64 kernel
    eager = {"experts_implementation": "eager"} if FAMILY_TABLE[model_type].moe else {}
    base = AutoModelForCausalLM.from_pretrained(run / "base", dtype=torch.float64, **eager)
    model = PeftModel.from_pretrained(base, run / "adapter")
    loaded = {k for k, _ in model.named_parameters() if "lora_" in k}
    assert len(loaded) == len(adapter)
    evals = [m for m in metrics_of(run) if m.get("split") == "eval"]
    if evals:  # the final packed eval == transformers' forward with the adapter peft loaded, example by example
        assert evals[-1]["step"] == 2
        # float64 model, transformers' float32 casts (RMSNorm, chunk rule, logits.float()): see test_parity.py
        assert evals[-1]["loss"] == pytest.approx(_peft_mean_loss(model.eval(), tmp_path / "eval.jsonl"), rel=5e-6)
    return cfg


def _peft_mean_loss(model, path):
    from packtrain.data.jsonl import load_examples

    losses = []
    with torch.no_grad():
        for ex in load_examples(path):
            ids = torch.tensor([list(ex.prefix_ids) + list(ex.item_ids) + list(ex.target_ids)])
            labels = torch.full_like(ids, -100)
            start = len(ex.prefix_ids) + len(ex.item_ids)
            labels[0, start:] = ids[0, start:]
            losses.append(model(input_ids=ids, labels=labels).loss.item())
    return sum(losses) / len(losses)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3"])
def test_family_trains_and_adapter_loads_with_peft(model_type, tmp_path):
    _trains_and_loads(model_type, tmp_path)


def test_vision_language_moe_trains_on_images(tmp_path):
    """qwen3_5_moe (Qwen3.6-35B-A3B's shipped form): the VLM demo's data and processor on a tiny MoE text stack."""
    import yaml

    demo = yaml.safe_load((REPO / "configs" / "vlm_demo.yaml").read_text())
    model = demo["model"]["config"]
    model["model_type"] = "qwen3_5_moe"
    del model["text_config"]["intermediate_size"]
    model["text_config"].update(moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
                                num_experts_per_tok=2, hidden_size=32, head_dim=8)
    model["vision_config"]["out_hidden_size"] = 32
    vlm = REPO / "data" / "vlm_demo"
    cfg = write_config(tmp_path, model={"config": model, "dtype": "float32"},
                       data={"train": str(vlm / "train.jsonl"), "eval": None, "format": "text",
                             "tokenizer": str(REPO / "packtrain" / "assets" / "vlm"),
                             "processor": str(REPO / "packtrain" / "assets" / "vlm")},
                       lora={**EXPERT_LORA, "modules_to_save": ["merger"]},
                       packing={"token_budget": 1200, "max_continuations": 4}, train={"max_steps": 1})
    proc = run_in_process("train", cfg)
    assert "model: qwen3_5_moe (Qwen3_5MoeForConditionalGeneration" in proc.stdout, proc.stdout
    # the run header says which servers will apply this adapter, before the run
    assert ("serve: vllm yes (--enable-mixed-moe-lora-format), sglang no (experts, in_proj_qkv), merged yes; merger "
            "(modules_to_save) folded into the served model by packtrain export --for") in " ".join(
                proc.stdout.split())  # wrapped at 120 columns
    adapter = adapter_of(tmp_path / "run")
    assert any("experts" in k for k in adapter) and any("merger" in k for k in adapter)


@pytest.mark.process
@pytest.mark.distributed
def test_moe_trains_and_two_ranks_equal_one_rank(tmp_path):
    """Qwen3.6-35B-A3B's family: experts (LoRA on both stacks) inside each FSDP-sharded decoder layer."""
    cfg = _trains_and_loads("qwen3_5_moe_text", tmp_path)
    two = run_ranks(2, "train", str(cfg), "--set", f"output_dir={tmp_path / 'two'}")
    assert "FSDP2 over 2 ranks" in two.stdout
    one, two = (adapter_of(tmp_path / d) for d in ("run", "two"))
    assert one.keys() == two.keys()
    for name in one:  # float64: only the order of the cross-rank sums differs
        torch.testing.assert_close(one[name], two[name], rtol=1e-10, atol=1e-13)


def _refused(tmp_path, model_cfg, **sections):
    cfg = write_config(tmp_path, model={"config": model_cfg}, **sections)
    proc = run_in_process("train", cfg, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert not (tmp_path / "run" / "adapter").exists()
    return lines[0]


def test_unknown_model_type_is_refused_naming_it_and_the_supported(tmp_path):
    """(Unknown layer types: tests/packed/test_families.py, in process; the CLI path of the error is this one.)"""
    line = _refused(tmp_path, {**TINY_MODEL, "model_type": "qwen4_exp"})
    assert "'qwen4_exp'" in line and "model.config.model_type" in line
    for supported in ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next", "qwen3"):
        assert supported in line
