"""The cost model: what one forward and backward of a unit costs, in FLOPs, counted once for every user. The balanced
steps order packs by it (:mod:`packtrain.run.balance`), the savings' step time prices the work each saving adds with
it (:mod:`packtrain.memory.step_time`), and the bench's model FLOPs and MFU are it (:mod:`packtrain.bench.timing`).

- **per position**: 6 x the linear parameters a token meets in the decoder stack (a MoE layer: its router, shared
  expert and the ``num_experts_per_tok`` routed experts it visits): forward 2, backward 4 (the input's gradient and
  the weight's). This is the conventional count of "model FLOPs" (an MFU's numerator): under LoRA the frozen
  weights get no weight gradient, so the work a LoRA step does is nearer 4 x, and the adapters' own is small beside
  it; counting 6 x keeps the figures comparable with other trainers' and does not move the balance's order.
- **per attention pair** (a query-key pair of causal attention, :mod:`packtrain.data.attention_pairs`, per
  full-attention layer): 12 x heads x head_dim (QK^T and PV: forward 4, backward 8).
- **per head row** (a target token's logit row): 6 x hidden x vocab.

The Gated DeltaNet kernels and the norms are left out (linear in the positions with small constants). Measured
figures can replace the first two (``train.cost_per_position``, ``train.cost_per_pair``: any unit, e.g. seconds).
The balance orders packs by their positions and pairs alone: a pack's head rows (its targets) are under 1% of its
work at the 27B's shape, and counting them would reorder packs that tie on positions, so change the trajectory of a
run already planned.
"""

from __future__ import annotations

from dataclasses import dataclass

from packtrain.models.parameters import expert_shapes, linears
from packtrain.models.text_config import FULL


def layer_parameters_per_token(text: dict, kind) -> tuple[int, int]:
    """(mixer, MLP): the linear parameters one token meets in a decoder layer of ``kind`` (a MoE layer: its router,
    shared expert and ``num_experts_per_tok`` routed experts)."""
    mixer = mlp = 0
    for i, o, group in linears(text, kind).values():
        if group in ("post_norm", "mlp_product"):
            mlp += i * o
        else:
            mixer += i * o
    experts = expert_shapes(text, kind)
    if experts:  # a token meets num_experts_per_tok of them
        mlp += text["num_experts_per_tok"] * sum(i * o for _, i, o in experts.values())
    return mixer, mlp


def parameters_per_token(text: dict) -> int:
    """The linear parameters one token meets in the decoder stack."""
    return sum(sum(layer_parameters_per_token(text, k)) for k in text["kinds"])


def attention_width(text: dict) -> int:
    """heads x head_dim summed over the full-attention layers: what one query-key pair costs per multiply-add."""
    return sum(text["num_attention_heads"] * text["head_dim"] for k in text["kinds"] if k[0] == FULL)


@dataclass(frozen=True)
class CostModel:
    per_position: float
    per_pair: float
    per_head_row: float = 0.0

    @classmethod
    def of_text(cls, text: dict) -> CostModel:
        """From a text config as :func:`packtrain.models.text_config.text_config` gives it."""
        return cls(6.0 * parameters_per_token(text), 12.0 * attention_width(text),
                   6.0 * text["hidden_size"] * text["vocab_size"])

    @classmethod
    def for_config(cls, cfg) -> CostModel:
        """The model config's figures, the first two each replaced by ``train.cost_per_position`` /
        ``train.cost_per_pair``; a config without a model (``plan`` of data alone): positions are the cost."""
        from packtrain.models.text_config import config_dict_of, text_config

        t = cfg.train
        if t.cost_per_position is not None and t.cost_per_pair is not None:
            return cls(float(t.cost_per_position), float(t.cost_per_pair))
        if cfg.model.config is None and cfg.model.path is None:
            return cls(1.0 if t.cost_per_position is None else float(t.cost_per_position),
                       0.0 if t.cost_per_pair is None else float(t.cost_per_pair))
        model = cls.of_text(text_config(config_dict_of(cfg)))
        return cls(model.per_position if t.cost_per_position is None else float(t.cost_per_position),
                   model.per_pair if t.cost_per_pair is None else float(t.cost_per_pair), model.per_head_row)

    def flops(self, positions: int, pairs: int, head_rows: int = 0) -> float:
        """One forward and backward of a unit of ``positions``, ``pairs`` attention pairs per full-attention layer
        and head, and ``head_rows`` target rows through the head."""
        return self.per_position * positions + self.per_pair * pairs + self.per_head_row * head_rows

    def forward_flops(self, positions: int, pairs: int, head_rows: int = 0) -> float:
        """One forward alone: a third of :meth:`flops` (what a recompute adds)."""
        return self.flops(positions, pairs, head_rows) / 3

    def describe(self) -> str:
        return f"{self.per_position:.3g} per position + {self.per_pair:.3g} per attention pair"


def layer_forward_flops(text: dict, positions: int) -> list[float]:
    """Each decoder layer's forward over ``positions`` (its linears; attention pairs left out): what hides an
    offloaded layer input's copy (:mod:`packtrain.memory.step_time`)."""
    return [2.0 * (mixer + mlp) * positions for mixer, mlp in
            (layer_parameters_per_token(text, k) for k in text["kinds"])]


def dense_mlp_forward_flops(text: dict, positions: int) -> float:
    """The dense MLPs' forward over ``positions``: what running the MLP in recomputed tiles adds."""
    from packtrain.models.text_config import DENSE

    return 2.0 * sum(layer_parameters_per_token(text, k)[1] for k in text["kinds"] if k[1] == DENSE) * positions
