"""The training objective (``train.objective``): what a unit's loss is, made of its examples' target
cross-entropies, and what the step divides the loss by.

===========  ======================================================================  ==========================
objective    a unit's loss                                                           the step's mean is over
===========  ======================================================================  ==========================
sft          sum of each example's mean target cross-entropy                         its examples
weighted     sum of ``weight`` times each example's mean target cross-entropy        its examples
dpo          per preference pair, ``-log sigmoid(beta * ((lc - rc) - (lr - rr)))``   its pairs
grpo         per completion, its weight times its summed token terms (``rl``)        its completions, or tokens
===========  ======================================================================  ==========================

Under dpo, ``l`` is an answer's summed token log-probability under the policy (``lc`` chosen, ``lr`` rejected) and
``r`` under the reference, the base model: the same packed forward with the adapter disabled, without gradient.
``dpo_loss_type: ipo`` takes ``(m - 1 / (2 beta))^2`` with ``m`` the same margin of per-token mean
log-probabilities (TRL's IPO). ``rpo_alpha`` adds ``rpo_alpha`` times the chosen answer's mean target
cross-entropy to each pair's loss (TRL's ``rpo_alpha``, RPO's NLL term, arXiv 2404.19733). A pair's two answers are
always in one unit (the planners keep them in one pack), so a unit's loss is a sum over its pairs and the step's mean
over pairs holds on any split into packs, units or ranks.

The reference comes from a table computed before training (``dpo_reference: precompute``,
:mod:`packtrain.run.reference`), or from a no-grad forward of each unit just before its training forward
(``per_step``: the unit then issues twice its calls).

Under grpo (:mod:`packtrain.run.rl`), each completion of a scored group is an example, its advantage from its group's
rewards, its token terms from its tokens' log-probabilities (the ratio against the sampler's ``logprobs`` where the
data has them, else the current ones detached), and its weight ``1 / its tokens`` (``rl.loss_type`` grpo), ``1 /
rl.max_completion_length`` (dr_grpo) or 1 (dapo, cispo); the step divides by its completions (grpo, dr_grpo) or its
tokens (dapo, cispo). A completion's loss needs nothing of its siblings but their rewards, so any split holds.

What an objective is needs no torch (``plan`` reads it); the losses import it where they run.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from packtrain.data.preference import pair_examples

if TYPE_CHECKING:
    import torch

    from packtrain.config import Config
    from packtrain.packed.loss import LossOutput

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "cispo")
LEVELS = ("token", "sequence")
SCALES = ("group", "none")


@dataclass(frozen=True)
class RlSpec:
    """The update's settings (the config's ``rl`` section)."""
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    scale_rewards: str = "group"
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    beta: float = 0.0
    max_completion_length: int | None = None  # dr_grpo's length; the longest completion's where None

    def __post_init__(self):
        for name, value, allowed in (("loss_type", self.loss_type, LOSS_TYPES),
                                     ("importance_sampling_level", self.importance_sampling_level, LEVELS),
                                     ("scale_rewards", self.scale_rewards, SCALES)):
            if value not in allowed:
                raise ValueError(f"rl.{name}: {value!r} is not one of {', '.join(allowed)}")

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(frozen=True)
class Objective:
    """``train.objective``: one class per objective, built once from the config (:meth:`of`); a new objective is a
    new class in :data:`OBJECTIVES`. This base holds what they share: refusing preference pairs, a loss per example."""
    name: ClassVar[str]
    paired: ClassVar[bool] = False  # the loss is per preference pair (the step's mean is over pairs)
    weighs_examples: ClassVar[bool] = False  # each example's loss times its weight (an evaluation reports both)

    @classmethod
    def of(cls, cfg: Config) -> Objective:
        return OBJECTIVES[cfg.train.objective].from_config(cfg)

    @classmethod
    def from_config(cls, cfg: Config) -> Objective:
        return cls()

    @property
    def per_step(self) -> bool:
        """Each unit runs a reference forward before its training forward (dpo's)."""
        return False

    @property
    def online(self) -> bool:
        """Each step samples its examples from the data's requests (grpo's ``rl.num_generations``)."""
        return False

    @property
    def precomputes(self) -> bool:
        """The trainer computes the reference table before step 0 (``train.dpo_reference: precompute``)."""
        return False

    @property
    def per_token_reference(self) -> bool:
        """The reference table holds each target token's log-probability (grpo's), not each answer's sum (dpo's)."""
        return False

    def with_table(self, table: Mapping[str, float] | None) -> Objective:
        """The objective reading its reference log-probabilities from ``table`` (None: from no table)."""
        return self

    def measure(self, examples: Sequence) -> float:
        """What the step's mean is over, of ``examples`` (the step's, or a skipped unit's)."""
        return len(examples)

    def moves(self, ex) -> bool:
        """``ex`` can have a gradient (the check that the loss reaches the adapters waits for a step with one)."""
        return ex.weight != 0

    def describe(self) -> str:
        raise NotImplementedError

    def data_figures(self, examples: Sequence) -> dict:
        """What the step's figures (metrics.jsonl) say of its ``examples`` alone."""
        return {}

    def tally(self) -> list[float]:
        """What this rank's losses since the last call counted (summed over the ranks, then read by
        :meth:`step_figures`); the count starts again."""
        return []

    def step_figures(self, tallies: list[float]) -> dict:
        """The step's figures from its tallies summed over the ranks."""
        return {}

    def check(self, examples: Sequence, split: str = "data.train") -> None:
        """Refuse data the objective cannot train on, naming the first example that shows it."""
        group = next((ex for ex in examples if getattr(ex, "group", "")), None)
        if group is not None:
            raise ValueError(f"{_at(group)}: {split} holds scored groups (completions and rewards), which "
                             f"train.objective {self.name} would train on as plain examples: set train.objective: "
                             "grpo")
        pair = next((ex for ex in examples if getattr(ex, "pair", "")), None)
        if pair is not None:
            raise ValueError(f"{_at(pair)}: {split} holds preference pairs (chosen and rejected): set "
                             "train.objective: dpo")

    def terms(self, examples: Sequence) -> Terms:
        """What a unit's loss needs of its examples (in the unit's order)."""
        return Terms(())

    def loss(self, out: LossOutput, terms: Terms, reference: torch.Tensor | None = None) -> torch.Tensor:
        """The unit's loss (a scalar with gradient) from its forward's output ``out``."""
        return out.loss_sum

    def reference_log_probs(self, lm, forward) -> torch.Tensor | None:
        """The unit's reference log-probabilities before its training forward (None: no reference)."""
        return None


@dataclass(frozen=True)
class Sft(Objective):
    name: ClassVar[str] = "sft"

    def describe(self) -> str:
        return "sft: each example's mean target cross-entropy, averaged over the step's examples"

    def check(self, examples: Sequence, split: str = "data.train") -> None:
        super().check(examples, split)
        weighted = next((ex for ex in examples if getattr(ex, "weight", 1.0) != 1.0), None)
        if weighted is not None:
            raise ValueError(f"{_at(weighted)}: {split} examples carry weights (weight {weighted.weight:g}), which "
                             "train.objective sft would ignore: set train.objective: weighted (or drop the weights)")


@dataclass(frozen=True)
class Weighted(Objective):
    name: ClassVar[str] = "weighted"
    weighs_examples: ClassVar[bool] = True

    def describe(self) -> str:
        return "weighted: each example's mean target cross-entropy times its weight, averaged over the step's " \
               "examples"

    def check(self, examples: Sequence, split: str = "data.train") -> None:
        super().check(examples, split)
        _some_weight(examples, split)

    def terms(self, examples: Sequence) -> Terms:
        return Terms(tuple(float(ex.weight) for ex in examples))

    def loss(self, out: LossOutput, terms: Terms, reference: torch.Tensor | None = None) -> torch.Tensor:
        import torch

        live = out.live
        return (live * torch.tensor(terms.weights, dtype=live.dtype, device=live.device)).sum()


@dataclass(frozen=True)
class Dpo(Objective):
    name: ClassVar[str] = "dpo"
    paired: ClassVar[bool] = True
    beta: float = 0.1
    loss_type: str = "sigmoid"
    reference: str = "precompute"
    rpo_alpha: float = 0.0
    # precompute: the reference log-probability of every training example, by id (None until computed)
    table: Mapping[str, float] | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> Dpo:
        t = cfg.train
        return cls(t.dpo_beta, t.dpo_loss_type, t.dpo_reference, t.rpo_alpha)

    @property
    def per_step(self) -> bool:
        """Under ``per_step``, and under ``precompute`` until the table is given (the trainer gives it before step 0;
        ``smoke``, ``bench`` and ``plan --measure`` run without one, so they time and size the step with its
        reference forward)."""
        return self.reference == "per_step" or self.table is None

    @property
    def precomputes(self) -> bool:
        return self.reference == "precompute"

    def with_table(self, table: Mapping[str, float] | None) -> Dpo:
        return dataclasses.replace(self, table=table)

    def measure(self, examples: Sequence) -> float:
        return len(examples) // 2

    def describe(self) -> str:
        ref = ("precomputed before step 0 (OUTPUT/reference.json)" if self.reference == "precompute"
               else "a no-grad forward of each unit before its training forward")
        nll = f" + {self.rpo_alpha:g} x the chosen answer's mean target cross-entropy" if self.rpo_alpha else ""
        return f"dpo ({self.loss_type}, beta {self.beta:g}){nll}: averaged over the step's pairs; reference = the " \
               f"base model (adapter disabled), {ref}"

    def check(self, examples: Sequence, split: str = "data.train") -> None:
        _no_groups(examples, split, self.name)
        single = next((ex for ex in examples if not getattr(ex, "pair", "")), None)
        if single is not None:
            raise ValueError(f"{_at(single)}: train.objective dpo trains on preference pairs (chosen and "
                             f"rejected), and this {split} example has one target")
        _some_weight(examples, split)

    def terms(self, examples: Sequence) -> Terms:
        pairs = tuple(pair_examples(examples))
        if 2 * len(pairs) != len(examples):
            raise RuntimeError("a unit holds one answer of a preference pair without the other (the planner keeps "
                               "both in one pack)")
        weights = tuple(float(examples[c].weight) for c, _ in pairs)
        reference = None
        if self.table is not None:
            missing = next((ex.id for ex in examples if ex.id not in self.table), None)
            if missing is not None:
                raise RuntimeError(f"the reference table has no entry for example {missing!r}")
            reference = tuple(float(self.table[ex.id]) for ex in examples)
        return Terms(weights, pairs, reference)

    def loss(self, out: LossOutput, terms: Terms, reference: torch.Tensor | None = None) -> torch.Tensor:
        """``reference``: the unit's examples' reference log-probabilities from a per_step forward (else the
        table's, in ``terms``)."""
        import torch

        live = out.live
        if reference is None:
            if terms.reference is None:
                raise RuntimeError("train.objective dpo: no reference log-probabilities for this unit (the "
                                   "precompute pass did not run)")
            reference = torch.tensor(terms.reference, dtype=torch.float64, device=live.device)
        policy = log_probs(live, out.target_tokens)
        losses = self.pair_losses(policy, reference, out.target_tokens, terms)
        if self.rpo_alpha:
            chosen = torch.tensor([c for c, _ in terms.pairs], device=live.device)
            weights = torch.tensor(terms.weights, dtype=torch.float64, device=live.device)
            losses = losses + self.rpo_alpha * live[chosen].to(torch.float64) * weights
        return losses.sum()

    def pair_losses(self, policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor,
                    terms: Terms) -> torch.Tensor:
        """[pairs] each pair's loss, times its weight, from per-example summed log-probabilities (float64)."""
        import torch
        import torch.nn.functional as F

        chosen = torch.tensor([c for c, _ in terms.pairs], device=policy.device)
        rejected = torch.tensor([r for _, r in terms.pairs], device=policy.device)
        ratio = policy.to(torch.float64) - reference.to(torch.float64)
        if self.loss_type == "ipo":
            ratio = ratio / counts.to(device=policy.device, dtype=torch.float64)
        margin = ratio[chosen] - ratio[rejected]
        if self.loss_type == "ipo":
            losses = (margin - 1 / (2 * self.beta)) ** 2
        else:
            losses = -F.logsigmoid(self.beta * margin)
        weights = torch.tensor(terms.weights, dtype=torch.float64, device=policy.device)
        return losses * weights

    def reference_log_probs(self, lm, forward) -> torch.Tensor | None:
        """per_step: the unit's reference log-probabilities, ``forward()`` run without gradient and with the
        adapter disabled."""
        if not self.per_step:
            return None
        import torch

        with torch.no_grad(), adapters_disabled(lm):
            out = forward()
        return log_probs(out.live, out.target_tokens).to(torch.float64)


@dataclass(frozen=True)
class Grpo(Objective):
    """``train.objective: grpo``: the GRPO family's update on scored groups (:mod:`packtrain.run.rl`)."""
    name: ClassVar[str] = "grpo"
    spec: RlSpec = RlSpec()
    samples: int = 0  # rl.num_generations: K completions sampled per request each step (0: the data's groups)
    reference: str = "per_step"  # beta > 0 on the data's groups: train.dpo_reference (online: per_step only)
    # precompute: each completion's reference token log-probabilities, by id (None until computed)
    table: Mapping[str, tuple[float, ...]] | None = None
    # this rank's tokens, clipped tokens and summed KL estimates since the last tally (the losses' figures)
    counts: list = dataclasses.field(default_factory=lambda: [0.0, 0.0, 0.0], compare=False, repr=False)

    @classmethod
    def from_config(cls, cfg: Config) -> Grpo:
        r = cfg.rl
        return cls(RlSpec(r.loss_type, r.importance_sampling_level, r.scale_rewards, r.epsilon, r.epsilon_high,
                          r.beta, r.max_completion_length), r.num_generations or 0,
                   "per_step" if r.num_generations else cfg.train.dpo_reference)

    @property
    def online(self) -> bool:
        """The completions are sampled during the run (:mod:`packtrain.run.rollouts`): the data holds requests."""
        return self.samples > 0

    @property
    def per_step(self) -> bool:
        """The reference forward runs before each unit's training forward where the KL term needs it: under
        ``per_step``, online, and under ``precompute`` until the table is given (as dpo's)."""
        return self.spec.beta > 0 and (self.reference == "per_step" or self.table is None)

    @property
    def precomputes(self) -> bool:
        return self.spec.beta > 0 and self.reference == "precompute" and not self.online

    @property
    def per_token_reference(self) -> bool:
        return True

    def with_table(self, table: Mapping[str, tuple[float, ...]] | None) -> Grpo:
        return dataclasses.replace(self, table=table)

    def measure(self, examples: Sequence) -> float:
        """The step's completions (grpo, dr_grpo) or their tokens (dapo, cispo)."""
        if self.spec.loss_type in ("grpo", "dr_grpo"):
            return len(examples)
        return sum(len(ex.target_ids) for ex in examples)

    def moves(self, ex) -> bool:
        return self.spec.beta > 0 or len(set(ex.group_rewards)) > 1

    def data_figures(self, examples: Sequence) -> dict:
        """The step's rewards (mean, and std over its completions), the fraction of its groups whose rewards are all
        equal (advantage 0: only the KL moves them), and its completions' mean length in tokens."""
        if not examples:
            return {}
        rewards = [ex.reward for ex in examples]
        mean = sum(rewards) / len(rewards)
        groups = {ex.group: ex.group_rewards for ex in examples}
        return {"reward_mean": mean, "reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
                "equal_reward_groups": sum(len(set(g)) == 1 for g in groups.values()) / len(groups),
                "completion_length": sum(len(ex.target_ids) for ex in examples) / len(examples)}

    def tally(self) -> list[float]:
        out = list(self.counts)
        self.counts[:] = [0.0, 0.0, 0.0]
        return out

    def step_figures(self, tallies: list[float]) -> dict:
        """The fraction of the step's tokens whose clip (cispo: cap) took their gradient, and (beta > 0) the mean k3
        estimate of the KL to the reference per token."""
        tokens, clipped, kl = tallies
        if not tokens:
            return {}
        return {"clip_fraction": clipped / tokens, **({"kl": kl / tokens} if self.spec.beta else {})}

    def describe(self) -> str:
        s = self.spec
        clip = f"cap {s.high:g}" if s.loss_type == "cispo" else f"clip [{1 - s.epsilon:g}, {1 + s.high:g}]"
        over = "completions" if s.loss_type in ("grpo", "dr_grpo") else "tokens"
        how = ("precomputed per token before step 0 (OUTPUT/reference.json)" if self.precomputes
               else "a no-grad forward of each unit before its training forward")
        kl = f"; KL (k3) x {s.beta:g} to the base model (adapter disabled), {how}" if s.beta else ""
        return (f"grpo ({s.loss_type}, {s.importance_sampling_level}-level ratio, {clip}, rewards scaled "
                f"{'by the group std' if s.scale_rewards == 'group' else 'not'}): averaged over the step's {over}{kl}")

    def check(self, examples: Sequence, split: str = "data.train") -> None:
        if self.online:  # requests with their targets (what generate.metric scores the samples against)
            super().check(examples, split)
            pictured = next((ex for ex in examples if getattr(ex, "images", ())), None)
            if pictured is not None:
                raise ValueError(f"{_at(pictured)}: rl.num_generations samples text requests only (a rollouts file "
                                 "is pretokenized): train on scored groups with images from the data instead")
            return
        single = next((ex for ex in examples if not getattr(ex, "group", "")), None)
        if single is not None:
            what = "a preference pair" if single.pair else "one target"
            raise ValueError(f"{_at(single)}: train.objective grpo trains on scored groups (completions and "
                             f"rewards), and this {split} example has {what}")
        if split == "data.train" and examples and not any(self.moves(ex) for ex in examples):
            raise ValueError(f"{examples[0].source or 'the data'}: every scored group of {split} has equal rewards "
                             "(advantage 0) and rl.beta is 0, so no step would train anything")

    def terms(self, examples: Sequence) -> Terms:
        """Per completion: its advantage, its weight, and the sampler's log-probabilities (or None)."""
        from packtrain.run.rl import group_advantages

        advantages = []
        for ex in examples:
            rewards = ex.group_rewards
            advantages.append(float(group_advantages(rewards, self.spec.scale_rewards)[rewards.index(ex.reward)]))
        s = self.spec
        weights = tuple(1.0 / len(ex.target_ids) if s.loss_type == "grpo" else
                        1.0 / s.max_completion_length if s.loss_type == "dr_grpo" else 1.0 for ex in examples)
        reference = None
        if s.beta > 0 and self.table is not None:
            reference = []
            for ex in examples:
                entry = self.table.get(ex.id)
                if entry is None or len(entry) != len(ex.target_ids):
                    raise RuntimeError(f"the reference table has no entry of {len(ex.target_ids)} token "
                                       f"log-probabilities for completion {ex.id!r}")
                reference.extend(entry)
            reference = tuple(reference)
        return Terms(weights, reference=reference, advantages=tuple(advantages),
                     old=tuple(ex.logprobs for ex in examples))

    def loss(self, out: LossOutput, terms: Terms, reference: torch.Tensor | None = None) -> torch.Tensor:
        """``reference``: the unit's tokens' reference log-probabilities from its per_step forward."""
        import torch

        from packtrain.run.rl import token_terms

        logp = out.token_logp.to(torch.float64)
        lengths = out.target_tokens.to(logp.device)
        old = None
        if any(o is not None for o in terms.old):
            old = torch.cat([logp.detach()[a:b] if o is None else torch.tensor(o, dtype=torch.float64,
                                                                                  device=logp.device)
                             for o, a, b in zip(terms.old, *_bounds(lengths))])
        advantages = torch.tensor(terms.advantages, dtype=torch.float64, device=logp.device)
        if reference is None and terms.reference is not None:  # precompute: the table's, token after token
            reference = torch.tensor(terms.reference, dtype=torch.float64, device=logp.device)
        t = token_terms(logp, lengths, advantages, self.spec, old, reference)
        self.counts[0] += t.loss.numel()
        self.counts[1] += float(t.clipped.sum())
        self.counts[2] += 0.0 if t.kl is None else float(t.kl.sum())
        sums = torch.segment_reduce(t.loss, "sum", lengths=lengths, axis=0)
        return (sums * torch.tensor(terms.weights, dtype=torch.float64, device=logp.device)).sum()

    def reference_log_probs(self, lm, forward) -> torch.Tensor | None:
        """The unit's tokens' log-probabilities under the base model (the adapter disabled, no gradient), where
        ``rl.beta`` > 0."""
        if not self.per_step:
            return None
        import torch

        with torch.no_grad(), adapters_disabled(lm):
            out = forward()
        return out.token_logp.to(torch.float64)


OBJECTIVES: dict[str, type[Objective]] = {o.name: o for o in (Sft, Weighted, Dpo, Grpo)}  # train.objective's values


@dataclass(frozen=True)
class Terms:
    """What a unit's loss needs of its examples: the weights (weighted: per example; dpo: per pair), the pairs
    (positions of chosen and rejected in the unit's example order) and the precomputed reference log-probabilities
    (per example, or None)."""
    weights: tuple[float, ...]
    pairs: tuple[tuple[int, int], ...] = ()
    reference: tuple[float, ...] | None = None  # dpo: per example; grpo: per target token, example after example
    advantages: tuple[float, ...] = ()  # grpo: per completion
    old: tuple[tuple[float, ...] | None, ...] = ()  # grpo: the sampler's log-probabilities per completion (or None)

    def subset(self, positions: Sequence[int]) -> Terms:
        """The terms of the unit's examples at ``positions`` (a group of a pack: weighted only)."""
        if self.pairs:
            raise RuntimeError("a preference pair's loss needs both its answers in one graph")
        if self.advantages:
            raise RuntimeError("train.objective grpo is not built for continuation groups")
        return Terms(tuple(self.weights[i] for i in positions) if self.weights else ())


def _bounds(lengths: torch.Tensor) -> tuple[list[int], list[int]]:
    """Each example's [start, end) among the unit's target tokens, from their counts."""
    ends = lengths.cumsum(0).tolist()
    return [0, *ends[:-1]], ends


def log_probs(mean_losses: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per example, the summed log-probability of its target tokens from their mean cross-entropy."""
    return -mean_losses * counts.to(device=mean_losses.device, dtype=mean_losses.dtype)


@contextlib.contextmanager
def adapters_disabled(lm):
    """The adapter off for the duration (peft's ``disable_adapter``): the base model, the reference of dpo."""
    model = lm.model
    disable = getattr(model, "disable_adapter", None)
    if disable is None:
        raise RuntimeError("train.objective dpo: the reference is the base model with the adapter disabled, and this "
                           "model has no adapter (peft)")
    with disable():
        yield


def _no_groups(examples: Sequence, split: str, name: str) -> None:
    group = next((ex for ex in examples if getattr(ex, "group", "")), None)
    if group is not None:
        raise ValueError(f"{_at(group)}: {split} holds scored groups (completions and rewards), which "
                         f"train.objective {name} does not train on: set train.objective: grpo")


def _some_weight(examples: Sequence, split: str) -> None:
    """Training data whose every weight is 0 trains nothing (one step's zeros are data: a group whose advantages are
    all 0): refused in one line. Held-out data may weigh 0."""
    if split == "data.train" and examples and all(ex.weight == 0 for ex in examples):
        where = getattr(examples[0], "source", "") or "the data"
        raise ValueError(f"{where}: every {split} example has weight 0, so no step would train anything: give some a "
                         "weight above 0")


def _at(ex) -> str:
    where = f"{ex.source}:{ex.line}" if getattr(ex, "source", "") else "the data"
    return f"{where} (example {ex.id!r})"
