"""The kinds of unit and the unit runner: the one place that decides what a unit is and how it runs.

A *unit* is one forward/backward of an optimizer step (or one evaluation, or one generation). A run's kinds are
built once from its config (:meth:`Kinds.of`: the kind of its packs, configured -- a pack's groups with their
count, the walk with its spec), and the planner (:meth:`Kinds.plan`) and the units (:meth:`Kinds.units`, called by
:func:`packtrain.run.step.rank_units`) read that one object; nothing else decides a unit's kind. Each kind is one class below,
with how its packs are planned, what it builds, how it trains and evaluates, the calls it issues and its padding
(the equal-call rule, :mod:`packtrain.packed.equal`). Adding a kind is adding a class and its ``packing.mode`` (or
setting) in :meth:`Kinds.named`.

============  ==============================================  ==================================  =======================
kind          computes                                        calls of the root per unit          padding (pad a slot)
============  ==============================================  ==================================  =======================
pack          a whole pack ``[P, C1..Cn]`` in one buffer      1                                   a dummy pack unit
groups        a pack's continuations in G groups against      G + 1 (P, each group): a pack with  a dummy pack unit
              one P graph (``packing.continuation_groups``)   fewer continuations fills groups
standalone    one example ``concat(P, C)`` alone              1                                   a dummy example
tree          a prompt group's continuations as one prefix    1                                   a dummy tree unit
              tree (``packing.mode: tree``): every shared
              run of tokens once
walk          an example over the budget, chunk by chunk      the slot's walk calls (largest of   a dummy walk; the slot's
              (``packing.on_overflow: walk``)                 the slot on any rank)               largest walk calls
items         a pack's items against P, then decoded          P (once per prompt group), items,   a dummy unit; decoding
              together (generation)                           one per decoded token               pads to the longest
============  ==============================================  ==================================  =======================

A *dummy* is any unit on one example, its loss scaled by zero (NaN stays NaN, so an injected NaN shows on every
rank), its results dropped: the calls without the learning (:data:`Unit.dummy` is a flag, not a kind).

The loss scale: a unit's ``loss_sum`` (the sum of its examples' mean target cross-entropies) is multiplied by
``scale``, which the caller derives with :func:`step_scale` from the examples of the whole optimizer step, so that
the update is the mean of per-example losses whatever the split into packs, units or ranks.

What a unit is needs no torch: ``packtrain plan`` reads the kinds (the largest unit, its shape) without importing
it. What builds and runs a unit imports the packed computation where it does so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

from packtrain.config import Config, WalkSpec
from packtrain.data.images import ImageLoader, load_image_processor
from packtrain.data.jsonl import processor_dir
from packtrain.data.planner import Pack, Plan, plan_packs, plan_tree_packs, target_count
from packtrain.data.walk_calls import WalkCalls
from packtrain.memory.estimate import UnitShape
from packtrain.run.objective import Objective, Sft, Terms

if TYPE_CHECKING:
    from packtrain.packed.groups import Groups
    from packtrain.packed.layout import PackLayout

U = TypeVar("U")


@dataclass(frozen=True)
class Kinds:
    """A run's kinds, built once from the config (:meth:`of`): the kind of its packs (a whole pack, a pack in its
    groups, one example alone or a prefix tree), the walk with its spec (``packing.on_overflow: walk``) and the
    images' loader. The planner (:meth:`plan`) and the units (:meth:`units`) read this one object."""
    mode: str  # packing.mode, for a run's header and records
    pack: Kind  # the kind of the packs that are not walked
    walk: WalkKind | None = None  # packing.on_overflow: walk (None: no example is walked)
    images: ImageLoader | None = None
    objective: Objective = Sft()  # train.objective: what a unit's loss is (packtrain.run.objective)

    @classmethod
    def of(cls, cfg: Config, images: ImageLoader | None = None, n_groups: int | None = None) -> Kinds:
        """The config's kinds; ``n_groups`` in place of ``packing.continuation_groups`` (1: whole packs)."""
        p = cfg.packing
        groups = p.continuation_groups if n_groups is None else n_groups
        return cls.named(p.mode, groups, cfg.walk_spec(), images, Objective.of(cfg))

    @classmethod
    def named(cls, mode: str, n_groups: int = 1, walk_spec: WalkSpec | None = None,
              images: ImageLoader | None = None, objective: Objective | None = None) -> Kinds:
        """The kinds of ``packing.mode`` ``mode`` with these settings (tests and tools without a config). Under
        dpo one example alone is a pair's two answers alone (one unit: its loss needs both)."""
        objective = objective or Sft()
        if n_groups > 1:
            pack = GroupsKind(n_groups)
        elif mode == "standalone" and objective.paired:
            pack = StandalonePairKind()
        else:
            pack = _PACK_KINDS[mode]()
        return cls(mode, pack, None if walk_spec is None else WalkKind(walk_spec), images, objective)

    @property
    def n_groups(self) -> int:
        return self.pack.n_groups

    @property
    def walk_spec(self) -> WalkSpec | None:
        return None if self.walk is None else self.walk.spec

    def plan(self, cfg: Config, examples) -> Plan:
        """The plan of ``examples`` under the config's packing settings, by the pack kind's planner."""
        return self.pack.plan(cfg, examples, self.walk_spec)

    def kind_of(self, pack: Pack) -> Kind:
        """The kind of ``pack``'s units: the walk for a walked pack, else the run's pack kind."""
        return self.walk if pack.walk is not None else self.pack

    def units(self, pack: Pack) -> list[Unit]:
        """The units of one pack: the one place a unit's kind is decided."""
        return self.kind_of(pack).units(pack)

    def check(self, examples, split: str = "data.train") -> None:
        """The objective refuses, before the model is built, data it cannot train on (what the kinds build with the
        data's images is the support table's: packtrain/config/support.py)."""
        self.objective.check(examples, split)

    def runs(self, stats: dict | None = None) -> list[str]:
        """How the run's packs and walks run, for a run's header and the bench's summary (``stats``: the plan's,
        :func:`packtrain.data.planner.plan_stats`, for the walk's line)."""
        kinds = ([self.walk] if self.walk is not None else []) + [self.pack]
        return [line for line in (k.runs(stats or {}) for k in kinds) if line]

    def whole_packs(self) -> Kinds:
        """The same kinds with each pack one call (an evaluation: no gradient to keep per group)."""
        return dataclasses.replace(self, pack=self.pack.whole())

    def pad_order(self) -> tuple[Kind, ...]:
        """The order a rank runs its units in: its packs first, then its walks (a generation's items alone)."""
        return (self.pack, ITEMS) + ((self.walk,) if self.walk is not None else ())


def plan_for(cfg: Config, examples) -> Plan:
    """The plan of ``examples`` under a config's packing settings (its kinds' planner)."""
    return Kinds.of(cfg).plan(cfg, examples)


@dataclass(frozen=True)
class Unit:
    kind: Kind
    prompt: int
    examples: tuple[int, ...]
    dummy: bool = False
    walk: WalkCalls | None = None  # a walked example's calls: the largest its slot has on any rank

    @property
    def real_examples(self) -> tuple[int, ...]:
        """The examples whose results count: none for a dummy."""
        return () if self.dummy else self.examples


@dataclass
class Built:
    """A unit and what it runs on: a layout (a pack, a standalone or a walked example) or a pack's groups."""
    unit: Unit
    work: PackLayout | Groups | Sides | None
    terms: Terms | None = None  # what its loss needs of its examples (None: a dummy's, or an evaluation's)

    @property
    def positions(self) -> int:
        return self.work.length


@dataclass
class UnitResult:
    loss_sum: float  # the sum of its examples' losses (0 for a dummy)
    per_example: list[float]  # in the unit's example order (empty for a dummy)
    target_tokens: list[int]
    positions: int  # buffer positions computed for real examples (0 for a dummy)
    calls: int  # forward calls of the root module: each runs FSDP's collectives
    # evaluating a whole pack: its target tokens' log-probabilities [M], example after example (read only by
    # evaluate(tokens=True), grpo's precomputed reference)
    token_logp: object | None = None


def step_scale(step_examples: int) -> float:
    """The loss scale of every unit of a step, on every rank: 1 / (the step's examples, all ranks together). FSDP
    sums the ranks' gradients (:func:`packtrain.models.wrap.wrap`), so the update is the mean over the step's
    examples, and a pack's backward is the same on any world size."""
    return 1.0 / step_examples


# -- the kinds --------------------------------------------------------------------------------------------------
class Kind:
    """One kind of unit, configured (a pack's groups with their count, the walk with its spec). Subclasses set the
    class attributes and override what differs."""
    name: ClassVar[str]
    capped: ClassVar[bool] = True  # train.max_positions skips a unit over it
    shares_prefix: ClassVar[bool] = True  # P computed once for all its examples (the memory estimate's packs)
    n_groups: int = 1  # continuation groups a pack of this kind runs in (1: one call)

    def plan(self, cfg: Config, examples, walk_spec: WalkSpec | None) -> Plan:
        """The packs of ``examples`` for a run of this kind (packs flat, or ``walk_spec``'s walked examples apart)."""
        from packtrain.packed.context import context_grad

        p = cfg.packing
        return plan_packs(examples, p.token_budget, p.max_continuations, p.on_overflow, cfg.train.seed,
                          walk_spec=walk_spec, frozen=not context_grad(p.context_grad).prefix_in_graph)

    def units(self, pack: Pack) -> list[Unit]:
        return [Unit(self, pack.prompt, pack.examples)]

    def whole(self) -> Kind:
        """This kind with a pack in one call (:meth:`Kinds.whole_packs`)."""
        return self

    def positions(self, unit: Unit, plan: Plan, examples) -> int:
        """The buffer positions of ``unit``, without building it."""
        return len(plan.prompts[unit.prompt]) + sum(examples[e].len_continuation for e in unit.examples)

    def build(self, unit: Unit, plan: Plan, examples, images: ImageLoader | None):
        """What the unit runs on: a whole pack's layout, with its examples' images loaded (in buffer order)."""
        from packtrain.packed.layout import build_pack_layout

        prefix, chosen, spec = _unit_parts(unit, plan, examples, images)
        refs = [tuple(getattr(ex, "images", ())) for ex in chosen]
        layout = build_pack_layout(prefix, _continuations(chosen, refs), spec)
        return _with_images(layout, refs, images)

    def call(self, work):
        """The one call of the root a one-call unit makes on what it built."""
        from packtrain.packed.lm import PackCall

        return PackCall(work)

    def forward(self, lm, work):
        """The unit's forward: its loss output (:class:`packtrain.packed.loss.LossOutput`)."""
        return lm(self.call(work))

    def train(self, lm, unit: Unit, work, scale: float, objective: Objective, terms: Terms | None):
        """Forward and backward (gradients into the parameters, the objective's loss times ``scale``; a dummy's
        ``terms`` are None: its examples' own loss, scaled to nothing): (the loss, per-example losses, target tokens
        per example). Under dpo per_step, the reference forward comes first."""
        from packtrain.packed.loss import require_grad

        reference = objective.reference_log_probs(lm, lambda: self.forward(lm, work))
        out = self.forward(lm, work)
        loss = out.loss_sum if terms is None else objective.loss(out, terms, reference)
        require_grad(loss)
        (loss * scale).backward()
        return float(loss.detach()), out.per_example.tolist(), out.target_tokens.tolist()

    def evaluate(self, lm, unit: Unit, work):
        """The per-example losses under no_grad (the caller's): (their sum, per-example losses, target tokens, the
        target tokens' log-probabilities [M])."""
        out = self.forward(lm, work)
        return out.per_example.sum().item(), out.per_example.tolist(), out.target_tokens.tolist(), out.token_logp

    def calls(self, unit: Unit, training: bool) -> int:
        """The forward calls of the root the unit issues: the same for every unit of a slot on every rank."""
        return 1

    def pad(self, per_rank: list[list[Unit]], rank: int) -> list[Unit]:
        """The equal-call rule for this kind: ``rank``'s units padded to the most any rank has."""
        return pad_slots(per_rank, rank, _dummy_of)

    def attention_pairs(self, unit: Unit, plan: Plan, examples) -> int:
        """The unit's query-key pairs of causal attention per layer and head
        (:mod:`packtrain.data.attention_pairs`): P's own, and each continuation's against P and itself."""
        from packtrain.data.attention_pairs import pack_pairs

        return pack_pairs(len(plan.prompts[unit.prompt]), self.segments(unit, plan, examples))

    def group_positions(self, lengths: list[int]) -> int | None:
        """The continuation positions of the largest of a unit's groups (None: one call holds them all)."""
        return None

    def segments(self, unit: Unit, plan: Plan, examples) -> list[int]:
        """The lengths of the buffer's segments after P (each continuation, or each node of a tree)."""
        return [examples[e].len_continuation for e in unit.examples]

    def leaves(self, unit: Unit, plan: Plan, examples) -> int | None:
        """A tree's leaves, what ``packing.max_continuations`` bounds there (None: the unit is not a tree)."""
        return None

    def describe(self, unit: Unit) -> str:
        """What the unit is, in a line of output: "pack", "example", ..."""
        return self.name

    def detail(self, unit: Unit) -> str:
        """How it runs, after its continuations' count in a line of output ("" or " in 3 groups", ...)."""
        return ""

    def runs(self, stats: dict) -> str:
        """How a run's units of this kind run, for a run's header and the bench's summary ("": nothing to say)."""
        return ""


class PackKind(Kind):
    name = "pack"


@dataclass(frozen=True)
class GroupsKind(Kind):
    """A pack's continuations in ``n_groups`` groups against one P graph (:mod:`packtrain.packed.groups`)."""
    n_groups: int
    name: ClassVar[str] = "groups"

    def build(self, unit, plan, examples, images):
        """One layout per group (P and the group's continuations), and each group's weight."""
        from packtrain.packed.groups import Groups, split
        from packtrain.packed.layout import build_pack_layout

        prefix, chosen, spec = _unit_parts(unit, plan, examples, images)
        runs = split([len(ex.item_ids) + len(ex.target_ids) for ex in chosen], self.n_groups)
        layouts = []
        for run in runs:  # a run past the last continuation: a filler group of the first, weight 0
            group = [chosen[i] for i in run or [0]]
            refs = [tuple(getattr(ex, "images", ())) for ex in group]
            layouts.append(_with_images(build_pack_layout(prefix, _continuations(group, refs), spec), refs, images))
        return Groups(layouts, [1.0 if run else 0.0 for run in runs], [run or [0] for run in runs])

    def train(self, lm, unit, work, scale, objective, terms):
        from packtrain.packed.groups import train_groups

        loss_of = None if terms is None else lambda g, out: objective.loss(out, terms.subset(work.runs[g]))
        total, losses = train_groups(lm, work, scale, loss_of)
        return total, losses, _group_targets(work)

    def evaluate(self, lm, unit, work):
        from packtrain.packed.groups import eval_groups

        total, losses = eval_groups(lm, work)
        return total, losses, _group_targets(work), None

    def calls(self, unit, training):
        return self.n_groups + 1

    def whole(self):
        return PackKind()

    def group_positions(self, lengths):
        from packtrain.packed.groups import split

        return max(sum(lengths[i] for i in run) for run in split(lengths, self.n_groups))

    def describe(self, unit):
        return "pack"

    def detail(self, unit):
        return f" in {self.n_groups} groups"

    def runs(self, stats):
        return f"continuation_groups {self.n_groups}: each pack's continuations in {self.n_groups} groups against " \
               "one P graph"



class StandaloneKind(Kind):
    name = "standalone"
    shares_prefix = False

    def units(self, pack):
        return [Unit(self, pack.prompt, (e,)) for e in pack.examples]

    def build(self, unit, plan, examples, images):
        """One example alone: ``concat(P, C)``, the model's own forward's sequence."""
        return _alone(unit, plan, examples, images)

    def attention_pairs(self, unit, plan, examples):
        """Each example's whole sequence, P included (a pair's two answers: both sequences)."""
        from packtrain.data.attention_pairs import causal_pairs

        p = len(plan.prompts[unit.prompt])
        return sum(causal_pairs(p + examples[e].len_continuation) for e in unit.examples)

    def call(self, work):
        from packtrain.packed.lm import StandaloneCall

        return StandaloneCall(work)

    def describe(self, unit):
        return "example"


class StandalonePairKind(StandaloneKind):
    """Under dpo, a preference pair's two answers each alone (``concat(P, item, answer)``, the model's own forward
    on each), in one unit: the pair's loss needs both log-probabilities before its backward."""
    name = "standalone pair"

    def units(self, pack):
        """One unit per pair: the planner lays a pair's answers out side by side (chosen, rejected)."""
        return [Unit(self, pack.prompt, pack.examples[k:k + 2]) for k in range(0, len(pack.examples), 2)]

    def build(self, unit, plan, examples, images):
        return Sides([_alone(dataclasses.replace(unit, examples=(e,)), plan, examples, images)
                      for e in unit.examples])

    def forward(self, lm, work):
        from packtrain.packed.loss import concat_outputs

        return concat_outputs([super(StandalonePairKind, self).forward(lm, layout) for layout in work.layouts])

    def calls(self, unit, training):
        return len(unit.examples)

    def segments(self, unit, plan, examples):
        """After the first answer's P: that answer, then the second answer's P and answer (both graphs are alive
        until the pair's backward: the memory estimate counts both sequences)."""
        p = len(plan.prompts[unit.prompt])
        first, *rest = (examples[e].len_continuation for e in unit.examples)
        return [first, *(p + n for n in rest)]

    def positions(self, unit, plan, examples):
        return len(plan.prompts[unit.prompt]) + sum(self.segments(unit, plan, examples))

    def pad(self, per_rank, rank):
        return pad_slots(per_rank, rank, lambda unit: dataclasses.replace(unit, dummy=True))

    def describe(self, unit):
        return "pair alone"


@dataclass
class Sides:
    """A standalone pair's two layouts, each answer alone."""
    layouts: list

    @property
    def length(self) -> int:
        return sum(layout.length for layout in self.layouts)

    def to(self, device) -> Sides:
        return Sides([layout.to(device) for layout in self.layouts])


@dataclass(frozen=True)
class WalkKind(Kind):
    """An example over the budget, walked chunk by chunk under ``spec`` (:mod:`packtrain.packed.walk`)."""
    spec: WalkSpec
    name: ClassVar[str] = "walk"
    capped: ClassVar[bool] = False  # one window of it is in memory at a time
    shares_prefix: ClassVar[bool] = False

    def units(self, pack):
        return [Unit(self, pack.prompt, pack.examples, walk=pack.walk)]

    def build(self, unit, plan, examples, images):
        return _alone(unit, plan, examples, images)

    def train(self, lm, unit, work, scale, objective, terms):
        from packtrain.packed.walk import train_walk

        r = train_walk(lm, work, self.spec, scale, unit.walk, unit.dummy)
        return r.loss, [r.loss], [r.target_tokens]

    def evaluate(self, lm, unit, work):
        from packtrain.packed.walk import eval_walk

        r = eval_walk(lm, work, self.spec, unit.walk.chunks, unit.dummy)
        return r.loss, [r.loss], [r.target_tokens], None

    def calls(self, unit, training):
        """P, then the slot's no-grad forwards and windows with grad (horizon all: P's forward comes first);
        evaluating, P and every chunk."""
        if not training:
            return unit.walk.chunks + 1
        return unit.walk.forwards + unit.walk.backwards + (1 if self.spec.horizon is None else 0)

    def pad(self, per_rank, rank):
        """Dummies as every kind pads, and every walk of slot k runs the largest walk calls any rank has there (the
        real walks of slot k alone decide them: a dummy's own, its filler's, are another slot's)."""
        out = super().pad(per_rank, rank)
        for k, unit in enumerate(out):
            real = [units[k].walk for units in per_rank if k < len(units)]
            slot = real[0]
            for other in real[1:]:
                slot = slot.pad(other)
            out[k] = dataclasses.replace(unit, walk=slot)
        return out

    def describe(self, unit):
        return "walked example"

    def detail(self, unit):
        return f" in {unit.walk.chunks} chunks"

    def runs(self, stats):
        return (f"on_overflow {self.spec.describe()}: {stats.get('walked', 0)} examples over the budget in "
                f"{stats.get('walk_chunks', 0)} chunks")


class TreeKind(Kind):
    """A prompt group's examples as a prefix tree (``packing.mode: tree``, :mod:`packtrain.data.prefix_tree`): every run
    of tokens that several continuations share is computed once (:mod:`packtrain.packed.tree`)."""
    name = "tree"

    def plan(self, cfg, examples, walk_spec):
        """The tree planner's packs (:func:`packtrain.data.planner.plan_tree_packs`)."""
        p = cfg.packing
        return plan_tree_packs(examples, p.token_budget, p.max_continuations, p.on_overflow, cfg.train.seed)

    def positions(self, unit, plan, examples):
        return len(plan.prompts[unit.prompt]) + sum(self.segments(unit, plan, examples))

    def segments(self, unit, plan, examples):
        """The tree's nodes, as the planner counts them (:func:`packtrain.data.prefix_tree.example_tree`)."""
        from packtrain.data.prefix_tree import example_tree

        return [len(n.tokens) for n in example_tree([examples[e] for e in unit.examples]).nodes]

    def attention_pairs(self, unit, plan, examples):
        """The tree's (:func:`packtrain.data.tree_packs.attention_pairs`): each token against P, its ancestors and
        its own node's earlier tokens."""
        from packtrain.data.prefix_tree import example_tree
        from packtrain.data.tree_packs import attention_pairs

        return attention_pairs(len(plan.prompts[unit.prompt]), example_tree([examples[e] for e in unit.examples]))

    def leaves(self, unit, plan, examples):
        from packtrain.data.prefix_tree import example_tree

        stop = example_tree([examples[e] for e in unit.examples]).stop
        return sum(end == i + 1 for i, end in enumerate(stop))  # a leaf's subtree is itself, as pack_tree counts

    def build(self, unit, plan, examples, images):
        """The pack's prefix tree; images: the buffer holds each shared one once, in the tree's order."""
        from packtrain.data.prefix_tree import tree_salt
        from packtrain.packed.tree import build_tree_layout

        prefix, chosen, spec = _unit_parts(unit, plan, examples, images)
        per_example = [tuple(getattr(ex, "images", ())) for ex in chosen]
        layout = build_tree_layout(prefix, _continuations(chosen, per_example), spec,
                                   image_keys=[tree_salt(ex) for ex in chosen])
        return _with_images(layout, [(per_example[j][k],) for j, k in layout.image_sources], images)

    def call(self, work):
        from packtrain.packed.lm import TreeCall

        return TreeCall(work)

    def describe(self, unit):
        return "tree pack"


class ItemsKind(Kind):
    """A generation's unit (:mod:`packtrain.run.generate`): built, padded and decoded there, never trained."""
    name = "items"

    def build(self, unit, plan, examples, images):
        """P and the unit's examples' items alone, those with an item (None when no example has one): a
        generation's prompts."""
        from packtrain.packed.layout import build_pack_layout

        prefix, chosen, spec = _unit_parts(unit, plan, examples, images, lambda ex: bool(ex.item_ids))
        if not chosen:
            return None
        refs = [_item_images(ex, spec) for ex in chosen]
        conts = _continuations(chosen, refs, items_alone=True)
        return _with_images(build_pack_layout(prefix, conts, spec, targets=False), refs, images)


_PACK_KINDS = {"shared_prefix": PackKind, "standalone": StandaloneKind, "tree": TreeKind}  # packing.mode's
ITEMS = ItemsKind()


def items_units(plan: Plan, pack_ids: list[int]) -> list[Unit]:
    """A generation's units: one per pack, its items against its P."""
    return [ITEMS.units(plan.packs[i])[0] for i in pack_ids]


def pad_units(per_rank: list[list[Unit]], rank: int, kinds: Kinds) -> list[Unit]:
    """``rank``'s units under the equal-call rule: kind by kind in :meth:`Kinds.pad_order` (its packs, then its
    walks), each kind padded by its own rule."""
    out = []
    for kind in kinds.pad_order():
        mine = [[u for u in units if u.kind is kind] for units in per_rank]
        if any(mine):
            out += kind.pad(mine, rank)
    return out


def pad_slots(per_rank: list[list[U]], rank: int, dummy_of) -> list[U]:
    """``rank``'s units padded to the most any rank has, with dummies (``dummy_of``) made from its first unit, or
    from the first unit any rank has: the slots every kind pads (:mod:`packtrain.packed.equal`)."""
    if not any(per_rank):
        return []
    mine = per_rank[rank]
    filler = mine[0] if mine else next(u for units in per_rank for u in units)
    slots = max(len(units) for units in per_rank)
    return mine + [dummy_of(filler)] * (slots - len(mine))


def _dummy_of(unit: Unit) -> Unit:
    return dataclasses.replace(unit, examples=unit.examples[:1], dummy=True)


def _group_targets(work: Groups) -> list[int]:
    return [n for lay, w in zip(work.layouts, work.weights) if w for n in lay.target_counts.tolist()]


def largest_unit(plan: Plan, examples, kinds: Kinds, max_positions: int | None = None) -> Unit:
    """The unit with the most positions, what one forward holds at most; units over ``train.max_positions`` are
    skipped in training. Walked examples hold one chunk's window at a time, so a plan's other units come first."""
    units = [u for pack in plan.packs for u in kinds.units(pack)]
    units = [u for u in units if u.kind.capped] or units
    sized = [(u.kind.positions(u, plan, examples), u) for u in units]
    if max_positions is not None:
        sized = [s for s in sized if not s[1].kind.capped or s[0] <= max_positions]
        if not sized:
            what = units[0].kind.describe(units[0])
            raise ValueError(f"train.max_positions={max_positions}: every {what} is longer, so training would skip "
                             "them all")
    return max(sized, key=lambda s: s[0])[1]


def unit_shape(cfg: Config, plan: Plan, examples, kinds: Kinds | None = None) -> UnitShape:
    """The shape of the plan's largest unit under the config (``kinds``: the run's, else the config's), what the
    memory estimate sizes."""
    unit = largest_unit(plan, examples, kinds or Kinds.of(cfg), cfg.train.max_positions)
    lengths = unit.kind.segments(unit, plan, examples)
    return UnitShape(len(plan.prompts[unit.prompt]), lengths, [target_count(examples[e]) for e in unit.examples],
                     unit.kind.group_positions(lengths), unit.kind.shares_prefix,
                     unit.kind.leaves(unit, plan, examples), unit.kind.attention_pairs(unit, plan, examples))


def choose_savings(cfg: Config, plan: Plan, examples, info, kinds: Kinds | None = None):
    """The memory savings of a run (train, smoke, bench, pretune-fla) for its largest unit on ``info``'s device, the
    same on every rank (:mod:`packtrain.memory.savings`). Returns (the config with the chosen values, the choice)."""
    from packtrain.memory import savings
    from packtrain.memory.budget import run_budget

    choice = savings.choose(cfg, unit_shape(cfg, plan, examples, kinds), info.world_size, run_budget(cfg, info))
    return choice.apply(cfg), choice


# -- the runner -------------------------------------------------------------------------------------------------
def build(unit: Unit, plan: Plan, examples, kinds: Kinds) -> Built:
    """The unit's work, and (a real unit) what the objective's loss needs of its examples."""
    terms = None if unit.dummy else kinds.objective.terms([examples[e] for e in unit.examples])
    return Built(unit, unit.kind.build(unit, plan, examples, kinds.images), terms)


def over_cap(built: Built, max_positions: int | None) -> bool:
    """``train.max_positions``: a unit of a capped kind over it is skipped."""
    return max_positions is not None and built.unit.kind.capped and built.positions > max_positions


def run_unit(lm, built: Built, kinds: Kinds, device, scale: float | None = None) -> UnitResult:
    """Run one unit on ``device``: training (forward and backward, gradients accumulated into the parameters,
    ``loss_sum * scale``) when ``scale`` is given, else evaluation under no_grad."""
    import torch

    from packtrain.packed import equal

    unit, work = built.unit, built.work.to(device)
    kind, training = unit.kind, scale is not None
    calls = lm.calls
    if not training:
        with torch.no_grad():
            loss_sum, per_example, targets, tokens = kind.evaluate(lm, unit, work)
    else:
        scale = equal.silenced(scale) if unit.dummy else scale
        loss_sum, per_example, targets = kind.train(lm, unit, work, scale, kinds.objective, built.terms)
        tokens = None
    calls = lm.calls - calls
    # under dpo per_step a unit's reference forward issues the calls of its training forward again
    expected = kind.calls(unit, training) * (2 if training and kinds.objective.per_step else 1)
    if calls != expected:  # the equal-call rule broken: another rank would wait for a call this one never makes
        raise RuntimeError(f"a {kind.name} unit issued {calls} forward calls, its kind says {expected}")
    if unit.dummy:
        return UnitResult(0.0, [], [], 0, calls)
    return UnitResult(loss_sum, per_example, targets, work.length, calls, tokens)


# -- what the kinds' builds share ---------------------------------------------------------------------------------
def _unit_parts(unit: Unit, plan: Plan, examples, images: ImageLoader | None, keep=None):
    """(P, the unit's examples, those ``keep`` takes, the vision spec); refuses images without a loader."""
    chosen = [examples[e] for e in unit.examples if keep is None or keep(examples[e])]
    if any(getattr(ex, "images", ()) for ex in chosen) and images is None:
        raise ValueError(f"{chosen[0].source}: examples with images need a vision-language model and an image "
                         "processor")
    return plan.prompts[unit.prompt], chosen, images.spec if images is not None else None


def _continuations(chosen, refs, items_alone: bool = False) -> list:
    """The examples as layout continuations, with their images' grids (``items_alone``: their items, no target)."""
    from packtrain.packed.layout import Continuation

    return [Continuation(ex.item_ids, () if items_alone else ex.target_ids, [r.grid_thw for r in ex_refs],
                         () if items_alone else getattr(ex, "spans", ())) for ex, ex_refs in zip(chosen, refs)]


def _alone(unit: Unit, plan: Plan, examples, images: ImageLoader | None):
    """The unit's one example alone: ``concat(P, C)``."""
    from packtrain.packed.layout import build_standalone_layout

    prefix, (ex,), spec = _unit_parts(unit, plan, examples, images)
    refs = [tuple(getattr(ex, "images", ()))]
    (cont,) = _continuations([ex], refs)
    return _with_images(build_standalone_layout(prefix, cont, spec), refs, images)


def _with_images(layout, refs, images: ImageLoader | None):
    """``layout`` with the pixels of ``refs`` (per example, in buffer order) loaded, where there are any."""
    flat = [r for ex_refs in refs for r in ex_refs]
    if flat:
        layout.pixel_values, _ = images.load(flat)
    return layout


def _item_images(ex, spec) -> tuple:
    """The images of an example's item alone (under ``data.train_on: all`` later user turns may hold more)."""
    refs = tuple(getattr(ex, "images", ()))
    if not refs:
        return refs
    pads, n = ex.item_ids.count(spec.image_token_id), 0
    for k, ref in enumerate(refs):
        n += spec.tokens(ref.grid_thw)
        if n > pads:
            return refs[:k]
    return refs


def image_loader(cfg: Config, model, examples) -> ImageLoader | None:
    """The loader for examples' images (None when no example has one); refuses a text-only model."""
    from packtrain.packed.patch import vision_spec

    if not any(ex.images for ex in examples):
        return None
    spec = vision_spec(model)
    if spec is None:
        raise ValueError("the data has images but the model is text-only: use a vision-language model "
                         "(model_type qwen3_5 or qwen3_5_moe)")
    return ImageLoader(load_image_processor(processor_dir(cfg)), spec)
