"""GRPO-family updates on scored completions: the math of ``train.objective: grpo`` (packtrain.run.objective.Grpo).

A *group* is one item's K completions, each with a reward. The update follows TRL's GRPOTrainer where its names
exist (``loss_type``, ``importance_sampling_level``, ``scale_rewards``, ``epsilon``, ``epsilon_high``, ``beta``):

- advantages per group: ``A = r - mean(r)``, under ``scale_rewards: group`` divided by the group's standard
  deviation as ``torch.std`` computes it (Bessel-corrected) ``+ 1e-4``; a group whose rewards are all equal has
  advantage 0 (its completions still count in the normalisation and the KL);
- the importance ratio of each completion token against the policy that sampled it (``old``: the sampling
  engine's log-probabilities, or the current ones detached, on-policy), per token or (``sequence``, GSPO) as
  ``exp`` of the completion's mean log-ratio;
- the token term: ``-min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A)``, or under ``cispo``
  ``-min(ratio, epsilon_high).detach() A log p`` (TRL's cap: ``epsilon_high`` is the ratio's ceiling itself);
  plus ``beta`` times the k3 estimate of the KL to the reference, ``exp(ref - log p) - (ref - log p) - 1``;
- the step's loss: under ``grpo`` the mean over the step's completions of each one's token mean; ``dr_grpo`` the
  sum over the step's tokens / (completions x ``max_completion_length``); ``dapo`` and ``cispo`` the sum over the
  step's tokens / the step's token count. Each is a sum over completions of a weight times the completion's summed
  token terms (:func:`completion_weights`), so a unit's part of it needs only the step's counts, and the step's
  loss is the same whatever its split into packs, units and ranks.

``spec`` is the update's settings, :class:`packtrain.run.objective.RlSpec` (defined there, without torch, so that
``plan`` reads the objective without importing this module).

Completions lie as in a packed layout's targets: their token rows together, completion after completion
(``lengths`` gives each one's count).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

STD_EPSILON = 1e-4  # TRL's, added to the group's standard deviation


def group_advantages(rewards: Sequence[float], scale: str = "group") -> torch.Tensor:
    """One group's advantages in float64: ``r - mean(r)``, divided under ``group`` by ``std(r) + 1e-4``."""
    r = torch.tensor([float(x) for x in rewards], dtype=torch.float64)
    if r.numel() < 2:
        raise ValueError(f"a group needs 2 or more completions to compare (it has {r.numel()})")
    advantages = r - r.mean()
    if scale == "group":
        advantages = advantages / (r.std() + STD_EPSILON)
    return advantages


def completion_weights(lengths: Sequence[int], spec, step_completions: int, step_tokens: int,
                       longest: int | None = None) -> torch.Tensor:
    """Each completion's weight in the step's loss (float64, [n]): what its summed token terms are multiplied by.
    ``step_completions`` and ``step_tokens`` count the whole step (every pack on every rank); ``longest`` is
    dr_grpo's length where ``rl.max_completion_length`` is not set."""
    n = torch.tensor([float(x) for x in lengths], dtype=torch.float64)
    if spec.loss_type == "grpo":
        return 1.0 / (step_completions * n)
    if spec.loss_type == "dr_grpo":
        length = spec.max_completion_length or longest
        if not length:
            raise ValueError("rl.loss_type dr_grpo: needs rl.max_completion_length (or the step's longest)")
        return torch.full_like(n, 1.0 / (step_completions * length))
    return torch.full_like(n, 1.0 / step_tokens)


@dataclass
class TokenTerms:
    """What :func:`token_terms` returns: each token's term with its gradient [M], and figures without it."""
    loss: torch.Tensor  # [M]
    ratio: torch.Tensor  # [M] detached: the importance ratio each token's term used
    clipped: torch.Tensor  # [M] bool: the clip (or cispo's cap) took the token's gradient
    kl: torch.Tensor | None  # [M] detached k3 estimate, None without a reference


def token_terms(logp: torch.Tensor, lengths: torch.Tensor, advantages: torch.Tensor, spec,
                old_logp: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None) -> TokenTerms:
    """The token terms of completions laid one after another: ``logp`` [M] the policy's log-probabilities of the
    sampled tokens (with gradient), ``lengths`` [n] each completion's token count, ``advantages`` [n]; ``old_logp``
    [M] the sampling policy's (None: on-policy, the current ones detached); ``ref_logp`` [M] the reference's (needed
    when ``spec.beta`` > 0)."""
    old = logp.detach() if old_logp is None else old_logp.to(logp.dtype)
    log_ratio = logp - old
    if spec.importance_sampling_level == "sequence":
        mean = torch.segment_reduce(log_ratio, "sum", lengths=lengths, axis=0) / lengths.to(logp.dtype)
        log_ratio = mean.repeat_interleave(lengths)
    ratio = torch.exp(log_ratio)
    a = advantages.to(logp.dtype).repeat_interleave(lengths)
    if spec.loss_type == "cispo":
        capped = torch.clamp(ratio, max=spec.high).detach()
        loss = -capped * a * logp
        clipped = (ratio.detach() > spec.high) & (a > 0)
    else:
        bounded = torch.clamp(ratio, 1 - spec.epsilon, 1 + spec.high)
        loss = -torch.min(ratio * a, bounded * a)
        r = ratio.detach()
        clipped = ((r < 1 - spec.epsilon) & (a < 0)) | ((r > 1 + spec.high) & (a > 0))
    kl = None
    if spec.beta:
        if ref_logp is None:
            raise ValueError("rl.beta > 0 needs the reference's log-probabilities")
        delta = ref_logp.to(logp.dtype) - logp
        k3 = torch.exp(delta) - delta - 1
        loss = loss + spec.beta * k3
        kl = k3.detach()
    return TokenTerms(loss, ratio.detach(), clipped, kl)


def unit_loss(terms: TokenTerms, lengths: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The unit's part of the step's loss: each completion's summed token terms (in sequence: the same bits on every
    run) times its weight (:func:`completion_weights`), summed."""
    sums = torch.segment_reduce(terms.loss, "sum", lengths=lengths, axis=0)
    return (sums * weights.to(sums.dtype)).sum()
