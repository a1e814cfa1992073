"""Per-example evaluation losses (packtrain/run/evaluate.py): each example's loss in packs equals transformers' own
forward on that example alone (float64, the float32 casts removed), the rows come in example order whatever the pack
order, an example over the budget is left out, and the evaluation runs in eval mode (LoRA dropout off) and restores
the model's training mode after it."""

import random

import pytest
import torch
from parity import hf_loss_tensors, without_float32_casts
from tiny_models import patched_lora_model, with_lora_dropout

from packtrain.config import config_from_dict
from packtrain.data.example import Example
from packtrain.distributed import DistInfo
from packtrain.packed.kernels import Backend
from packtrain.packed.lm import PackedLM
from packtrain.run.evaluate import evaluate, mean_loss
from packtrain.run.units import Kinds, plan_for

L, F = "linear_attention", "full_attention"


def _examples(vocab=97):
    """Two prompts taking turns, so example order is not pack order; the last example is over the token budget."""
    rng = random.Random(3)
    toks = lambda n: tuple(rng.randrange(vocab) for _ in range(n))
    prompts = [toks(6), toks(4)]
    out = [Example(f"e{i}", prompts[i % 2], toks(1 + i % 3), toks(2 + i % 2)) for i in range(5)]
    return out + [Example("long", prompts[0], toks(30), toks(3))]


@pytest.mark.parametrize("mode", ["shared_prefix", "standalone"])
def test_each_examples_loss_is_its_loss_alone_in_example_order(mode, monkeypatch):
    examples = _examples()
    cfg = config_from_dict({"packing": {"mode": mode, "token_budget": 24, "max_continuations": 2,
                                        "on_overflow": "skip"}})
    with without_float32_casts(monkeypatch):
        model = patched_lora_model([L, F], seed=2, backend=Backend(gdn="torch", attention="batched"))
        lm = PackedLM(with_lora_dropout(model, 0.5))  # evaluated in training mode, the losses would be random
        plan = plan_for(cfg, examples)
        assert [e for p in plan.packs for e in p.examples] != list(range(5))  # packed by prompt, not in order
        lm.train()
        rows = evaluate(lm, plan, examples, Kinds.named(mode), DistInfo(0, 1, 0, torch.device("cpu")))
        assert lm.training and model.training  # evaluated in eval mode, then put back
        with torch.no_grad():
            model.eval()
            alone = [hf_loss_tensors(model, ex.prefix_ids, [ex])[0].item() for ex in examples[:5]]
    assert [r["id"] for r in rows] == ["e0", "e1", "e2", "e3", "e4"]  # "long" skipped by the plan, left out
    assert [r["target_tokens"] for r in rows] == [len(ex.target_ids) for ex in examples[:5]]
    assert [r["loss"] for r in rows] == pytest.approx(alone, rel=1e-10)
    assert mean_loss(rows) == pytest.approx(sum(alone) / 5, rel=1e-10)


def test_an_evaluation_in_eval_mode_stays_in_eval_mode():
    model = patched_lora_model([L], seed=2, backend=Backend(gdn="torch", attention="batched"))
    lm = PackedLM(model)
    examples = _examples()[:2]
    cfg = config_from_dict({"packing": {"mode": "shared_prefix", "token_budget": 24}})
    lm.eval()
    rows = evaluate(lm, plan_for(cfg, examples), examples, Kinds.named("shared_prefix"),
                    DistInfo(0, 1, 0, torch.device("cpu")))
    assert len(rows) == 2 and not lm.training
