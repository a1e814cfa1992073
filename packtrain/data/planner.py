"""Plan packs: one shared prefix P followed by as many continuations as fit. Pure Python, no torch.

Examples are grouped by P's token ids (a dict: hash, then equality). Each group's continuations are packed
best-fit-decreasing: longest first, each into the open pack with the least room that still holds it, under
``token_budget`` positions per pack (len(P) + the sum of the continuation lengths) and ``max_continuations``.

The plan is a pure function of the data: groups are ordered by P's ids, continuations by (length descending, then
their ids and example id), so neither the input order nor the process changes it, and every rank computes the same
one. Python's salted ``hash()`` decides nothing that reaches the plan. Only the order in which packs are visited
depends on the seed: ``epoch_order`` shuffles them per epoch.

Speed: one grouping pass, one sort per group and a bisect per example; how long a million examples take:
docs/performance.md, "Planner: 1,000,000 examples" (``python tools/bench/planner.py``).

Under ``packing.mode: tree`` (:func:`plan_tree_packs`) a group's continuations are one prefix tree, cut into packs
whose tree fits the budget (the rule: :func:`packtrain.data.tree_packs.pack_tree`; docs/design.md, "Prefix trees: the
planner"); a pack's positions and attention pairs are its tree's.
"""

from __future__ import annotations

import gc
import hashlib
import random
import statistics
from bisect import bisect_left, insort
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from packtrain.config import WalkSpec
from packtrain.data.attention_pairs import causal_pairs, node_pairs, pack_pairs, tree_pairs
from packtrain.data.preference import pair_examples
from packtrain.data.prefix_tree import continuations, example_keys, example_tree, key_tokens, tree_of_keys
from packtrain.data.scored import group_examples
from packtrain.data.tree_packs import pack_tree
from packtrain.data.walk_calls import WalkCalls, walk_calls


class PlanError(ValueError):
    """Data that cannot be planned, e.g. an example longer than the token budget on its own."""


@dataclass(frozen=True)
class Pack:
    prompt: int  # index into Plan.prompts
    examples: tuple[int, ...]  # indices into the examples, in the order they are laid out after P
    positions: int  # len(P) + sum of the continuation lengths (a tree pack: len(P) + its tree's tokens)
    # its query-key pairs of causal attention, per layer and head (data/attention_pairs.py): a flat pack's (a walked
    # example's, of its whole sequence), a tree pack's its tree's (every token reads P, its ancestors and its node's
    # earlier ones)
    attention_pairs: int
    walk: WalkCalls | None = None  # an over-budget example walked on top of P (packing.on_overflow=walk)


@dataclass
class Plan:
    packs: list[Pack]
    prompts: list[tuple[int, ...]]  # P's token ids, one entry per distinct P that has a pack
    skipped: list[int]  # example indices over the budget, with on_overflow="skip"
    token_budget: int
    max_continuations: int
    seed: int = 0
    # what the planner adds to plan_stats' figures: a tree plan's shared_prefix ones (the same examples planned flat)
    figures: dict = field(default_factory=dict)


def _where(ex: Any, index: int) -> str:
    source, line = getattr(ex, "source", ""), getattr(ex, "line", 0)
    at = f"{source}:{line}: " if source else ""
    return f"{at}example {getattr(ex, 'id', index)!r}"


def _group_by_prompt(examples: Sequence[Any]) -> dict[tuple[int, ...], list[int]]:
    groups: dict[tuple[int, ...], list[int]] = {}
    # Examples loaded from one system text share one prefix tuple. Hashing a 64K-token tuple per example would
    # dominate the plan, so the same object is looked up by identity first (holding it, so its id stays unique).
    by_identity: dict[int, tuple[Any, list[int]]] = {}
    for i, ex in enumerate(examples):
        prefix = ex.prefix_ids
        hit = by_identity.get(id(prefix))
        if hit is None:
            hit = by_identity[id(prefix)] = (prefix, groups.setdefault(tuple(prefix), []))
        hit[1].append(i)
    return groups


def _best_fit_decreasing(lengths: list[int], capacity: int, max_items: int,
                         counts: list[int] | None = None) -> list[list[int]]:
    """Bins of positions into ``lengths`` (sorted descending, each <= capacity), best fit; ``counts``: the
    continuations each entry is (a preference pair is 2), at most ``max_items`` per bin (None: 1 each)."""
    bins: list[list[int]] = []
    room: list[int] = []
    held: list[int] = []
    # Open bins as one sorted list of ints room * n + bin: bisect finds the least room that fits, ties going to the
    # oldest bin. A bin that is full, or has less room than the shortest continuation, leaves the list.
    n = len(lengths)
    open_keys: list[int] = []
    shortest = lengths[-1]
    for j, length in enumerate(lengths):
        count = 1 if counts is None else counts[j]
        k = bisect_left(open_keys, length * n)
        while k < len(open_keys) and held[open_keys[k] % n] + count > max_items:  # a pair where one slot is left
            k += 1
        if k < len(open_keys):
            b = open_keys.pop(k) % n
        else:
            b = len(bins)
            bins.append([])
            room.append(capacity)
            held.append(0)
        bins[b].append(j)
        room[b] -= length
        held[b] += count
        if held[b] < max_items and room[b] >= shortest:
            insort(open_keys, room[b] * n + b)
    return bins


def _over_budget(ex: Any, index: int, prefix_len: int, length: int, token_budget: int) -> PlanError:
    return PlanError(f"{_where(ex, index)} needs {prefix_len + length} positions (P {prefix_len} + continuation "
                     f"{length}), over packing.token_budget={token_budget}; raise the budget or set "
                     "packing.on_overflow=skip")


def _family_over_budget(ex: Any, index: int, prefix_len: int, length: int, token_budget: int) -> PlanError:
    what = ("scored group needs", "all its completions'") if getattr(ex, "group", "") else \
        ("preference pair needs", "both answers'")
    return PlanError(f"{_where(ex, index)}: its {what[0]} {prefix_len + length} positions (P {prefix_len} + {what[1]} "
                     f"continuations {length}, in one pack), over packing.token_budget={token_budget}; raise the "
                     "budget or set packing.on_overflow=skip")


def _families(examples: Sequence[Any], max_continuations: int) -> dict[int, tuple[int, ...]]:
    """Each example of a preference pair or a scored group -> the indices of its family, the one that leads it first
    (the chosen answer, completion 0); empty without pairs and groups. A family always goes into one pack, so one with
    more members than ``max_continuations`` is refused."""
    out = {}
    for members in [*pair_examples(examples), *group_examples(examples)]:
        if len(members) > max_continuations:
            ex = examples[members[0]]
            raise PlanError(f"{_where(ex, members[0])}: its scored group's {len(members)} completions go into one "
                            f"pack, over packing.max_continuations={max_continuations}: raise it to {len(members)} or "
                            "more")
        for i in members:
            out[i] = members
    return out


def target_count(ex: Any) -> int:
    """The tokens of an example that carry loss (its whole target unless it has loss spans)."""
    spans = getattr(ex, "spans", ())
    return sum(b - a for a, b in spans) if spans else len(ex.target_ids)


def plan_packs(
    examples: Sequence[Any],
    token_budget: int,
    max_continuations: int,
    on_overflow: str = "error",
    seed: int = 0,
    walk_spec: WalkSpec | None = None,
    frozen: bool = False,
) -> Plan:
    """Packs for ``examples`` (anything with prefix_ids, item_ids and target_ids tuples or lists, e.g. Example).
    With ``on_overflow="walk"`` each over-budget example is a pack of its own with its walk ``WalkCalls``."""
    if not examples:
        raise PlanError("no examples to plan")
    if on_overflow == "walk" and walk_spec is None:
        raise ValueError("on_overflow='walk' needs the walk's settings (walk_spec=WalkSpec)")
    packs: list[Pack] = []
    prompts: list[tuple[int, ...]] = []
    skipped: list[int] = []
    groups = _group_by_prompt(examples)
    family = _families(examples, max_continuations)
    for prefix in sorted(groups):
        capacity = token_budget - len(prefix)
        fitting, walked = [], []
        for i in groups[prefix]:
            ex = examples[i]
            if i in family:  # a pair's two answers (a group's completions) go into one pack together, from its leader
                members = family[i]
                if members[0] == i:
                    length = sum(len(examples[j].item_ids) + len(examples[j].target_ids) for j in members)
                    if length <= capacity:
                        fitting.append((-length, ex.item_ids, ex.target_ids, str(getattr(ex, "id", "")), members))
                    elif on_overflow == "skip":
                        skipped.extend(members)
                    else:
                        raise _family_over_budget(ex, i, len(prefix), length, token_budget)
                continue
            length = len(ex.item_ids) + len(ex.target_ids)
            if length <= capacity:
                fitting.append((-length, ex.item_ids, ex.target_ids, str(getattr(ex, "id", "")), (i,)))
            elif on_overflow == "skip":
                skipped.append(i)
            elif on_overflow == "walk":
                if getattr(ex, "images", ()):
                    raise PlanError(f"{_where(ex, i)} is over packing.token_budget={token_budget} and has images: "
                                    "the walk takes text-only examples")
                walked.append((str(getattr(ex, "id", "")), i, length))
            else:
                raise _over_budget(ex, i, len(prefix), length, token_budget)
        for _, i, length in sorted(walked):
            sched = walk_calls(len(prefix), len(examples[i].item_ids), length, walk_spec, frozen)
            packs.append(Pack(len(prompts), (i,), len(prefix) + length, pack_pairs(len(prefix), [length]), sched))
        if not fitting:
            if walked:
                prompts.append(prefix)
            continue
        fitting.sort()
        order = [key[-1] for key in fitting]
        lengths = [-key[0] for key in fitting]
        counts = [len(entry) for entry in order] if family else None
        for b in _best_fit_decreasing(lengths, capacity, max_continuations, counts):
            chosen = tuple(i for j in b for i in order[j])
            cont = [len(examples[i].item_ids) + len(examples[i].target_ids) for i in chosen]
            packs.append(Pack(len(prompts), chosen, len(prefix) + sum(cont), pack_pairs(len(prefix), cont)))
        prompts.append(prefix)
    if not packs:
        raise PlanError(f"no example fits packing.token_budget={token_budget} ({len(skipped)} skipped)")
    return Plan(packs, prompts, sorted(skipped), token_budget, max_continuations, seed)


def plan_tree_packs(
    examples: Sequence[Any], token_budget: int, max_continuations: int, on_overflow: str = "error", seed: int = 0,
) -> Plan:
    """Packs for ``packing.mode: tree``: per prompt group, the prefix tree of its examples' continuations
    (item + target, examples with other images apart: :func:`packtrain.data.prefix_tree.example_keys`) cut into packs
    whose tree fits, ``len(P)`` + the pack tree's tokens <= ``token_budget`` and its distinct leaves <=
    ``max_continuations`` (the rule: :func:`packtrain.data.tree_packs.pack_tree`). A pack's ``positions`` is len(P) +
    its tree's tokens, ``pairs`` its tree's attention pairs. An example over the budget on its own goes by
    ``on_overflow`` (error or skip; the walk is not built for trees). The tree and the packs depend on the tokens
    only; examples with the same tokens keep the order of their ids."""
    if not examples:
        raise PlanError("no examples to plan")
    assert on_overflow in ("error", "skip"), "the walk under packing.mode tree: the support table refuses it"
    with _collector_paused():
        return _plan_tree_groups(examples, token_budget, max_continuations, on_overflow, seed)


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off: a tree plan makes millions of small lists and tuples and no cycles,
    and the collector's passes over them took half the planner's time (tools/bench/tree_planner.py)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _plan_tree_groups(examples: Sequence[Any], token_budget: int, max_continuations: int, on_overflow: str,
                      seed: int) -> Plan:
    packs: list[Pack] = []
    prompts: list[tuple[int, ...]] = []
    skipped: list[int] = []
    lengths: dict[int, list[int]] = {}  # the planned continuations' lengths per prompt, for shared_prefix's figures
    groups = _group_by_prompt(examples)
    family = _families(examples, max_continuations)
    for prefix in sorted(groups):
        p, fitting = len(prefix), groups[prefix]
        if family:  # a pair (a group) whose tree is over the budget: refused, or all its members skipped
            over = _families_over(examples, fitting, family, p, token_budget, on_overflow)
            skipped += over
            fitting = [i for i in fitting if i not in set(over)]
            if not fitting:
                continue
        group = list(map(examples.__getitem__, fitting))
        keys, salts = example_keys(group)
        if key_tokens(max(keys, key=len)) > token_budget - p:
            keep = []
            for k, (i, ex, key) in enumerate(zip(fitting, group, keys)):
                if p + key_tokens(key) <= token_budget:
                    keep.append(k)
                elif on_overflow == "skip":
                    skipped.append(i)
                else:
                    raise _over_budget(ex, i, p, key_tokens(key), token_budget)
            if not keep:
                continue
            fitting, group, keys = ([column[k] for k in keep] for column in (fitting, group, keys))
            salts = None if salts is None else [salts[k] for k in keep]
        tree = tree_of_keys(keys, salts, continuations(group))
        cut = pack_tree(tree, token_budget - p, max_continuations, _by_id(examples, fitting))
        cut = [(tuple(map(fitting.__getitem__, tp.paths)), tp.positions, tp.attention_pairs) for tp in cut]
        if family:
            cut = _rejoin_families(cut, examples, family, token_budget - p, max_continuations)
        for members, positions, pairs in cut:
            pack = Pack(len(prompts), members, p + positions, attention_pairs=tree_pairs(p, positions, pairs))
            packs.append(pack)
            lengths.setdefault(pack.prompt, []).extend(len(examples[i].item_ids) + len(examples[i].target_ids)
                                                   for i in pack.examples)
        prompts.append(prefix)
    if not packs:
        raise PlanError(f"no example fits packing.token_budget={token_budget} ({len(skipped)} skipped)")
    plan = Plan(packs, prompts, sorted(skipped), token_budget, max_continuations, seed)
    positions, pairs = sum(pack.positions for pack in packs), sum(pack.attention_pairs for pack in packs)
    if family:  # a pair is one entry of two continuations flat (a group of K): plan them flat (pair data is not
        # millions; a pair whose tree fits but whose two answers flat do not is left out of shared_prefix's figures,
        # and where no pair fits flat there are none: the tree's plan stands, whatever shared_prefix could not do)
        planned = [examples[i] for pack in packs for i in pack.examples]
        try:
            flat = plan_packs(planned, token_budget, max_continuations, on_overflow="skip")
        except PlanError:
            flat = None
        plan.figures = {} if flat is None else _flat_figures(
            len(flat.packs), sum(q.positions for q in flat.packs), sum(q.attention_pairs for q in flat.packs),
            positions, pairs)
    else:
        plan.figures = _against_flat(plan, lengths, positions, pairs)
    return plan


def _families_over(examples: Sequence[Any], members: list[int], family: dict[int, tuple[int, ...]], prefix_len: int,
                   token_budget: int, on_overflow: str) -> list[int]:
    """The examples of the pairs (groups) among ``members`` whose tree (item -> {chosen, rejected}, item -> K
    completions) is over the budget (``on_overflow`` skip; error: refused, naming the pair or group)."""
    over = []
    for i in members:
        if i in family and family[i][0] == i:
            size = example_tree([examples[j] for j in family[i]]).positions
            if prefix_len + size > token_budget:
                if on_overflow != "skip":
                    raise _family_over_budget(examples[i], i, prefix_len, size, token_budget)
                over += family[i]
    return over


def _rejoin_families(cut: list[tuple[tuple[int, ...], int, int]], examples: Sequence[Any],
                     family: dict[int, tuple[int, ...]], capacity: int,
                     max_leaves: int) -> list[tuple[tuple[int, ...], int, int]]:
    """The tree packs ``cut`` (members, tree tokens, node pairs) with every preference pair (scored group) in one
    pack. A pair's answers share their item's node, a subtree of its own under P (``tree_salt``), which the cutter
    keeps whole; only a family that shares no token at all (an empty item, answers that start apart) can land in
    several packs: its other members join its leader's pack where the tree still fits, else the family takes a
    pack of its own."""
    where = {i: k for k, (members, _, _) in enumerate(cut) for i in members}
    members = [list(m) for m, _, _ in cut]
    changed = set()
    for i in list(where):
        whole = family.get(i)
        if whole is None or whole[0] != i or all(where[j] == where[i] for j in whole):
            continue
        k = where[i]
        others = [j for j in whole[1:] if where[j] != k]
        for j in others:
            members[where[j]].remove(j)
            changed.add(where[j])
        changed.add(k)
        trial = _tree_figures([examples[e] for e in members[k] + others])
        if trial[0] <= capacity and trial[2] <= max_leaves:
            members[k] += others
            for j in others:
                where[j] = k
        else:
            members[k] = [e for e in members[k] if e not in whole]
            members.append(list(whole))
            for j in whole:
                where[j] = len(members) - 1
            changed.add(len(members) - 1)
    out = []
    for k, m in enumerate(members):
        if not m:
            continue
        if k in changed or k >= len(cut):
            m = sorted(m, key=lambda e: (str(getattr(examples[e], "id", "")), e))
            positions, pairs, _ = _tree_figures([examples[e] for e in m])
            out.append((tuple(m), positions, pairs))
        else:
            out.append(cut[k])
    return out


def _tree_figures(group: list[Any]) -> tuple[int, int, int]:
    """(tokens, node pairs, leaves) of the tree of ``group``, as pack_tree counts a pack."""
    tree = example_tree(group)
    leaves = sum(end == n + 1 for n, end in enumerate(tree.stop))
    return tree.positions, sum(map(node_pairs, tree.start, tree.end)), leaves


def _by_id(examples: Sequence[Any], indices: list[int]):
    """A sort key of positions in ``indices``: the example's id, then its index."""
    return lambda j: (str(getattr(examples[indices[j]], "id", "")), indices[j])


def seeded(seed: int, epoch: int, what: str) -> random.Random:
    """The run's one seeded-RNG recipe: a generator from (``what`` it orders, seed, epoch) alone, the same on every
    rank and in every process (the epoch's pack order; the balance's order of steps)."""
    digest = hashlib.sha256(f"packtrain-{what}:{seed}:{epoch}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def epoch_order(plan: Plan, epoch: int, seed: int | None = None) -> list[int]:
    """Pack indices in the order epoch ``epoch`` visits them: a shuffle seeded from (seed, epoch) alone."""
    order = list(range(len(plan.packs)))
    seeded(plan.seed if seed is None else seed, epoch, "epoch").shuffle(order)
    return order


def plan_stats(plan: Plan, examples: Sequence[Any]) -> dict:
    """Exact counts for a plan: positions and full-attention pairs (per layer and head), standalone vs packed.

    Standalone, each example is its own sequence P + C. Packed, a continuation of length c after P attends to P
    and to itself: c * len(P) + c(c+1)/2 pairs, and P's own pairs are counted once per pack. The median of
    continuations per pack is the lower median, so an integer like the rest. A walked example computes its own
    sequence once, chunk by chunk (the same positions and pairs in both columns); it is counted apart from the packs
    (``walked``, ``walk_chunks``) and not in the per-pack or budget figures.

    A pack's packed pairs are its own (``Pack.attention_pairs``: a tree pack's every token reads P, its ancestors and
    its own node's earlier tokens), and a tree plan's figures gain shared_prefix's (``Plan.figures``, the tree
    planner's: the same examples planned flat, ``positions_shared_prefix``, ``attention_pairs_shared_prefix``,
    ``packs_shared_prefix`` and the ratios of shared_prefix's over the tree's).
    """
    positions_standalone = pairs_standalone = 0
    for pack in plan.packs:  # a walked example is its own sequence: the same positions and pairs in both columns
        p = len(plan.prompts[pack.prompt])
        cs = [len(examples[i].item_ids) + len(examples[i].target_ids) for i in pack.examples]
        positions_standalone += p * len(cs) + sum(cs)
        pairs_standalone += sum(causal_pairs(p + c) for c in cs)
    pairs_packed = sum(pack.attention_pairs for pack in plan.packs)
    walks = [pack for pack in plan.packs if pack.walk is not None]
    per_pack = [len(pack.examples) for pack in plan.packs if pack.walk is None]
    walk_positions = sum(pack.positions for pack in walks)
    positions_packed = sum(pack.positions for pack in plan.packs)
    planned = [examples[i] for pack in plan.packs for i in pack.examples]
    return {
        "examples": sum(per_pack) + len(walks),
        # the lines the planned examples come from (one per conversation), the assistant turns they train and the
        # tokens that carry loss
        "conversations": len({(ex.source, ex.line) if getattr(ex, "line", 0) else i for i, ex in enumerate(planned)}),
        "turns": sum(getattr(ex, "turns", 1) for ex in planned),
        "target_tokens": sum(target_count(ex) for ex in planned),
        # examples whose prompt and target, tokenized apart as at generation, are other tokens than the whole render
        "whole_differs": sum(bool(getattr(ex, "whole_differs", False)) for ex in planned),
        # preference pairs (both answers of each in one pack), scored groups (all completions of each in one pack)
        # and examples whose weight is not 1
        "preference_pairs": sum(getattr(ex, "side", "") == "chosen" for ex in planned),
        "scored_groups": len({ex.group for ex in planned if getattr(ex, "group", "")}),
        "weighted": sum(getattr(ex, "weight", 1.0) != 1.0 for ex in planned),
        "skipped": len(plan.skipped),
        "walked": len(walks),
        "walk_chunks": sum(pack.walk.chunks for pack in walks),
        "prompts": len(plan.prompts),
        "packs": len(per_pack),
        "continuations_min": min(per_pack, default=0),
        "continuations_median": statistics.median_low(per_pack) if per_pack else 0,
        "continuations_max": max(per_pack, default=0),
        "token_budget": plan.token_budget,
        "budget_utilisation": (positions_packed - walk_positions) / max(len(per_pack) * plan.token_budget, 1),
        "positions_standalone": positions_standalone,
        "positions_packed": positions_packed,
        "position_ratio": positions_standalone / positions_packed,
        "attention_pairs_standalone": pairs_standalone,
        "attention_pairs_packed": pairs_packed,
        "attention_pair_ratio": pairs_standalone / pairs_packed,
        **plan.figures,
    }


def _against_flat(plan: Plan, lengths: dict[int, list[int]], positions: int, pairs: int) -> dict:
    """A tree plan's figures beside shared_prefix's: the same examples packed flat, as plan_packs plans them (the
    same budget; the examples the tree plan skipped are over it flat too), from the continuation lengths per
    prompt (``lengths``) without planning again: plan_packs' packs of a prompt group are
    ``_best_fit_decreasing`` over its lengths sorted descending, whose count depends on nothing else, and a flat
    pack's positions and pairs follow from its P and its continuations' lengths."""
    packs = flat_positions = flat_pairs = 0
    for prompt, cs in lengths.items():
        p = len(plan.prompts[prompt])
        cs.sort(reverse=True)
        n = len(_best_fit_decreasing(cs, plan.token_budget - p, plan.max_continuations))
        packs += n
        flat_positions += n * p + sum(cs)
        flat_pairs += n * causal_pairs(p) + p * sum(cs) + sum(map(causal_pairs, cs))
    return _flat_figures(packs, flat_positions, flat_pairs, positions, pairs)


def _flat_figures(packs: int, flat_positions: int, flat_pairs: int, positions: int, pairs: int) -> dict:
    return {"packs_shared_prefix": packs,
            "positions_shared_prefix": flat_positions,
            "attention_pairs_shared_prefix": flat_pairs,
            # shared_prefix's over the tree's
            "shared_prefix_position_ratio": flat_positions / positions,
            "shared_prefix_attention_pair_ratio": flat_pairs / pairs}


def weights_fingerprint(plan: Plan, examples) -> str:
    """Every planned example's id and ``weight`` (a pair's weight is on both its sides), in the plan's order."""
    h = hashlib.sha256()
    for pack in plan.packs:
        h.update(repr([(examples[e].id, examples[e].weight) for e in pack.examples]).encode())
    return h.hexdigest()[:16]


def plan_fingerprint(plan: Plan, examples) -> str:
    """The packs and the tokens in them (each P, item and target; image paths and grids): edited data differs."""
    h = hashlib.sha256()
    for pack in plan.packs:
        h.update(repr((pack.prompt, pack.examples, plan.prompts[pack.prompt])).encode())
        for e in pack.examples:
            ex = examples[e]
            h.update(repr((ex.item_ids, ex.target_ids, [(r.path, r.grid_thw) for r in ex.images])).encode())
            if getattr(ex, "spans", ()):  # only then: the fingerprints of single-target data stay as they were
                h.update(repr(ex.spans).encode())
    return h.hexdigest()[:16]
