"""Tiny random Qwen3.5 hybrid models (text, the other families, vision-language) and random LoRA for the parity
tests."""

from __future__ import annotations

import random

import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5TextConfig,
)

from packtrain.models import lora_compute
from packtrain.packed.layout import Continuation, build_pack_layout

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
    """A random model with random LoRA A *and* B (so adapters change the output and get real gradients), computed as
    packtrain computes it (:mod:`packtrain.models.lora_compute`). ``config``: overrides of :func:`tiny_text_config`."""
    torch.manual_seed(seed)
    return _random_lora(Qwen3_5ForCausalLM(tiny_text_config(layer_types, **config)).to(dtype), targets)


def patched_lora_model(layer_types, *, backend, **model):
    """:func:`tiny_lora_model` (``model``: its arguments) patched for packing with ``backend``."""
    from packtrain.packed.patch import patch_model

    return patch_model(tiny_lora_model(layer_types, **model), backend)


def with_lora_dropout(model, p: float):
    """``model`` with dropout ``p`` in every LoRA adapter (peft holds an Identity for dropout 0)."""
    for module in model.modules():
        if isinstance(getattr(module, "lora_dropout", None), torch.nn.ModuleDict):
            for name in module.lora_dropout:
                module.lora_dropout[name] = torch.nn.Dropout(p)
    return model


def _random_lora(model, targets, params=None):
    with torch.no_grad():  # larger weights than the default init so every route matters at float64 scale
        for name, p in model.named_parameters():
            if p.dim() == 2 or ".experts." in name:  # matrices, and the routed experts' [experts, out, in] stacks
                p.normal_(0.0, 0.2)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                                             target_parameters=params or None, init_lora_weights=False))
    for p in model.parameters():
        if p.requires_grad:
            with torch.no_grad():
                p.normal_(0.0, 0.1)
    lora_compute.install(model)
    model.enable_input_require_grads()
    return model


def random_pack(prefix_len, cont_specs, vocab=97, seed=0):
    """cont_specs: list of (item_len, target_len)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    conts = [Continuation([rng.randrange(vocab) for _ in range(i)], [rng.randrange(vocab) for _ in range(t)])
             for i, t in cont_specs]
    return prefix, conts


def examples_of(prefix, conts, first: int = 0) -> list:
    """The examples (packtrain.data.example.Example) of P and each continuation, ids e{first}, e{first + 1}, ..."""
    from packtrain.data.example import Example

    return [Example(f"e{first + i}", tuple(prefix), tuple(c.item_ids), tuple(c.target_ids))
            for i, c in enumerate(conts)]


def plan_of(prompts, packs, examples):
    """A plan (packtrain.data.planner.Plan) of ``packs``, each (prompt index, example indices), over ``prompts``;
    a pack's positions and pairs as the planner counts them."""
    from packtrain.data.attention_pairs import pack_pairs
    from packtrain.data.planner import Pack, Plan

    def pack(p, e):
        lengths = [examples[i].len_continuation for i in e]
        return Pack(p, tuple(e), len(prompts[p]) + sum(lengths), pack_pairs(len(prompts[p]), lengths))

    return Plan(packs=[pack(p, e) for p, e in packs],
                prompts=[tuple(p) for p in prompts], skipped=[], token_budget=10**9, max_continuations=10**6)


def pack_layout(prefix_len, lengths, seed=0):
    """A pack of P = 1..prefix_len and one continuation per entry of ``lengths``, each of that many random tokens
    split into item and target (an entry of 1 gets a 1-token item and a 1-token target): for the kernels' tests,
    where only the lengths matter."""
    g = torch.Generator().manual_seed(seed)
    conts = [Continuation(torch.randint(1, 50, (n - n // 2,), generator=g).tolist(),
                          torch.randint(1, 50, (n // 2 or 1,), generator=g).tolist()[:max(n // 2, 1)])
             for n in lengths]
    return build_pack_layout(list(range(1, prefix_len + 1)), conts)


# Other families (packtrain.packed.families): tiny configs with shapes unlike the Qwen3.5 ones above, and the LoRA each
# trains (routed experts through peft's parameter targeting).
GDN_SEPARATE = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
ATTENTION_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
_MOE = dict(moe_intermediate_size=12, shared_expert_intermediate_size=20, num_experts=6, num_experts_per_tok=2)
FAMILY_CONFIGS = {
    "qwen3_5_moe_text": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                             linear_value_head_dim=8, rope_parameters=tiny_text_config([]).rope_parameters, **_MOE),
    # fused GDN projections (2 key heads, 6 value heads: 3 per group), dense MLP on layer 0 and odd layers
    "qwen3_next": dict(hidden_size=24, intermediate_size=40, num_attention_heads=6, num_key_value_heads=3,
                       head_dim=8, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=4,
                       linear_value_head_dim=6, decoder_sparse_step=2, mlp_only_layers=[0], norm_topk_prob=False,
                       **{**_MOE, "num_experts": 5, "num_experts_per_tok": 3}),
    "qwen3": dict(hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                  tie_word_embeddings=True),
}
FAMILY_LORA = {
    "qwen3_5_moe_text": (ATTENTION_MLP + GDN_SEPARATE, EXPERTS),
    # peft 0.21 reads MLP names on qwen3_next as its experts (packtrain.models.build._renamed_by_peft): attention, GDN, experts
    "qwen3_next": (ATTENTION_MLP[:4] + ["in_proj_qkvz", "in_proj_ba", "out_proj"], EXPERTS),
    "qwen3": (ATTENTION_MLP, []),
}


def tiny_family_model(model_type, layer_types, dtype=torch.float64, seed=0, **over):
    """A random model of ``model_type`` with random LoRA A and B on every projection (and the routed experts)."""
    from transformers import AutoConfig

    from packtrain.models.build import model_class_for
    from packtrain.packed.families import FAMILIES

    kw = dict(vocab_size=97, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
              tie_word_embeddings=False)
    kw.update(FAMILY_CONFIGS[model_type], **over)
    torch.manual_seed(seed)
    model = model_class_for(model_type)(AutoConfig.for_model(model_type, **kw)).to(dtype)
    if FAMILIES[model_type].moe and dtype == torch.float64:
        model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    return _random_lora(model, *FAMILY_LORA[model_type])


# A tiny vision-language model and a pack of image items (the VLM parity tests, generation, the GPU check)
L, F = "linear_attention", "full_attention"
IMAGE, START, END = 90, 91, 92
PATCH_DIM = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch


def tiny_vlm(seed=0, moe=False):
    """moe: Qwen3_5MoeForConditionalGeneration (Qwen3.6-35B-A3B's form), LoRA on the routed experts too."""
    torch.manual_seed(seed)
    config_cls, model_cls = (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if moe else (
        Qwen3_5Config, Qwen3_5ForConditionalGeneration)
    text = tiny_text_config([L, F, L]).to_dict()
    if moe:
        text = {**{k: v for k, v in text.items() if k != "intermediate_size"}, **FAMILY_CONFIGS["qwen3_5_moe_text"]}
    cfg = config_cls(
        text_config=text,
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           num_position_embeddings=64),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=93)
    model = model_cls(cfg).double()
    if moe:
        model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (p.dim() == 2 or ".experts." in name) and "visual" not in name:
                p.normal_(0.0, 0.2)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "in_proj_qkv", "out_proj"],
                                             target_parameters=EXPERTS if moe else None,
                                             modules_to_save=["merger"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and "lora" in name:
                p.normal_(0.0, 0.1)
    model.enable_input_require_grads()
    from packtrain.packed.kernels import Backend
    from packtrain.packed.patch import patch_model

    return patch_model(model, Backend(gdn="torch", attention="batched", mlp_rows=7, norm_rows=5))


def image_item(text_before, grids, text_after, gen):
    """Item tokens with one vision block per grid, and random pixels for each image."""
    ids, pixels = list(text_before), []
    for t, h, w in grids:
        ids += [START] + [IMAGE] * (t * h * w // 4) + [END]
        pixels.append(torch.randn(t * h * w, PATCH_DIM, generator=gen, dtype=torch.float64))
    return ids + list(text_after), pixels


def vlm_pack(seed=0):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randint(0, 89, (n,), generator=gen).tolist()  # noqa: E731 - text tokens only
    prefix = rnd(37)
    specs = [  # (grids, item text before, after, target length)
        ([(1, 4, 6)], 3, 5, 4),
        ([], 6, 0, 3),  # no image
        ([(1, 4, 4), (1, 6, 2)], 2, 4, 5),  # two images, different grids
        ([(1, 2, 8)], 0, 70, 6),  # straddles the 64-token GDN chunk
    ]
    conts, pixels = [], []
    for grids, before, after, target in specs:
        item, px = image_item(rnd(before), grids, rnd(after), gen)
        conts.append(Continuation(item, rnd(target), images=grids))
        pixels.append(px)
    return prefix, conts, pixels
