"""What an evaluation reports under each ``train.objective``, from its per-example rows (``{"id", "loss",
"target_tokens"}``, :func:`packtrain.run.evaluate.evaluate`): the rows written and the figures over the data. One home
for the trainer's periodic evaluation (:mod:`packtrain.run.cadence`) and ``packtrain eval``.

===========  ==========================================  ==========================================================
objective    rows                                        figures over the data
===========  ==========================================  ==========================================================
sft          per example: id, loss, target_tokens        ``loss`` (mean per-example loss), ``examples``
weighted     per example, with its ``weight``            ``loss`` (plain mean), ``weighted_loss`` (mean of weight *
                                                         loss, the training objective), ``examples``
dpo          per pair (:func:`pair_rows`)                ``loss`` (the DPO loss, mean over pairs), ``pairs``,
                                                         ``reward_accuracy``, ``reward_margin``, ``examples``
===========  ==========================================  ==========================================================

Under dpo an answer's log-probability is its summed token log-probability, ``-loss * target_tokens``; ``lc``, ``lr``
the policy's (chosen, rejected) and ``rc``, ``rr`` the reference's (the base model: the adapter disabled). Per pair:
``policy_margin = lc - lr``, ``reference_margin = rc - rr``, and the implicit reward margin ``reward_margin = beta *
(policy_margin - reference_margin)`` = ``beta * ((lc - rc) - (lr - rr))``; ``correct`` when it is above 0 (the
implicit reward prefers the chosen answer). Over the data, ``reward_accuracy`` is the share of correct pairs, a tie
(margin exactly 0) counting one half, and ``reward_margin`` the mean of the pairs' reward margins (TRL's
``rewards/accuracies`` and ``rewards/margins``, from summed log-probabilities also under ``dpo_loss_type: ipo``; TRL
counts a tie 0, so at step 0, where the policy is the reference and every margin is 0, it reports 0 where packtrain
reports chance, 0.5). A pair's ``loss`` is its DPO loss (:meth:`packtrain.run.objective.Objective.pair_losses`, times
the pair's weight; ``rpo_alpha``'s cross-entropy term is not in it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from packtrain.data.preference import pair_examples
from packtrain.run.evaluate import mean_loss
from packtrain.run.objective import Objective, Terms


def figures(objective: Objective, rows: list[dict], examples: Sequence,
            reference: Mapping[str, float] | None = None) -> tuple[list[dict], dict]:
    """(the rows to write, the figures over the data) of an evaluation's per-example ``rows`` of ``examples``
    (those rows name, by id); ``reference``: under dpo, each example's reference log-probability by id."""
    if objective.paired:
        if reference is None:
            raise RuntimeError("train.objective dpo: an evaluation on pairs needs the reference log-probabilities")
        pairs = pair_rows(objective, rows, examples, reference)
        return pairs, pair_summary(pairs)
    summary = {"loss": mean_loss(rows) if rows else float("nan"), "examples": len(rows)}
    if not objective.weighs_examples:
        return rows, summary
    weight = {ex.id: float(ex.weight) for ex in examples}
    rows = [{**r, "weight": weight[r["id"]]} for r in rows]
    return rows, {**summary, "weighted_loss": _mean([r["weight"] * r["loss"] for r in rows])}


def pair_rows(objective: Objective, rows: list[dict], examples: Sequence, reference: Mapping[str, float]) -> list[dict]:
    """One row per preference pair among ``rows`` (the module's table), in the order of their chosen answers."""
    import torch

    by_id = {ex.id: ex for ex in examples}
    evaluated = [by_id[r["id"]] for r in rows]
    pairs = pair_examples(evaluated)
    if 2 * len(pairs) != len(rows):
        raise RuntimeError("an evaluation on pairs has an answer without its pair's other answer")
    policy = torch.tensor([-r["loss"] * r["target_tokens"] for r in rows], dtype=torch.float64)
    ref = torch.tensor([float(reference[r["id"]]) for r in rows], dtype=torch.float64)
    counts = torch.tensor([r["target_tokens"] for r in rows], dtype=torch.float64)
    terms = Terms(tuple(float(evaluated[c].weight) for c, _ in pairs), tuple(pairs))
    losses = objective.pair_losses(policy, ref, counts, terms).tolist()
    out = []
    for (c, r), loss in zip(pairs, losses):
        lc, lr, rc, rr = (float(policy[c]), float(policy[r]), float(ref[c]), float(ref[r]))
        margin = objective.beta * ((lc - rc) - (lr - rr))
        out.append({"id": evaluated[c].pair, "chosen": rows[c]["id"], "rejected": rows[r]["id"], "loss": loss,
                    "policy_chosen": lc, "policy_rejected": lr, "reference_chosen": rc, "reference_rejected": rr,
                    "policy_margin": lc - lr, "reference_margin": rc - rr, "reward_margin": margin,
                    "correct": margin > 0, "chosen_tokens": rows[c]["target_tokens"],
                    "rejected_tokens": rows[r]["target_tokens"]})
    return out


def pair_summary(pairs: list[dict]) -> dict:
    """The figures over the data of :func:`pair_rows`' rows."""
    return {"loss": _mean([p["loss"] for p in pairs]), "pairs": len(pairs),
            "reward_accuracy": _mean([_credit(p["reward_margin"]) for p in pairs]),
            "reward_margin": _mean([p["reward_margin"] for p in pairs]), "examples": 2 * len(pairs)}


def _credit(margin: float) -> float:
    """A pair's share of the reward accuracy: 1 when the implicit reward prefers the chosen answer, 0 when it prefers
    the rejected one, 1/2 for a tie (chance: at step 0, where the policy is the reference, every margin is 0)."""
    return 1.0 if margin > 0 else 0.5 if margin == 0 else 0.0


def describe(summary: dict) -> str:
    """The figures in words, for the terminal line."""
    if "reward_accuracy" in summary:
        return (f"dpo loss {summary['loss']:.4f}, reward accuracy {summary['reward_accuracy']:.2f}, mean reward "
                f"margin {summary['reward_margin']:+.4f} over {summary['pairs']} pairs")
    weighted = f" (weighted {summary['weighted_loss']:.4f})" if "weighted_loss" in summary else ""
    return f"loss {summary['loss']:.4f}{weighted} over {summary['examples']} examples"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
