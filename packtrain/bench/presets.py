"""Benchmark presets: a packtrain config (as a dict) plus the shape of the generated data.

A preset is what ``packtrain bench --preset NAME`` runs without a config file. Generated data is random token ids
(no tokenizer): ``prompts`` prompts of ``prefix_tokens`` tokens, each shared by ``continuations`` continuations
whose lengths are drawn uniformly from ``cont_tokens`` (inclusive); the target is the second half of each.

- ``tiny``: the CI smoke (a 3-layer model of hidden 32), small enough for every test run.
- ``cpu``: a 4-layer hybrid of hidden 256 (3 Gated DeltaNet + 1 attention), float32, one P of 2,048 tokens with
  16 continuations of 56-72 tokens: one pack, one optimizer step, position ratio 11.0 (its run time and results:
  docs/performance.md, "Shared-prefix vs standalone vs a plain transformers + peft loop"). Its memory savings are
  left auto, as a user's config leaves them: chosen for this machine's memory (packtrain/memory/savings.py).
- ``gpu``: Qwen3.6-27B's layer shapes with 4 layers (3 GDN + 1 attention), random init, bf16, fla kernels,
  checkpointed layers, one P of 32,768 tokens with 16 continuations of 768-1,280 tokens (ratio ~11).
- ``tree``: the ``cpu`` model on multi-turn data trained under ``data.train_on: each``: one P of 2,048 tokens, 4
  conversations of 8-24 turns of 56-72 tokens, every turn an example whose item is the whole history before its
  answer; variants tree, shared_prefix and standalone, each one optimizer step per epoch (every pack in it), so
  that the three make the same update (docs/performance.md, "Prefix trees").
- ``dpo``: the ``cpu`` model under ``train.objective: dpo`` (``dpo_reference: per_step``: each unit's no-grad
  reference forward, the adapter disabled, is timed with it) on preference pairs: one P of 1,024 tokens, 8 pairs,
  each an item and two answers (chosen, rejected) sharing P and the item; variants tree (P once, each pair's item
  once), shared_prefix (P once, a pair two continuations) and standalone (a pair alone, two sequences), each one
  optimizer step per epoch. It shows the tree's speedup over standalone pairs beside their position ratio.
- ``rl``: the ``cpu`` model under ``train.objective: grpo`` (rl's defaults: dapo, no KL) on scored groups: one P of
  2,048 tokens, 4 items each with K = 8 sampled completions (rewards 0 or 1, drawn); variants tree (P once, each
  item once), shared_prefix (P once, each completion with its item) and standalone (each completion alone: what
  standalone GRPO computes), each one optimizer step per epoch.

With ``turns``, each of a prompt's ``continuations`` is a conversation of that many turns (drawn uniformly), each
turn ``cont_tokens`` long (its first half the user's, its second the answer): turn k is an example whose item is
turns 0..k-1 and turn k's first half, and whose target is turn k's answer, as ``each`` makes them. With ``pairs``,
each continuation is a preference pair: an item of the first half of its ``cont_tokens`` and two answers (chosen,
rejected) of the second half's length each, other random tokens; with ``group`` K, a scored group: the item and K
completions of that length each, rewarded 0 or 1 at random (a group of equal rewards redrawn).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, replace

from packtrain.data.jsonl import Example

L, F = "linear_attention", "full_attention"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "in_proj_qkv", "in_proj_z", "out_proj"]


@dataclass(frozen=True)
class Shape:
    prompts: int
    prefix_tokens: int
    continuations: int  # per prompt
    cont_tokens: tuple[int, int]  # (shortest, longest) continuation, item + target
    # more continuations per prompt, (count, shortest, longest) each: e.g. one long one among short ones
    extra: tuple[tuple[int, int, int], ...] = ()
    turns: tuple[int, int] | None = None  # (fewest, most) turns per conversation; None: one turn each
    pairs: bool = False  # each continuation a preference pair (an item and two answers)
    group: int = 0  # > 0: each continuation a scored group of that many completions (an item and K answers)

    def describe(self) -> str:
        def lengths(lo, hi):
            return f"{lo}" if lo == hi else f"{lo}-{hi}"

        more = "".join(f" + {n} of {lengths(lo, hi)}" for n, lo, hi in self.extra)
        if self.turns is not None:
            return (f"{self.prompts} prompt(s) of {self.prefix_tokens:,} tokens x {self.continuations} conversations "
                    f"of {lengths(*self.turns)} turns of {lengths(*self.cont_tokens)} tokens{more}, every turn an "
                    "example")
        if self.group:
            return (f"{self.prompts} prompt(s) of {self.prefix_tokens:,} tokens x {self.continuations} scored groups "
                    f"of {self.group} completions, each item + completion {lengths(*self.cont_tokens)} tokens{more}")
        if self.pairs:
            return (f"{self.prompts} prompt(s) of {self.prefix_tokens:,} tokens x {self.continuations} preference "
                    f"pairs of {lengths(*self.cont_tokens)} tokens (an item and two answers of half that each){more}")
        return (f"{self.prompts} prompt(s) of {self.prefix_tokens:,} tokens x {self.continuations} continuations "
                f"of {lengths(*self.cont_tokens)} tokens{more}")


@dataclass(frozen=True)
class Preset:
    name: str
    config: dict  # a packtrain config tree (model, packing, lora, optim, train); data comes from `shape`
    shape: Shape
    repeats: int
    warmup: bool  # one untimed step of every variant (CUDA: Triton autotuning, FlexAttention compile; CPU: the heap)
    # the variants run when --variants is not given (None: every variant but tree, whose data must share histories)
    variants: tuple[str, ...] | None = None
    # torch CPU threads (None: torch's choice). The CPU presets use one: on a 2-core machine that others share, a
    # 2-thread OpenMP team waits on whichever thread is descheduled, and epochs slow down many times over,
    # erratically (docs/performance.md, "One thread").
    threads: int | None = None


def _rope(partial: float, section: list[int]) -> dict:
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial,
            "mrope_section": section, "mrope_interleaved": True}


def _config(model: dict, dtype: str, kernels: str, budget: int, checkpointing: bool | str = "auto",
            device: str = "auto", packs_per_step: int = 1) -> dict:
    return {
        "model": {"config": model, "seed": 0, "dtype": dtype, "kernels": kernels},
        "packing": {"mode": "shared_prefix", "token_budget": budget, "max_continuations": 90},
        # Dropout off: with it, P's single dropout draw per pack differs from standalone draws (docs/design.md).
        # Adapters in every layer's mixer too: with the default targets the first GDN layer holds none, so the
        # plain loop skips its backward while packtrain (apply_lora marks the embedding output as needing a
        # gradient) runs it: a quarter of the GDN backward in a 4-layer model, 1/48 in Qwen3.6-27B.
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": LORA_TARGETS},
        "optim": {"name": "adamw", "lr": 1.0e-3, "warmup_steps": 0, "schedule": "constant"},
        "train": {"packs_per_step": packs_per_step, "seed": 0, "activation_checkpointing": checkpointing,
                  "device": device},
        "logging": {"progress": False},
    }


def _grpo(config: dict) -> dict:
    """``config`` under train.objective grpo (rl's defaults: dapo, on-policy, no KL term)."""
    config["train"] |= {"objective": "grpo"}
    config["packing"] |= {"max_continuations": 90}
    return config


def _dpo(config: dict) -> dict:
    """``config`` under train.objective dpo, the reference a no-grad forward of each unit (timed with its step)."""
    config["train"] |= {"objective": "dpo", "dpo_reference": "per_step"}
    return config


TINY_MODEL = {
    "model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 3, "layer_types": [L, F, L], "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "tie_word_embeddings": False, "rope_parameters": _rope(0.5, [2, 1, 1]),
    # weights large enough that the output depends on the input: at the default 0.02 every variant's loss was
    # ln(512) to float32 rounding, and the smoke's "equal losses" could not tell them apart
    "initializer_range": 0.2,
}

# A CPU-sized hybrid (hidden 256) with 4 layers, 3 GDN : 1 attention as in Qwen3.6, so that three interleaved
# repeats of every variant stay short on a CPU. The vocabulary keeps lm_head near its share of a real model's weights
# (Qwen3.6-27B: ~5% of the 64 layers'; here ~8% of 4 layers').
CPU_MODEL = {
    "model_type": "qwen3_5_text", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 768,
    "num_hidden_layers": 4, "layer_types": [L, L, L, F], "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "tie_word_embeddings": False, "rope_parameters": _rope(0.25, [4, 2, 2]),
}

# Qwen3.6-27B's text config (configs/qwen3.6-27b.yaml) cut to 4 layers.
GPU_MODEL = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
    "num_hidden_layers": 4, "layer_types": [L, L, L, F], "num_attention_heads": 24, "num_key_value_heads": 4,
    "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1.0e-6,
    "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "rope_parameters": {**_rope(0.25, [11, 11, 10]), "rope_theta": 10000000.0},
}

# the datasheet peak; a measured one goes in --peak-tflops (docs/performance.md, "GPU preset")
H100_BF16_DENSE_TFLOPS = 989.0
H100_SOURCE = "H100/H200 SXM bf16 dense datasheet figure"

PRESETS = {
    "tiny": Preset("tiny", _config(TINY_MODEL, "float32", "torch", 1024), Shape(2, 96, 6, (8, 16)), repeats=2,
                   warmup=True, threads=1),
    "cpu": Preset("cpu", _config(CPU_MODEL, "float32", "torch", 8192), Shape(1, 2048, 16, (56, 72)),
                  repeats=3, warmup=True, threads=1),
    "gpu": Preset("gpu", _config(GPU_MODEL, "bfloat16", "fla", 65536, checkpointing=True, device="cuda"),
                  Shape(1, 32768, 16, (768, 1280)), repeats=3, warmup=True),
    # one step per epoch: the tree planner's packs are not shared_prefix's, so only then do all three variants make
    # the same update (and end at the same loss)
    "tree": Preset("tree", _config(CPU_MODEL, "float32", "torch", 8192, packs_per_step=64),
                   Shape(1, 2048, 4, (56, 72), turns=(8, 24)), repeats=3, warmup=True,
                   variants=("tree", "shared_prefix", "standalone"), threads=1),
    "dpo": Preset("dpo", _dpo(_config(CPU_MODEL, "float32", "torch", 8192, packs_per_step=64)),
                  Shape(1, 1024, 8, (56, 72), pairs=True), repeats=3, warmup=True,
                  variants=("tree", "shared_prefix", "standalone"), threads=1),
    "rl": Preset("rl", _grpo(_config(CPU_MODEL, "float32", "torch", 8192, packs_per_step=64)),
                 Shape(1, 2048, 4, (56, 72), group=8), repeats=3, warmup=True,
                 variants=("tree", "shared_prefix", "standalone"), threads=1),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"--preset: unknown preset {name!r} (known: {', '.join(PRESETS)})")
    preset = PRESETS[name]
    return replace(preset, config=copy.deepcopy(preset.config))


def generate_examples(shape: Shape, vocab: int, seed: int = 0) -> list[Example]:
    """Random token ids in [1, vocab) for the shape; the same seed gives the same examples."""
    ranges = [(shape.continuations, *shape.cont_tokens), *shape.extra]
    turns_ok = shape.turns is None or 1 <= shape.turns[0] <= shape.turns[1]
    if shape.prompts < 1 or shape.prefix_tokens < 1 or not all(n >= 1 and 2 <= lo <= hi for n, lo, hi in ranges) \
            or not turns_ok:
        raise ValueError(f"bench data shape: need at least 1 prompt, 1 continuation, a prefix of 1 token, "
                         f"continuations of at least 2 tokens (item + target) and conversations of at least 1 "
                         f"turn; got {shape}")
    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(1, vocab) for _ in range(n))

    examples = []
    for p in range(shape.prompts):
        prefix = tokens(shape.prefix_tokens)
        bounds = [(lo, hi) for count, lo, hi in ranges for _ in range(count)]
        for c, (lo, hi) in enumerate(bounds):
            if shape.group:
                n = rng.randint(lo, hi)
                item, rewards = tokens(n - n // 2), [0.0]
                while len(set(rewards)) < 2:
                    rewards = [float(rng.random() < 0.5) for _ in range(shape.group)]
                examples += [Example(f"p{p}-c{c}:{k}", prefix, item, tokens(n // 2), group=f"p{p}-c{c}",
                                     reward=rewards[k], group_rewards=tuple(rewards)) for k in range(shape.group)]
                continue
            if shape.pairs:
                n = rng.randint(lo, hi)
                item = tokens(n - n // 2)
                examples += [Example(f"p{p}-c{c}:{side}", prefix, item, tokens(n // 2), pair=f"p{p}-c{c}", side=side)
                             for side in ("chosen", "rejected")]
                continue
            if shape.turns is None:
                n = rng.randint(lo, hi)
                item = tokens(n - n // 2)
                examples.append(Example(f"p{p}-c{c}", prefix, item, tokens(n // 2)))
                continue
            history: tuple[int, ...] = ()
            for t in range(rng.randint(*shape.turns)):
                n = rng.randint(lo, hi)
                user, answer = tokens(n - n // 2), tokens(n // 2)
                examples.append(Example(f"p{p}-c{c}-t{t}", prefix, history + user, answer))
                history += user + answer
    return examples
