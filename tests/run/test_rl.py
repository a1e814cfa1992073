"""The GRPO-family math (packtrain/run/rl.py) against a reference written from TRL's formulas in TRL's own layout:
completions padded to [B, L] with a mask, the loss aggregated over the whole step at once. packtrain's form lays
completions one after another and splits the step into units; both must give the same loss and gradient, in
float64, for every loss type, importance level, with and without the sampler's log-probabilities and a KL term."""

import itertools

import pytest
import torch

from packtrain.run.objective import RlSpec
from packtrain.run.rl import completion_weights, group_advantages, token_terms, unit_loss

LENGTHS = [5, 3, 7, 4, 6, 2]  # two groups of three completions
REWARDS = [[1.0, 0.0, 0.5], [0.2, 0.2, 0.9]]


def _trl_loss(logp_rows, old_rows, ref_rows, advantages, spec: RlSpec, max_len: int) -> torch.Tensor:
    """TRL's GRPOTrainer._compute_loss on padded [B, L] tensors (its formulas, written out here)."""
    B, L = len(logp_rows), max(len(r) for r in logp_rows)
    pad = lambda rows: torch.stack([torch.cat([r, r.new_zeros(L - len(r))]) for r in rows])
    mask = pad([torch.ones(len(r), dtype=torch.float64) for r in logp_rows])
    logp, old = pad(logp_rows), pad(old_rows)
    log_ratio = logp - old
    if spec.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    a = advantages.unsqueeze(1)
    if spec.loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=spec.high).detach() * a * logp
    else:
        coef_2 = torch.clamp(coef_1, 1 - spec.epsilon, 1 + spec.high)
        per_token = -torch.min(coef_1 * a, coef_2 * a)
    if spec.beta:
        ref = pad(ref_rows)
        per_token = per_token + spec.beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if spec.loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if spec.loss_type == "dr_grpo":
        return (per_token * mask).sum() / (B * max_len)
    return (per_token * mask).sum() / mask.sum()


def _case(seed: int, off_policy: bool):
    g = torch.Generator().manual_seed(seed)
    logp = [-(torch.rand(n, generator=g, dtype=torch.float64) * 3) for n in LENGTHS]
    # the sampler's log-probabilities, far enough from the policy's that ratios leave [0.8, 1.2] both ways
    old = [r + (torch.rand(len(r), generator=g, dtype=torch.float64) - 0.5) for r in logp] if off_policy else \
        [r.clone() for r in logp]
    ref = [r + (torch.rand(len(r), generator=g, dtype=torch.float64) - 0.5) * 0.6 for r in logp]
    return logp, old, ref


@pytest.mark.parametrize("loss_type,level,off_policy,beta", list(itertools.product(
    ["grpo", "dr_grpo", "dapo", "cispo"], ["token", "sequence"], [False, True], [0.0, 0.04])))
def test_packed_terms_over_two_units_equal_trls_padded_step(loss_type, level, off_policy, beta):
    spec = RlSpec(loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_high=0.28,
                  max_completion_length=9)
    logp_rows, old_rows, ref_rows = _case(0, off_policy)
    advantages = torch.cat([group_advantages(r) for r in REWARDS])

    leaves = [r.clone().requires_grad_() for r in logp_rows]
    reference = _trl_loss(leaves, old_rows, ref_rows, advantages, spec, max_len=9)
    reference.backward()

    mine = [r.clone().requires_grad_() for r in logp_rows]
    total = torch.zeros((), dtype=torch.float64)
    weights = completion_weights(LENGTHS, spec, step_completions=len(LENGTHS), step_tokens=sum(LENGTHS))
    for unit in ([0, 1, 2], [3, 4, 5]):  # one group per unit, as the planner keeps a group in one pack
        lengths = torch.tensor([LENGTHS[i] for i in unit])
        terms = token_terms(torch.cat([mine[i] for i in unit]), lengths, advantages[unit], spec,
                            old_logp=torch.cat([old_rows[i] for i in unit]) if off_policy else None,
                            ref_logp=torch.cat([ref_rows[i] for i in unit]))
        total = total + unit_loss(terms, lengths, weights[unit])
    total.backward()
    torch.testing.assert_close(total, reference.detach(), rtol=1e-12, atol=1e-14)
    for a, b in zip(mine, leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-13)
    assert any(l.grad.abs().sum() > 0 for l in mine)  # the case has a gradient to compare


def test_the_off_policy_case_clips_both_ways():
    """The reference comparison above is only as good as its case: off-policy, some tokens' ratios leave the clip
    range on each side where the advantage makes the clip bind."""
    spec = RlSpec(loss_type="dapo", epsilon_high=0.28)
    logp_rows, old_rows, _ = _case(0, True)
    advantages = torch.cat([group_advantages(r) for r in REWARDS])
    terms = token_terms(torch.cat(logp_rows), torch.tensor(LENGTHS), advantages, spec, old_logp=torch.cat(old_rows))
    a = advantages.repeat_interleave(torch.tensor(LENGTHS))
    assert ((terms.ratio > 1.28) & (a > 0)).any() and ((terms.ratio < 0.8) & (a < 0)).any()
    assert terms.clipped.sum() > 0


def test_group_advantages_are_trls():
    r = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)
    expected = (r - r.mean()) / (r.std(unbiased=True) + 1e-4)
    torch.testing.assert_close(group_advantages(r.tolist()), expected)
    torch.testing.assert_close(group_advantages(r.tolist(), "none"), r - r.mean())
    assert group_advantages([0.5, 0.5, 0.5]).eq(0).all()  # equal rewards: no signal, and no division by zero
    with pytest.raises(ValueError, match="2 or more"):
        group_advantages([1.0])


def test_on_policy_gradient_raises_the_better_completions_log_probability():
    """On-policy the ratio is 1 with gradient: d loss / d log p = -A x weight, so a completion with a positive
    advantage is pushed up (a sign flip of the advantage fails here)."""
    spec = RlSpec(loss_type="grpo")
    logp = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([2, 2])
    advantages = group_advantages([1.0, 0.0])
    unit_loss(token_terms(logp, lengths, advantages, spec), lengths,
              completion_weights([2, 2], spec, 2, 4)).backward()
    assert (logp.grad[:2] < 0).all() and (logp.grad[2:] > 0).all()


def test_the_kl_term_pulls_toward_the_reference():
    """k3 = exp(ref - log p) - (ref - log p) - 1: zero at the reference, and its gradient pushes log p toward it from
    either side (the terms on the wrong side, exp(log p - ref), push the other way for log p above it)."""
    spec = RlSpec(loss_type="dapo", beta=1.0)
    logp = torch.tensor([-1.0, -3.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-2.0, -2.0], dtype=torch.float64)
    lengths = torch.tensor([2])
    terms = token_terms(logp, lengths, torch.zeros(1, dtype=torch.float64), spec, ref_logp=ref)
    unit_loss(terms, lengths, completion_weights([2], spec, 1, 2)).backward()
    assert logp.grad[0] > 0 and logp.grad[1] < 0  # above the reference: pushed down; below: up
    assert token_terms(ref.clone(), lengths, torch.zeros(1, dtype=torch.float64), spec,
                       ref_logp=ref).kl.abs().max() == 0


def test_unknown_settings_are_refused_naming_the_key():
    with pytest.raises(ValueError, match="rl.loss_type: 'ppo'"):
        RlSpec(loss_type="ppo")
    with pytest.raises(ValueError, match="rl.importance_sampling_level"):
        RlSpec(importance_sampling_level="group")
