"""The ways to train the same examples, each one epoch-equivalent of the same optimizer steps.

- ``shared_prefix``: packtrain, one forward per pack (P once, its continuations branched off it), exact gradient
  through P (``packing.context_grad=full``).
- ``kv_only`` / ``frozen``: the same packs under the other ``packing.context_grad`` modes (packtrain/packed/context.py):
  they train something else (docs/design.md), so their final losses differ; they are here for their cost.
- ``tree``: packtrain under ``packing.mode: tree``: a prompt group's continuations as a prefix tree, every run of
  tokens they share computed once (multi-turn data under ``data.train_on: each``: the tree preset). Its packs are
  the tree planner's, so its steps are ``packtrain train``'s under that mode, not the other variants' (the tree
  preset makes one step of every pack per epoch: there all three make the same update).
- ``standalone``: packtrain, one forward per example (``concat(P, C)`` through the model's own forward, target-only
  head).
- ``plain``: what a user writes without packtrain: transformers' ``model(input_ids=..., labels=...)`` on each whole
  example (labels -100 outside the target), the same peft adapter config, gradient accumulation over the step's
  examples (loss / examples in the step). Its model is a copy of the same base, never patched.

Each packtrain variant is the config under overrides of its packing settings (:data:`VARIANTS`: its
``packing.mode``, ``packing.context_grad``), run as ``packtrain train`` runs that config: its session
(:func:`packtrain.run.session.open_session`: its kinds and its plan), and a root over the one model the bench's
session built (:func:`packtrain.models.wrap.root`, under the variant's context mode).

Every variant trains the steps ``packtrain train`` trains on one rank (epoch 0 of
:meth:`packtrain.run.balance.StepPlan.for_run`, under ``train.balance``); the packtrain variants run the trainer's own
step (:class:`packtrain.run.step.Step`), and the plain loop scales each loss by 1 / (examples in the step), clips
to ``optim.max_grad_norm`` and steps the same optimizer and schedule. Each run starts from the same initial adapter
and a fresh optimizer, and ends with an evaluation of the adapter it trained, each variant through its own forward (packed, standalone, or
transformers' forward with labels), so that equal final losses compare independent computations.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from peft import get_peft_model

from packtrain.bench.presets import generate_examples, get_preset
from packtrain.config import Config, config_from_dict
from packtrain.data.planner import Plan
from packtrain.distributed import DistInfo
from packtrain.models.build import lora_config
from packtrain.models.text_config import config_dict_of, text_config
from packtrain.models.wrap import root
from packtrain.run.balance import StepPlan
from packtrain.run.evaluate import evaluate, mean_loss
from packtrain.run.optim import build_optimizer, build_scheduler
from packtrain.run.session import Session, open_session
from packtrain.run.step import Step, rank_units
from packtrain.run.units import build


class PackedVariant:
    """packtrain under the config with ``packing`` overriding its packing settings: the run ``packtrain train``
    makes of that config (its kinds, plan, steps and root, :meth:`Workload.for_variant`)."""

    def __init__(self, name: str, note: str = "", default: bool = True, **packing):
        self.name, self.note, self.default, self.packing = name, note, default, packing

    def config(self, cfg: Config) -> Config:
        return dataclasses.replace(cfg, packing=dataclasses.replace(cfg.packing, **self.packing))

    def epoch(self, models: Models, work: Workload, max_steps: int | None = None) -> list[float]:
        """One epoch through the trainer's step on one rank; returns each step's mean per-example loss."""
        work = work.for_variant(self)
        cfg, state = work.cfg, models.packtrain_state
        optimizer, scheduler = state.reset(len(work.steps))
        step = Step(models.lms[self.name], work.session.kinds, work.plan, work.examples, work.session.info,
                    list(state.params.values()), optimizer, scheduler, cfg.optim.max_grad_norm,
                    cfg.train.max_positions)
        return [step.run(pack_ids, k).loss for k, pack_ids in enumerate(work.steps[:max_steps])]

    def evaluate(self, models: Models, work: Workload) -> float:
        """The adapter's mean per-example loss through the packed forward of the variant's kinds and context."""
        work = work.for_variant(self)
        rows = evaluate(models.lms[self.name], work.plan, work.examples, work.session.kinds, work.session.info)
        return mean_loss(rows)

    def figures(self, work: Workload, stats: dict, target_tokens: int) -> tuple[int, int, int]:
        """(positions, attention pairs per layer and head, lm_head rows) of one epoch, from the variant's own plan's
        statistics (``stats``): a pack's P once (shared), or each example's whole sequence."""
        column = "packed" if work.for_variant(self).session.kinds.pack.shares_prefix else "standalone"
        return stats[f"positions_{column}"], stats[f"attention_pairs_{column}"], target_tokens


class PlainVariant:
    """The loop a transformers + peft user writes (see the module docstring), on the config's steps."""
    name, note, default, packing = "plain", "", True, {}

    def config(self, cfg: Config) -> Config:
        return cfg

    def epoch(self, models: Models, work: Workload, max_steps: int | None = None) -> list[float]:
        return plain_epoch(models, work, max_steps)

    def evaluate(self, models: Models, work: Workload) -> float:
        return plain_mean_loss(models.plain, work)

    def figures(self, work: Workload, stats: dict, target_tokens: int) -> tuple[int, int, int]:
        """Every example's whole sequence, and every position through lm_head (transformers' loss)."""
        return stats["positions_standalone"], stats["attention_pairs_standalone"], stats["positions_standalone"]


_REDUCED = ("kv_only, frozen: the shared-prefix packs under packing.context_grad (below 1.00x: faster than the exact "
            "gradient); they train something else, so their final loss differs by design.")
_ALL = (
    PackedVariant("shared_prefix", mode="shared_prefix", context_grad="full"),
    PackedVariant("kv_only", _REDUCED, mode="shared_prefix", context_grad="kv_only"),
    PackedVariant("frozen", _REDUCED, mode="shared_prefix", context_grad="frozen"),
    PackedVariant("tree", "tree: {packs} tree pack(s), {positions_packed:,} positions (shared_prefix {base:,}); its of "
                  "ratio: shared_prefix's time / the tree's, over shared_prefix's positions / the tree's.",
                  default=False, mode="tree", context_grad="full", continuation_groups=1),
    PackedVariant("standalone", mode="standalone", context_grad="full", continuation_groups=1),
    PlainVariant(),
)
VARIANTS = {v.name: v for v in _ALL}
DEFAULT_VARIANTS = tuple(v.name for v in _ALL if v.default)  # not the tree: it pays only on data that shares histories


@dataclass
class Workload:
    session: Session  # the bench's (or a variant's) setup: its config with the savings chosen, kinds and plan
    steps: list[list[int]]  # pack ids of each optimizer step of one epoch, as `packtrain train` takes them
    _variants: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, session: Session) -> Workload:
        steps = StepPlan.for_run(session.cfg, session.plan, session.examples, 1)
        return cls(session, [steps.pack_ids(0, i) for i in range(steps.steps_per_epoch)])

    @property
    def cfg(self) -> Config:
        return self.session.run_cfg

    @property
    def examples(self) -> list:
        return self.session.examples

    @property
    def plan(self) -> Plan:
        return self.session.plan

    @property
    def device(self) -> torch.device:
        return self.session.info.device

    def for_variant(self, variant) -> Workload:
        """The workload a variant trains: the config under its overrides, set up as `packtrain train` sets it up
        (its kinds, its plan; once)."""
        if variant.name not in self._variants:
            session = open_session(variant.config(self.cfg), self.session.info, examples=self.examples,
                                   savings=False)
            self._variants[variant.name] = Workload.of(session)
        return self._variants[variant.name]


def trainable_by_name(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Trainable parameters by a name that does not depend on checkpoint wrapping, so two copies line up."""
    return {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters() if p.requires_grad}


class Trainable:
    """A model's trainable parameters, reset to one initial state (and a fresh optimizer) before every run."""

    def __init__(self, params: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], cfg: Config, n_steps: int):
        self.params, self.cfg, self.n_steps = params, cfg, n_steps
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(initial[name])
        self.initial = {n: p.detach().clone() for n, p in params.items()}

    def reset(self, n_steps: int | None = None):
        """The initial values again, and a fresh optimizer and schedule (over ``n_steps``, default the config
        plan's)."""
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(self.initial[name])
                p.grad = None
        optimizer = build_optimizer(self.params.values(), self.cfg.optim)
        return optimizer, build_scheduler(optimizer, self.cfg.optim, n_steps or self.n_steps)

    def update(self, optimizer, scheduler) -> None:
        max_norm = self.cfg.optim.max_grad_norm
        torch.nn.utils.clip_grad_norm_(list(self.params.values()), math.inf if max_norm is None else max_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


class Models:
    """The packtrain model (every packtrain variant) and the plain one, from one base and one initial adapter."""

    def __init__(self, work: Workload):
        cfg, session = work.cfg, work.session
        session.build_model(meta=False, copy_base=True)  # the copy: before packtrain patches anything
        model, self.lm, self.backend, plain_base = session.model, session.lm, session.backend, session.base_copy
        self.lm.train()
        t = cfg.train
        # each packtrain variant's root over the same assembled model, under its config (its context mode)
        self.lms = {v.name: root(model, v.config(cfg)).train() for v in VARIANTS.values()}
        if t.activation_checkpointing or t.offload:  # what a transformers user turns on
            plain_base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.plain = get_peft_model(plain_base, lora_config(cfg, plain_base)).to(work.device).train()
        packed = trainable_by_name(model)
        # peft draws lora_A at random: the plain model starts from packtrain's initial adapter
        self.packtrain_state = Trainable(packed, packed, cfg, len(work.steps))
        self.plain_state = Trainable(trainable_by_name(self.plain), packed, cfg, len(work.steps))

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.packtrain_state.params.values())

    def evaluate(self, variant: str, work: Workload) -> float:
        """Mean per-example loss of the adapter a run left, each variant computing it its own way: the packed
        forward (under the variant's context mode), the standalone forward, or transformers' forward with labels on
        the plain model, so that equal final losses compare independent computations."""
        return VARIANTS[variant].evaluate(self, work)


def whole_example(ex, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``concat(P, item, target)`` and labels that are -100 outside the target."""
    input_ids = torch.tensor([ex.prefix_ids + ex.item_ids + ex.target_ids], device=device)
    labels = input_ids.clone()
    labels[:, :len(ex.prefix_ids) + len(ex.item_ids)] = -100
    return input_ids, labels


@torch.no_grad()
def plain_mean_loss(plain: torch.nn.Module, work: Workload) -> float:
    """transformers' own loss (mean over the target tokens) of every example, averaged; dropout off."""
    was_training = plain.training
    plain.eval()
    losses = []
    for ex in work.examples:
        input_ids, labels = whole_example(ex, work.device)
        losses.append(plain(input_ids=input_ids, labels=labels, use_cache=False).loss.item())
    plain.train(was_training)
    return sum(losses) / len(losses)


def plain_epoch(models: Models, work: Workload, max_steps: int | None = None) -> list[float]:
    """One epoch of the loop a transformers + peft user writes: one whole example per forward."""
    state = models.plain_state
    optimizer, scheduler = state.reset()
    losses = []
    for pack_ids in work.steps[:max_steps]:
        batch = [work.examples[e] for i in pack_ids for e in work.plan.packs[i].examples]
        total = 0.0
        for ex in batch:
            input_ids, labels = whole_example(ex, work.device)
            loss = models.plain(input_ids=input_ids, labels=labels, use_cache=False).loss
            (loss / len(batch)).backward()
            total += loss.item()
        state.update(optimizer, scheduler)
        losses.append(total / len(batch))
    return losses


def run_variant(name: str, models: Models, work: Workload, max_steps: int | None = None) -> list[float]:
    return VARIANTS[name].epoch(models, work, max_steps)


def one_pack_workload(shape, source: str) -> tuple[Workload, Models]:
    """The profiling tools' setup (tools/bench: compare_ops, profile_pack): the cpu preset's config with a token
    budget that holds each prompt of ``shape`` (:class:`packtrain.bench.presets.Shape`) with all its continuations
    in one pack, its generated examples set up as `packtrain train` sets them up on one CPU rank (the
    plan, the savings), and the bench's models. ``source`` names the config's origin in its errors."""
    preset = get_preset("cpu")
    preset.config["packing"]["token_budget"] = shape.prefix_tokens + shape.continuations * shape.cont_tokens[1] + sum(
        n * longest for n, _, longest in shape.extra)
    cfg = config_from_dict(preset.config, source=source)
    examples = generate_examples(shape, text_config(config_dict_of(cfg))["vocab_size"], 0)
    work = Workload.of(open_session(cfg, DistInfo(0, 1, 0, torch.device("cpu")), "train", examples=examples))
    return work, Models(work)


def first_unit(work: Workload, variant: str):
    """(the unit, what it runs on) of the first pack ``variant`` trains in its first step, on one rank."""
    own = work.for_variant(VARIANTS[variant])
    kinds = own.session.kinds
    unit = rank_units(own.plan, own.steps[0], kinds, 0, 1)[0]
    return unit, build(unit, own.plan, own.examples, kinds).work
