"""Per-GPU memory estimate for one pack: every term shown, so a user sees what to change before a job fails.

Pure arithmetic from the model's text config (a dict) and the pack's size; no torch. Units: T positions in the
pack, M target tokens, H hidden, I intermediate, V vocabulary, b bytes of the model dtype, a bytes of the LoRA
weights (peft's autocast keeps adapters of a bf16 model in float32: packtrain's ``apply_lora`` does).

Exact terms (the seed's figures for Qwen3.6-27B, tested): a checkpointed layer input is [T, H] in b bytes (70K x
5120 bf16 = 0.67 GiB; 64 layers = 43 GiB); an MLP intermediate is [T, I] (70K x 17408 = 2.3 GiB) and SwiGLU saves
three of them (gate, SiLU(gate), up); a LoRA adapter saves its own input for its weight gradient, a dropout copy
plus a 1-byte mask when dropout > 0 (down_proj's input is [T, I]: 2.3 + 1.1 = 3.4 GiB per recomputed layer with
bf16 adapters, 5.7 GiB with float32 ones); logits at every position are [T, V] (144K x 248,320 bf16 = 71.5 GB),
target-only ones [M, V]. The MLP and adapter terms are checked against autograd's saved tensors on CPU.

Approximate terms (marked ~): what the attention / Gated DeltaNet kernels and the RMSNorms save, the backward
workspace, and FSDP's gathered weights. They depend on kernels; use ``packtrain smoke`` for the measured peak.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
OFFLOAD_CHUNK_BYTES = 64 * 2**20  # packtrain.offload.DEFAULT_CHUNK_BYTES (tested equal)

# Qwen3_5TextConfig's defaults for the fields used here (tested equal to transformers').
TEXT_DEFAULTS = {
    "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "tie_word_embeddings": False,
}
FULL, LINEAR = "full_attention", "linear_attention"


def text_config(raw: dict) -> dict:
    """A Qwen3.5/3.6 config dict (text, or vision-language with ``text_config``) -> the text fields, defaulted."""
    raw = raw.get("text_config", raw)
    text = {**TEXT_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    if "layer_types" not in raw:
        text["layer_types"] = [LINEAR if (i + 1) % 4 else FULL for i in range(text["num_hidden_layers"])]
    return text


def config_dict_of(cfg) -> dict:
    """``model.config``, or ``config.json`` under ``model.path``."""
    if cfg.model.config is not None:
        return dict(cfg.model.config)
    if cfg.model.path is None:
        raise ValueError("model: set model.path or model.config to estimate memory")
    path = cfg.resolve_path(cfg.model.path) / "config.json"
    if not path.is_file():
        raise ValueError(f"model.path: no config.json at {path}")
    return json.loads(path.read_text())


def linears(text: dict, layer_type: str) -> dict[str, tuple[int, int, str]]:
    """name -> (in, out, input group) of one decoder layer's linear layers. Layers of one group read the same
    input tensor (so an adapter without cast or dropout shares it)."""
    H, I = text["hidden_size"], text["intermediate_size"]
    mlp = {"gate_proj": (H, I, "post_norm"), "up_proj": (H, I, "post_norm"), "down_proj": (I, H, "mlp_product")}
    if layer_type == FULL:
        q, kv = text["num_attention_heads"] * text["head_dim"], text["num_key_value_heads"] * text["head_dim"]
        # q_proj is twice as wide: Qwen3.5 attention has an output gate.
        return {"q_proj": (H, 2 * q, "input_norm"), "k_proj": (H, kv, "input_norm"), "v_proj": (H, kv, "input_norm"),
                "o_proj": (q, H, "attention_out"), **mlp}
    key = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    value = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    nv = text["linear_num_value_heads"]
    return {"in_proj_qkv": (H, 2 * key + value, "input_norm"), "in_proj_z": (H, value, "input_norm"),
            "in_proj_b": (H, nv, "input_norm"), "in_proj_a": (H, nv, "input_norm"),
            "out_proj": (value, H, "gated_norm_out"), **mlp}


def layer_parameters(text: dict, layer_type: str) -> int:
    H = text["hidden_size"]
    n = sum(i * o for i, o, _ in linears(text, layer_type).values()) + 2 * H  # + two RMSNorms
    if layer_type == FULL:
        return n + 2 * text["head_dim"]  # q_norm, k_norm
    key = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    conv_dim = 2 * key + text["linear_num_value_heads"] * text["linear_value_head_dim"]
    nv = text["linear_num_value_heads"]
    return n + conv_dim * text["linear_conv_kernel_dim"] + 2 * nv + text["linear_value_head_dim"]  # dt_bias, A_log


def model_parameters(text: dict) -> int:
    V, H = text["vocab_size"], text["hidden_size"]
    layers = sum(layer_parameters(text, t) for t in text["layer_types"])
    return layers + V * H * (1 if text["tie_word_embeddings"] else 2) + H


def lora_parameters(text: dict, r: int, targets: list[str]) -> int:
    n = sum(r * (i + o) for t in text["layer_types"] for name, (i, o, _) in linears(text, t).items() if name in targets)
    if "lm_head" in targets:
        n += r * (text["hidden_size"] + text["vocab_size"])
    return n


@dataclass
class Term:
    key: str
    label: str
    bytes: int
    where: str = "device"  # device | host | compare (shown, not added)
    approx: bool = False
    depth: int = 0  # 1: part of the term above


@dataclass
class MemoryEstimate:
    terms: list[Term]
    title: str

    def get(self, key: str) -> Term:
        return next(t for t in self.terms if t.key == key)

    def total(self, where: str = "device") -> int:
        return sum(t.bytes for t in self.terms if t.where == where and t.depth == 0)


def _shape(*dims: int) -> str:
    return "[" + ", ".join(f"{d:,}" for d in dims) + "]"


def adapter_terms(text: dict, layer_type: str, T: int, b: int, a: int, r: int, targets: list[str],
                  dropout: float, mask_bytes: int = 1) -> list[Term]:
    """What each adapter of one layer saves for backward: its input (a copy when peft casts it to the adapter dtype
    or drops it out, plus the dropout mask), and lora_A's [T, r] output. ``mask_bytes``: 1 on CUDA (the fused
    dropout keeps a bool mask); CPU's unfused dropout keeps it in the input's dtype (``a``)."""
    terms, shared = [], set()
    own_copy = a != b or dropout > 0
    for name, (din, _, group) in linears(text, layer_type).items():
        if name not in targets:
            continue
        if own_copy:
            n = T * din * (a + (mask_bytes if dropout > 0 else 0))
            kind = "float32" if a == 4 else f"{a}-byte"
            what = f"{_shape(T, din)} {kind} copy" + (" + dropout mask" if dropout else "")
        else:
            n = 0 if group in shared else T * din * b
            shared.add(group)
            what = f"{_shape(T, din)} input" + (" (shared with another adapter)" if n == 0 else "")
        terms.append(Term(f"lora:{name}", f"{name} adapter input {what}", n + T * r * a, depth=1))
    return terms


def mixer_term(text: dict, layer_type: str, T: int, b: int) -> Term:
    if layer_type == FULL:
        q, kv = text["num_attention_heads"] * text["head_dim"], text["num_key_value_heads"] * text["head_dim"]
        # q/k RMSNorm float32 copies; rotated q, k; attention's q, k, v, output; the output gate and its sigmoid
        per = 4 * (q + kv) + b * (5 * q + 3 * kv)
        label = "attention: q/k norms, rotary, kernel in/out, output gate"
    else:
        key = text["linear_num_key_heads"] * text["linear_key_head_dim"]
        value = text["linear_num_value_heads"] * text["linear_value_head_dim"]
        conv_dim = 2 * key + value
        # conv input and output; z, the delta-rule output, the gated norm's output; float32 WY blocks (64 per
        # value head) and the gated norm's float32 copies
        per = b * (2 * conv_dim + 3 * value) + 4 * (64 * text["linear_num_value_heads"] + 2 * value)
        label = "Gated DeltaNet: conv in/out, z, delta rule, gated norm"
    return Term("mixer", label, T * per, approx=True, depth=1)


def layer_recompute(text: dict, layer_type: str, T: int, b: int, a: int, r: int, targets: list[str],
                    dropout: float, mask_bytes: int = 1) -> list[Term]:
    """One decoder layer's saved tensors while its backward runs, plus the backward workspace."""
    H, I = text["hidden_size"], text["intermediate_size"]
    return [
        Term("mlp", f"MLP intermediates: 3 x {_shape(T, I)} (gate, SiLU(gate), up)", 3 * T * I * b, depth=1),
        *adapter_terms(text, layer_type, T, b, a, r, targets, dropout, mask_bytes),
        mixer_term(text, layer_type, T, b),
        Term("norms", f"RMSNorm float32 copies: 2 x {_shape(T, H)}", 2 * T * H * 4, approx=True, depth=1),
        Term("workspace", f"backward workspace: 2 x {_shape(T, I)} SwiGLU gradients",
             2 * T * I * b, approx=True, depth=1),
    ]


def estimate(text: dict, positions: int, targets: int, *, dtype: str = "bfloat16", adapter_dtype: str | None = None,
             lora_r: int = 8, lora_targets: list[str] = (), lora_dropout: float = 0.0, optimizer: str = "adamw",
             momentum: float = 0.0, checkpointing: bool = True, offload: bool = False, world_size: int = 1,
             continuations: int | None = None, offload_chunk_bytes: int = OFFLOAD_CHUNK_BYTES) -> MemoryEstimate:
    T, M, W = positions, targets, world_size
    H, V, L = text["hidden_size"], text["vocab_size"], text["num_hidden_layers"]
    b = DTYPE_BYTES[dtype]
    a = DTYPE_BYTES[adapter_dtype] if adapter_dtype else (4 if b == 2 else b)
    targets_list = list(lora_targets)
    checkpointing = checkpointing or offload
    sharded = f", / {W} ranks" if W > 1 else ""
    terms: list[Term] = []

    n_params = model_parameters(text)
    terms.append(Term("weights", f"base weights: {n_params / 1e9:.2f}B parameters, {dtype}{sharded}",
                      math.ceil(n_params * b / W)))
    if W > 1:
        biggest = max(layer_parameters(text, t) for t in set(text["layer_types"]))
        root = V * H * (1 if text["tie_word_embeddings"] else 2) + H
        # FSDP2 keeps the root module (embedding, lm_head) gathered from forward to backward.
        terms.append(Term("gathered", "FSDP gathered: 2 decoder layers + root (embedding, lm_head)",
                          (2 * biggest + root) * b, approx=True))
    n_lora = lora_parameters(text, lora_r, targets_list)
    states = {"adamw": 2, "sgd": 1 if momentum else 0}[optimizer]
    terms.append(Term("adapters", f"LoRA: {n_lora / 1e6:.1f}M parameters x (weight, grad, {states} optimizer states)"
                      f" x {a} bytes{sharded}", math.ceil(n_lora * a * (2 + states) / W)))

    layer_input = T * H * b
    kinds = sorted(set(text["layer_types"]))
    per_kind = {k: layer_recompute(text, k, T, b, a, lora_r, targets_list, lora_dropout) for k in kinds}
    kind = max(kinds, key=lambda k: sum(t.bytes for t in per_kind[k]))
    if offload:
        chunks = math.ceil(layer_input / offload_chunk_bytes) * offload_chunk_bytes
        terms.append(Term("checkpointed_inputs", f"checkpointed layer inputs: {L} x {_shape(T, H)} {dtype} "
                          f"({offload_chunk_bytes // 2**20} MiB chunks)", L * chunks, where="host"))
        terms.append(Term("residual", f"layer input fetched back + its gradient: 2 x {_shape(T, H)}",
                          2 * layer_input))
    elif checkpointing:
        terms.append(Term("checkpointed_inputs", f"checkpointed layer inputs: {L} x {_shape(T, H)} {dtype}",
                          L * layer_input))
        terms.append(Term("residual", f"gradient of the hidden states: {_shape(T, H)}", layer_input))
    else:
        saved = sum(sum(t.bytes for t in per_kind[k] if t.key != "workspace") for k in text["layer_types"])
        terms.append(Term("all_layers", f"saved activations of all {L} layers (no checkpointing)", saved,
                          approx=True))
    parts = per_kind[kind]
    title = "one layer's recompute" if checkpointing else "one layer's backward"
    terms.append(Term("layer_peak", f"{title} ({kind.replace('_', ' ')} layer, the larger)",
                      sum(t.bytes for t in parts), approx=True))
    terms.extend(parts)

    # the head's output, its float32 copy for the loss, and the log-softmax the loss keeps
    terms.append(Term("logits", f"target-only logits {_shape(M, V)}: {dtype} + 2 float32", M * V * (b + 4 + 4)))
    terms.append(Term("logits_full", f"not needed: logits at every position {_shape(T, V)} {dtype}", T * V * b,
                      where="compare"))
    conts = f", {continuations} continuations" if continuations is not None else ""
    return MemoryEstimate(terms, f"memory per GPU for the largest pack: {T:,} positions{conts}, {M:,} target "
                                 f"tokens; world size {W}")


def largest_unit(plan, examples, mode: str, max_positions: int | None = None) -> tuple[int, tuple[int, ...]]:
    """(prompt, example ids) of what one forward holds at most: the pack with the most positions (shared_prefix),
    or the longest single example (standalone); units over ``train.max_positions`` are skipped in training. Walked
    examples (``packing.on_overflow: walk``) hold one chunk's window at a time, so a plan's packs come first."""
    plan = dataclasses.replace(plan, packs=[p for p in plan.packs if p.walk is None] or plan.packs)
    if mode == "shared_prefix":
        units = [(p.positions, (p.prompt, p.examples)) for p in plan.packs]
    else:
        units = [(len(plan.prompts[p.prompt]) + examples[e].len_continuation, (p.prompt, (e,)))
                 for p in plan.packs for e in p.examples]
    if max_positions is not None:
        units = [u for u in units if u[0] <= max_positions]
        if not units:
            what = "pack" if mode == "shared_prefix" else "example"
            raise ValueError(f"train.max_positions={max_positions}: every {what} is longer, so training would skip "
                             "them all")
    return max(units, key=lambda u: u[0])[1]


def estimate_for_plan(cfg, plan, examples, world_size: int) -> MemoryEstimate:
    prompt, ids = largest_unit(plan, examples, cfg.packing.mode, cfg.train.max_positions)
    positions = len(plan.prompts[prompt]) + sum(examples[e].len_continuation for e in ids)
    targets = sum(len(examples[e].target_ids) for e in ids)
    return estimate(text_config(config_dict_of(cfg)), positions, targets, dtype=cfg.model.dtype,
                    lora_r=cfg.lora.r, lora_targets=cfg.lora.target_modules, lora_dropout=cfg.lora.dropout,
                    optimizer=cfg.optim.name, momentum=cfg.optim.momentum,
                    checkpointing=cfg.train.activation_checkpointing, offload=cfg.train.offload,
                    world_size=world_size, continuations=len(ids))


def format_table(est: MemoryEstimate) -> str:
    def gib(n: int) -> str:
        return f"{n / GiB:8.2f}"

    width = max(len(t.label) + 2 * t.depth for t in est.terms) + 4
    lines = [est.title, f"  {'on each GPU':<{width}}{'GiB':>8}"]
    for t in est.terms:
        if t.where == "device":
            mark = "~" if t.approx else " "
            lines.append(f"  {'  ' * t.depth}{t.label:<{width - 2 * t.depth}}{gib(t.bytes)} {mark}")
    lines.append(f"  {'total on the device':<{width}}{gib(est.total('device'))}")
    host = [t for t in est.terms if t.where == "host"]
    if host:
        lines.append(f"  {'in host memory (per rank)':<{width}}")
        lines += [f"  {t.label:<{width}}{gib(t.bytes)}" for t in host]
    for t in est.terms:
        if t.where == "compare":
            lines.append(f"  {t.label:<{width}}{gib(t.bytes)}  ({t.bytes / 1e9:.1f} GB)")
    lines.append("  ~ approximate (kernel-dependent); `packtrain smoke` measures the real peak")
    return "\n".join(lines)
