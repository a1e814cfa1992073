"""Tiny random Qwen3.5 hybrid models and random LoRA for the parity tests."""

from __future__ import annotations

import random

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from packtrain.layout import Continuation

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]


def tiny_text_config(layer_types, vocab=97, **over) -> Qwen3_5TextConfig:
    kw = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=len(layer_types),
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
              layer_types=list(layer_types), tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                               "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    kw.update(over)
    return Qwen3_5TextConfig(**kw)


def tiny_lora_model(layer_types, dtype=torch.float64, seed=0, targets=ALL_PROJECTIONS, **config):
    """A random model with random LoRA A *and* B (so adapters change the output and get real gradients).
    ``config``: overrides of :func:`tiny_text_config`."""
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(tiny_text_config(layer_types, **config)).to(dtype)
    with torch.no_grad():  # larger weights than the default init so every route matters at float64 scale
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                                             init_lora_weights=False))
    for p in model.parameters():
        if p.requires_grad:
            with torch.no_grad():
                p.normal_(0.0, 0.1)
    model.enable_input_require_grads()
    return model


def random_pack(prefix_len, cont_specs, vocab=97, seed=0):
    """cont_specs: list of (item_len, target_len)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    conts = [Continuation([rng.randrange(vocab) for _ in range(i)], [rng.randrange(vocab) for _ in range(t)])
             for i, t in cont_specs]
    return prefix, conts
