"""An evaluation's figures per objective (packtrain/run/eval_figures.py). Under dpo, the per-pair margins, the reward
accuracy and margin and the DPO loss of a packed evaluation (tree and shared_prefix) equal a hand computation from
transformers' own forward on each pair's two sequences alone, with the adapter (the policy) and with it disabled
(the reference), in float64. Under weighted, the weighted mean loss beside the plain one.

Float64 with the float32 casts removed; log-probabilities agree to about 1e-15 relative, bound 1e-10."""

import math
import random

import pytest
import torch
from parity import peft_lora_forward, transformers_mlp, without_float32_casts
from tiny_models import patched_lora_model

from packtrain.config import config_from_dict
from packtrain.data.example import Example
from packtrain.distributed import DistInfo
from packtrain.packed.kernels import Backend
from packtrain.packed.lm import PackedLM
from packtrain.run import reference
from packtrain.run.eval_figures import describe, figures
from packtrain.run.evaluate import evaluate
from packtrain.run.objective import Dpo, Objective, Sft, Weighted
from packtrain.run.units import Kinds, plan_for

L, F = "linear_attention", "full_attention"
BETA = 0.7


def _pairs(n_pairs=4, seed=0, vocab=97):
    """Pairs sharing one P, each of an item and two answers (the rejected one of another length); every pair weight
    1 but the last (2.5)."""
    rng = random.Random(seed)
    toks = lambda n: tuple(rng.randrange(vocab) for _ in range(n))  # noqa: E731
    prefix, out = toks(7), []
    for k in range(n_pairs):
        item, weight = toks(2 + k % 2), 2.5 if k == n_pairs - 1 else 1.0
        for side, answer in (("chosen", toks(3)), ("rejected", toks(2 + k % 3))):
            out.append(Example(f"q{k}:{side}", prefix, item, answer, weight=weight, pair=f"q{k}", side=side))
    return out


def _summed_log_prob(model, ex) -> float:
    """transformers' forward on concat(P, item, answer) alone: the answer's summed token log-probability."""
    ids = torch.tensor([list(ex.prefix_ids) + list(ex.item_ids) + list(ex.target_ids)])
    logp = model(input_ids=ids).logits[0].to(torch.float64).log_softmax(-1)
    start = len(ex.prefix_ids) + len(ex.item_ids)
    return float(sum(logp[t - 1, ids[0, t]] for t in range(start, ids.shape[1])))


@pytest.mark.parametrize("mode", ["tree", "shared_prefix"])
def test_pair_figures_equal_a_hand_computation_on_each_sequence_alone(mode, monkeypatch):
    examples = _pairs()
    cfg = config_from_dict({"train": {"objective": "dpo", "dpo_beta": BETA},
                            "packing": {"mode": mode, "token_budget": 4096, "max_continuations": 8}})
    objective = Objective.of(cfg)
    info = DistInfo(0, 1, 0, torch.device("cpu"))
    with without_float32_casts(monkeypatch):
        model = patched_lora_model([L, F], seed=5, backend=Backend(gdn="torch", attention="batched"))
        lm, kinds, plan = PackedLM(model), Kinds.named(mode, objective=objective), plan_for(cfg, examples)
        rows = evaluate(lm, plan, examples, kinds, info)
        table = reference.compute(lm, plan, examples, kinds, info)
        pairs, summary = figures(objective, rows, examples, table)
        with torch.no_grad(), peft_lora_forward(model), transformers_mlp(model):
            policy = {ex.id: _summed_log_prob(model, ex) for ex in examples}
            with model.disable_adapter():
                ref = {ex.id: _summed_log_prob(model, ex) for ex in examples}
    assert [p["id"] for p in pairs] == ["q0", "q1", "q2", "q3"]
    losses, margins = [], []
    for p in pairs:
        lc, lr, rc, rr = policy[p["chosen"]], policy[p["rejected"]], ref[p["chosen"]], ref[p["rejected"]]
        assert (p["chosen"], p["rejected"]) == (f"{p['id']}:chosen", f"{p['id']}:rejected")
        assert p["policy_margin"] == pytest.approx(lc - lr, rel=1e-10, abs=1e-12)
        assert p["reference_margin"] == pytest.approx(rc - rr, rel=1e-10, abs=1e-12)
        assert p["policy_margin"] != pytest.approx(p["reference_margin"], rel=1e-3)  # the adapter matters
        margin = BETA * ((lc - rc) - (lr - rr))
        weight = 2.5 if p["id"] == "q3" else 1.0
        assert p["reward_margin"] == pytest.approx(margin, rel=1e-10, abs=1e-12)
        assert p["correct"] == (margin > 0)
        assert p["loss"] == pytest.approx(weight * math.log1p(math.exp(-margin)), rel=1e-10)
        losses.append(weight * math.log1p(math.exp(-margin)))
        margins.append(margin)
    assert summary["pairs"] == 4 and summary["examples"] == 8
    assert summary["reward_accuracy"] == sum(m > 0 for m in margins) / 4
    assert summary["reward_margin"] == pytest.approx(sum(margins) / 4, rel=1e-10)
    assert summary["loss"] == pytest.approx(sum(losses) / 4, rel=1e-10)
    assert describe(summary).startswith(f"dpo loss {sum(losses) / 4:.4f}, reward accuracy "
                                        f"{sum(m > 0 for m in margins) / 4:.2f}")


def test_an_evaluation_on_pairs_refuses_half_a_pair_and_a_missing_reference():
    examples = _pairs(2)
    rows = [{"id": ex.id, "loss": 1.0, "target_tokens": len(ex.target_ids)} for ex in examples]
    with pytest.raises(RuntimeError, match="needs the reference"):
        figures(Dpo(), rows, examples)
    with pytest.raises(RuntimeError, match="without its pair's other answer"):
        figures(Dpo(), rows[:3], examples, {r["id"]: -1.0 for r in rows})


def test_weighted_reports_the_weighted_mean_beside_the_plain_one():
    examples = [Example("a", (1,), (2,), (3,), weight=-0.5), Example("b", (1,), (2,), (4,), weight=2.0),
                Example("c", (1,), (2,), (5,))]
    rows = [{"id": "a", "loss": 1.5, "target_tokens": 1}, {"id": "b", "loss": 0.25, "target_tokens": 1},
            {"id": "c", "loss": 3.0, "target_tokens": 1}]
    written, summary = figures(Weighted(), rows, examples)
    assert [r["weight"] for r in written] == [-0.5, 2.0, 1.0]
    assert summary == {"loss": (1.5 + 0.25 + 3.0) / 3, "examples": 3, "weighted_loss": (-0.75 + 0.5 + 3.0) / 3}
    assert describe(summary) == f"loss {(1.5 + 0.25 + 3.0) / 3:.4f} (weighted {2.75 / 3:.4f}) over 3 examples"
    plain, summary = figures(Sft(), rows, examples)
    assert plain == rows and summary == {"loss": (1.5 + 0.25 + 3.0) / 3, "examples": 3}


def test_a_tie_counts_half_so_the_policy_equal_to_its_reference_scores_chance():
    """A pair whose reward margin is exactly 0 counts one half of the reward accuracy (TRL counts it 0): at step 0,
    where the policy is the reference, every pair ties and the accuracy is 0.5."""
    examples = _pairs(3)
    rows = [{"id": ex.id, "loss": 0.5 + k / 8, "target_tokens": len(ex.target_ids)} for k, ex in enumerate(examples)]
    at_step_0 = {r["id"]: -r["loss"] * r["target_tokens"] for r in rows}  # the reference = the policy
    pairs, summary = figures(Dpo(), rows, examples, at_step_0)
    assert [p["reward_margin"] for p in pairs] == [0.0, 0.0, 0.0] and not any(p["correct"] for p in pairs)
    assert summary["reward_accuracy"] == 0.5
    # one pair the chosen side wins (its reference lower), one it loses, one tie: (1 + 0 + 1/2) / 3
    ref = dict(at_step_0)
    ref[pairs[0]["chosen"]] -= 1.0
    ref[pairs[1]["chosen"]] += 1.0
    pairs, summary = figures(Dpo(), rows, examples, ref)
    assert [p["correct"] for p in pairs] == [True, False, False]
    assert summary["reward_accuracy"] == pytest.approx(1.5 / 3, rel=1e-15)
