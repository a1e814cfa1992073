"""What packtrain builds: one table of the combinations of packing mode, context mode, the walk, continuation groups,
objective and images, each refused here with its reason or allowed. The config refuses what it can see at load
(:func:`refusals` of the config's combination); the data adds whether it has images (:func:`check_data`, before the
model is built). Every refusal elsewhere is an assertion of this table (a path the table lets through must run).

Torch-free; read by ``packtrain plan`` as by every other command.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Combination:
    """A run's choices the table rules on."""
    mode: str  # packing.mode: shared_prefix | standalone | tree
    context_grad: str  # packing.context_grad: full | kv_only | frozen
    walk: bool  # packing.on_overflow walk
    groups: int  # packing.continuation_groups
    objective: str  # train.objective: sft | weighted | dpo | grpo
    max_continuations: int = 90
    images: bool = False  # the data holds images (known once it is read)

    @classmethod
    def of(cls, cfg, images: bool = False) -> Combination:
        p = cfg.packing
        return cls(p.mode, p.context_grad, p.on_overflow == "walk", p.continuation_groups, cfg.train.objective,
                   p.max_continuations, images)


@dataclass(frozen=True)
class Rule:
    """A combination that is not built: ``applies`` says which, ``reason`` (formatted with the combination's
    fields) says why in one line."""
    applies: Callable[[Combination], bool]
    reason: str


# Every combination not built, with its reason. Anything no rule refuses is built and tested.
RULES: tuple[Rule, ...] = (
    Rule(lambda c: c.walk and c.context_grad == "kv_only",
         "packing.on_overflow: walk needs packing.context_grad full or frozen, not kv_only"),
    Rule(lambda c: c.mode == "tree" and c.context_grad != "full",
         "packing.mode tree: packing.context_grad {context_grad} is not built (full only)"),
    Rule(lambda c: c.mode == "tree" and c.walk,
         "packing.mode tree: packing.on_overflow walk is not built (error or skip)"),
    Rule(lambda c: c.groups > 1 and c.mode != "shared_prefix",
         "packing.continuation_groups: groups a pack's continuations, so it needs packing.mode shared_prefix, got "
         "mode {mode!r} with {groups} groups"),
    Rule(lambda c: c.objective != "sft" and c.walk,
         "train.objective {objective}: packing.on_overflow walk is not built for it (error or skip)"),
    Rule(lambda c: c.objective != "sft" and c.context_grad != "full",
         "train.objective {objective}: packing.context_grad {context_grad} is not built for it (full only)"),
    Rule(lambda c: c.objective == "dpo" and c.groups > 1,
         "train.objective dpo: packing.continuation_groups {groups} is not built for it (a pair's loss needs both "
         "answers in one graph; set 1)"),
    Rule(lambda c: c.objective == "dpo" and c.max_continuations < 2,
         "train.objective dpo: packing.max_continuations must be at least 2 (a pair's two answers are in one pack), "
         "got {max_continuations}"),
    Rule(lambda c: c.objective == "grpo" and c.groups > 1,
         "train.objective grpo: packing.continuation_groups {groups} is not built for it (set 1)"),
    Rule(lambda c: c.images and c.groups > 1,
         "has images, and packing.continuation_groups > 1 takes text-only data (set packing.continuation_groups: 1)"),
)


def refusals(c: Combination) -> list[str]:
    """Each rule that refuses ``c``, as its line."""
    fields = {f: getattr(c, f) for f in c.__dataclass_fields__}
    return [rule.reason.format(**fields) for rule in RULES if rule.applies(c)]


def supported(c: Combination) -> bool:
    return not refusals(c)


def built_context_grads(mode: str) -> tuple[str, ...]:
    """The packing.context_grad values built under packing.mode ``mode`` (``plan``'s one line per mode)."""
    return tuple(g for g in ("full", "kv_only", "frozen")
                 if supported(Combination(mode, g, False, 1, "sft")))
