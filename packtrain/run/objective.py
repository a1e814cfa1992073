"""The training objective (``train.objective``): what a unit's loss is, made of its examples' target
cross-entropies, and what the step divides the loss by.

===========  ======================================================================  ==========================
objective    a unit's loss                                                           the step's mean is over
===========  ======================================================================  ==========================
sft          sum of each example's mean target cross-entropy                         its examples
weighted     sum of ``weight`` times each example's mean target cross-entropy        its examples
dpo          per preference pair, ``-log sigmoid(beta * ((lc - rc) - (lr - rr)))``   its pairs
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

    def with_table(self, table: Mapping[str, float] | None) -> Objective:
        """The objective reading its reference log-probabilities from ``table`` (None: from no table)."""
        return self

    def items(self, n_examples: int) -> int:
        """What the step's mean is over, of ``n_examples`` examples."""
        return n_examples

    def describe(self) -> str:
        raise NotImplementedError

    def check(self, examples: Sequence, split: str = "data.train") -> None:
        """Refuse data the objective cannot train on, naming the first example that shows it."""
        group = next((ex for ex in examples if getattr(ex, "group", "")), None)
        if group is not None:
            raise ValueError(f"{_at(group)}: {split} holds scored groups (completions and rewards), which "
                             f"train.objective {self.name} would train on as plain examples; they are for "
                             "train.objective grpo (issue 59, in progress: not yet trainable)")
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

    def with_table(self, table: Mapping[str, float] | None) -> Dpo:
        return dataclasses.replace(self, table=table)

    def items(self, n_examples: int) -> int:
        return n_examples // 2

    def describe(self) -> str:
        ref = ("precomputed before step 0 (OUTPUT/reference.json)" if self.reference == "precompute"
               else "a no-grad forward of each unit before its training forward")
        nll = f" + {self.rpo_alpha:g} x the chosen answer's mean target cross-entropy" if self.rpo_alpha else ""
        return f"dpo ({self.loss_type}, beta {self.beta:g}){nll}: averaged over the step's pairs; reference = the " \
               f"base model (adapter disabled), {ref}"

    def check(self, examples: Sequence, split: str = "data.train") -> None:
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


OBJECTIVES: dict[str, type[Objective]] = {o.name: o for o in (Sft, Weighted, Dpo)}  # train.objective's values


@dataclass(frozen=True)
class Terms:
    """What a unit's loss needs of its examples: the weights (weighted: per example; dpo: per pair), the pairs
    (positions of chosen and rejected in the unit's example order) and the precomputed reference log-probabilities
    (per example, or None)."""
    weights: tuple[float, ...]
    pairs: tuple[tuple[int, int], ...] = ()
    reference: tuple[float, ...] | None = None

    def subset(self, positions: Sequence[int]) -> Terms:
        """The terms of the unit's examples at ``positions`` (a group of a pack: weighted only)."""
        if self.pairs:
            raise RuntimeError("a preference pair's loss needs both its answers in one graph")
        return Terms(tuple(self.weights[i] for i in positions) if self.weights else ())


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
