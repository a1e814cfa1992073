"""Loading ``model.path`` on the meta device and filling it from the checkpoint (packtrain.models.loading), against
transformers' own ``from_pretrained`` on the same directory, for the layouts released checkpoints use."""

import json

import pytest
import torch
from checkpoints import relayout_as_vlm_text, save_checkpoint, text_config, vlm_config

from packtrain.config import config_from_dict
from packtrain.models.build import build_base_model
from packtrain.models.wrap import assemble

CPU = torch.device("cpu")


def _config(path, dtype="float32", **lora):
    return config_from_dict({"model": {"path": str(path), "dtype": dtype, "kernels": "torch"},
                             "lora": {"r": 4, "alpha": 8, **lora},
                             "train": {"activation_checkpointing": True, "offload": False, "loss_chunk_rows": 0,
                                       "mlp_chunk_rows": 0, "norm_chunk_rows": 0}})


def _both(cfg):
    """(root built on the meta device and filled by packtrain, root from transformers' from_pretrained)."""
    _, meta_lm, _ = assemble(build_base_model(cfg, meta=True), cfg, CPU)
    _, ref_lm, _ = assemble(build_base_model(cfg), cfg, CPU)
    return meta_lm, ref_lm


def _assert_same_tensors(a, b):
    sa = {**dict(a.named_parameters()), **dict(a.named_buffers())}
    sb = {**dict(b.named_parameters()), **dict(b.named_buffers())}
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


LAYOUTS = {
    "text, sharded, untied": (text_config(), {}, "float32", torch.float32),
    "text, tied embeddings": (text_config(tie_word_embeddings=True), {}, "float32", torch.float32),
    "bf16 on disk, float32 model": (text_config(), {}, "float32", torch.bfloat16),
    "bf16 on disk, bf16 model": (text_config(), {}, "bfloat16", torch.bfloat16),
    "one file plus an extra shard": (text_config(), {"shard_kb": None}, "float32", torch.float32),
    "vision-language": (vlm_config(), {}, "float32", torch.float32),
    "vision-language, tied": (vlm_config(text_config(tie_word_embeddings=True)), {}, "float32", torch.float32),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_meta_load_equals_from_pretrained(tmp_path, layout):
    config, save_kw, dtype, disk = LAYOUTS[layout]
    path = save_checkpoint(tmp_path / "ckpt", config, dtype=disk, **save_kw)
    if save_kw.get("shard_kb", 40):
        assert len(list(path.glob("model-0*.safetensors"))) >= 3
    meta_lm, ref_lm = _both(_config(path, dtype, modules_to_save=["lm_head"]))
    _assert_same_tensors(meta_lm, ref_lm)
    assert meta_lm.load_report.extra == "mtp.*: 3"  # the extra tensors are counted, not loaded
    assert any("inv_freq" in n for n, _ in meta_lm.named_buffers())  # computed, not read: no checkpoint has them


def test_text_class_reads_vision_language_key_layout(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt", text_config())
    relayout_as_vlm_text(path)
    keys = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.startswith("model.language_model.layers.") for k in keys)
    meta_lm, ref_lm = _both(_config(path))
    _assert_same_tensors(meta_lm, ref_lm)


def test_missing_tensor_is_named(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt", text_config(), mtp=False)
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"]["model.layers.1.self_attn.q_proj.weight"]
    index.write_text(json.dumps(data))
    cfg = _config(path)
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*model\.layers\.1\.self_attn\.q_proj\.weight"):
        assemble(build_base_model(cfg, meta=True), cfg, CPU)


def test_not_safetensors_is_refused(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt", text_config(), mtp=False)
    for f in path.glob("model*.safetensors*"):
        f.unlink()
    cfg = _config(path)
    with pytest.raises(ValueError, match="safetensors"):
        assemble(build_base_model(cfg, meta=True), cfg, CPU)


def test_pretokenized_data_with_a_model_directory_without_tokenizer(tmp_path):
    from packtrain.data.jsonl import DataError, load_examples

    path = save_checkpoint(tmp_path / "ckpt", text_config(vocab_size=1024), tokenizer=False, mtp=False)
    assert not (path / "tokenizer.json").exists()
    data = tmp_path / "train.jsonl"
    line = {"prefix_ids": [1, 2, 3], "item_ids": [4], "target_ids": [1023]}
    data.write_text(json.dumps(line) + "\n")
    assert len(load_examples(data, None, path)) == 1  # the vocabulary comes from the model's config
    data.write_text(json.dumps({**line, "target_ids": [1024]}) + "\n")
    with pytest.raises(DataError, match="train.jsonl:1"):
        load_examples(data, None, path)


def test_reads_in_row_blocks(tmp_path, monkeypatch):
    import packtrain.models.loading

    monkeypatch.setattr(packtrain.models.loading, "BLOCK_BYTES", 100)  # a few rows per read
    path = save_checkpoint(tmp_path / "ckpt", text_config(), dtype=torch.bfloat16)
    meta_lm, ref_lm = _both(_config(path))
    _assert_same_tensors(meta_lm, ref_lm)


def test_converted_layout_per_expert_tensors_into_fused_experts(tmp_path):
    """A MoE checkpoint stores one tensor per expert; transformers' class holds them stacked: the loader runs
    transformers' own converter on them (no per-family code), and gets what from_pretrained gets."""
    from transformers import AutoConfig, Qwen3_5MoeForCausalLM

    from packtrain.models.build import empty_model
    from packtrain.models.loading import SafetensorsCheckpoint, WeightMap, materialize, module_names, real_tensors

    config = AutoConfig.for_model(
        "qwen3_5_moe_text", vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        layer_types=["linear_attention", "full_attention"], num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    torch.manual_seed(0)
    Qwen3_5MoeForCausalLM(config).save_pretrained(tmp_path / "moe", max_shard_size="20KB")
    keys = json.loads((tmp_path / "moe" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in keys  # the per-expert layout on disk
    model = empty_model(Qwen3_5MoeForCausalLM, AutoConfig.from_pretrained(tmp_path / "moe"), torch.float32)
    weights = WeightMap(model, SafetensorsCheckpoint(tmp_path / "moe"))
    assert weights.converted
    materialize(model, real_tensors(model), module_names(model), weights, CPU)
    ref = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32)
    _assert_same_tensors(model, ref)
