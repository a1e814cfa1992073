"""Parameter counts from a normalised text config (:mod:`packtrain.models.text_config`): each decoder layer's linear
layers by the names LoRA targets, the routed experts' stacks, the model's and the adapter's sizes as peft makes them.
No torch."""

from __future__ import annotations

from packtrain.models.text_config import DENSE, FULL, MOE, split_kind
from packtrain.packed.families import FAMILIES


def linears(text: dict, kind) -> dict[str, tuple[int, int, str]]:
    """name -> (in, out, input group) of one decoder layer's linear layers (by the name LoRA targets). Layers of
    one group read the same input tensor (so an adapter without cast or dropout shares it). A MoE layer's MLP
    names are its shared expert's; its router is ``gate`` (frozen); the experts are in :func:`expert_shapes`."""
    mixer, mlp_kind = split_kind(kind)
    family = FAMILIES[text["family"]]
    H = text["hidden_size"]
    if mlp_kind == DENSE:
        mlp = _mlp(H, text["intermediate_size"])
    else:
        shared = text["shared_expert_intermediate_size"]
        mlp = {"gate": (H, text["num_experts"], "post_norm"), **(_mlp(H, shared) if shared else {}),
               "shared_expert_gate": (H, 1, "post_norm")}
    if mixer == FULL:
        q, kv = text["num_attention_heads"] * text["head_dim"], text["num_key_value_heads"] * text["head_dim"]
        q_out = 2 * q if family.attention_gate else q  # an output gate doubles q_proj
        return {"q_proj": (H, q_out, "input_norm"), "k_proj": (H, kv, "input_norm"), "v_proj": (H, kv, "input_norm"),
                "o_proj": (q, H, "attention_out"), **mlp}
    value = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    projections = {name: (H, width, "input_norm") for name, width in family.gdn.widths(text).items()}
    return {**projections, "out_proj": (value, H, "gated_norm_out"), **mlp}


def _mlp(H: int, width: int) -> dict[str, tuple[int, int, str]]:
    return {"gate_proj": (H, width, "post_norm"), "up_proj": (H, width, "post_norm"),
            "down_proj": (width, H, "mlp_product")}


def expert_shapes(text: dict, kind) -> dict[str, tuple[int, int, int]]:
    """The routed experts' stacked parameters of a layer: target_parameters name -> (experts, in, out)."""
    if split_kind(kind)[1] != MOE:
        return {}
    E, H, I = text["num_experts"], text["hidden_size"], text["moe_intermediate_size"]
    return {"mlp.experts.gate_up_proj": (E, H, 2 * I), "mlp.experts.down_proj": (E, I, H)}


def targeted(name: str, target_parameters) -> bool:
    """peft matches a target parameter by its dotted suffix (``gate_up_proj``, ``experts.gate_up_proj``, ...)."""
    return any(name == t or name.endswith("." + t) for t in target_parameters)


def layer_parameters(text: dict, kind) -> int:
    mixer, _ = split_kind(kind)
    H = text["hidden_size"]
    n = sum(i * o for i, o, _ in linears(text, kind).values()) + 2 * H  # + two RMSNorms
    n += sum(e * i * o for e, i, o in expert_shapes(text, kind).values())
    if mixer == FULL:
        return n + 2 * text["head_dim"]  # q_norm, k_norm
    key = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    conv_dim = 2 * key + text["linear_num_value_heads"] * text["linear_value_head_dim"]
    nv = text["linear_num_value_heads"]
    return n + conv_dim * text["linear_conv_kernel_dim"] + 2 * nv + text["linear_value_head_dim"]  # dt_bias, A_log


def model_parameters(text: dict) -> int:
    V, H = text["vocab_size"], text["hidden_size"]
    layers = sum(layer_parameters(text, k) for k in text["kinds"])
    return layers + V * H * (1 if text["tie_word_embeddings"] else 2) + H


def lora_parameters(text: dict, r: int, targets: list[str], target_parameters: list[str] = ()) -> int:
    """peft's adapter sizes: r * (in + out) per targeted linear; r * experts * (in + out) per targeted stack."""
    n = sum(r * (i + o) for k in text["kinds"] for name, (i, o, _) in linears(text, k).items() if name in targets)
    n += sum(r * e * (i + o) for k in text["kinds"] for name, (e, i, o) in expert_shapes(text, k).items()
             if targeted(name, target_parameters))
    if "lm_head" in targets:
        n += r * (text["hidden_size"] + text["vocab_size"])
    return n


def saved_module_parameters(text: dict, names) -> int:
    """The parameters of ``lora.modules_to_save``'s trained copies: the embedding and the head, [V, H] each."""
    V, H = text["vocab_size"], text["hidden_size"]
    return sum(V * H for name in names if name in ("embed_tokens", "lm_head"))
