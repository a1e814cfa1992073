"""Generation on held-out examples, P prefilled once per prompt group (`packtrain eval --generate`, ``generate.every``).

Per unit (one pack of the eval plan, on the rank that holds its prompt group): P through one
:class:`~packtrain.packed.prefix.PrefixCall` (skipped when the unit before had the same P on every rank), the
items as continuations of one pack (:class:`~packtrain.packed.decode.ItemsCall`), then one
:class:`~packtrain.packed.decode.DecodeCall` per token for all rows together (:mod:`packtrain.packed.decode`). A row
stops at a stop token (not kept in its prediction) or after ``generate.max_new_tokens`` tokens.

Choosing a token: greedy (``generate.temperature`` 0) is the argmax of the float32 logits, as transformers'
``generate`` takes it; sampling divides by the temperature, keeps the top-p nucleus (transformers'
``TopPLogitsWarper``) and draws from a generator of the example's own, seeded by ``generate.seed`` and the example's
id, so a prediction depends on neither the batch it is in nor the rank.

Across ranks: whole prompt groups go to ranks (largest first, to the least loaded), the equal-call rule
(the ``items`` kind's padding, :mod:`packtrain.run.units`) pads every rank's units with dummies, and each decode
step ends with an agreement over ranks on "still decoding" (:func:`packtrain.distributed.agree`): a rank whose rows
have all stopped runs its last row again and drops the result, so every rank issues the same calls. Every rank
returns every example's generation.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from packtrain.data.planner import Plan
from packtrain.distributed import DistInfo, agree
from packtrain.packed.decode import DecodeCall, ItemsCall
from packtrain.packed.layout import Continuation, build_pack_layout
from packtrain.packed.patch import unwrap
from packtrain.packed.prefix import PrefixCall
from packtrain.run.units import ITEMS, Kinds, items_units


@dataclass(frozen=True)
class GenerateSpec:
    max_new_tokens: int
    stop_ids: frozenset[int]
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    @classmethod
    def from_config(cls, g, stop_ids) -> GenerateSpec:
        return cls(g.max_new_tokens, frozenset(stop_ids), g.temperature, g.top_p, g.seed)


@dataclass(frozen=True)
class Generated:
    ids: tuple[int, ...]  # up to and excluding the stop token
    stop: str  # "eos" (a stop token) | "length" (max_new_tokens)
    stop_id: int | None = None  # the stop token drawn ("eos")


def stop_ids(model, tokenizer=None) -> frozenset[int]:
    """The model's generation config's ``eos_token_id`` (one or a list; the model config's when it has no generation
    config), the tokenizer's eos token and, when the tokenizer has it, ``<|im_end|>`` (the end of a chat turn)."""
    base = unwrap(model)
    ids: set[int] = set()
    generation = getattr(base, "generation_config", None)
    for value in (getattr(generation, "eos_token_id", None), base.config.get_text_config().eos_token_id):
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end >= 0:
            ids.add(im_end)
    return frozenset(ids)


def example_generator(seed: int, example_id: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(example_id.encode()))


def nucleus(scores_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' ``TopPLogitsWarper``: the least likely tokens whose mass together is at most ``1 - top_p`` set
    to -inf; the most likely token always stays."""
    ordered, index = scores_BV.sort(-1)  # ascending: the tail comes first
    drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
    drop[..., -1] = False
    return scores_BV.masked_fill(drop.scatter(-1, index, drop), float("-inf"))


def choose(logits_BV: torch.Tensor, spec: GenerateSpec, generators: list[torch.Generator | None]) -> torch.Tensor:
    """The next token of every row [B]."""
    scores = logits_BV.float()
    if spec.temperature == 0:
        return scores.argmax(-1)
    scores = scores / spec.temperature
    if spec.top_p < 1.0:
        scores = nucleus(scores, spec.top_p)
    probs = scores.softmax(-1).cpu()
    picks = [torch.multinomial(probs[b], 1, generator=g) if g is not None else probs[b].argmax()[None]
             for b, g in enumerate(generators)]
    return torch.cat(picks).to(logits_BV.device)


def prompt_shards(plan: Plan, pack_ids: list[int], world: int) -> list[list[int]]:
    """Each rank's packs: whole prompt groups, the largest (in positions) first to the least loaded rank."""
    groups: dict[int, list[int]] = {}
    for i in pack_ids:
        groups.setdefault(plan.packs[i].prompt, []).append(i)
    size = {p: sum(plan.packs[i].positions for i in ids) for p, ids in groups.items()}
    load, shards = [0] * world, [[] for _ in range(world)]
    for p in sorted(groups, key=lambda p: (-size[p], p)):
        r = min(range(world), key=lambda r: (load[r], r))
        shards[r].extend(groups[p])
        load[r] += size[p]
    return shards


def _p_only(prefix) -> object:
    """A layout whose P is ``prefix`` (for P's call when no example of the unit has an item)."""
    return build_pack_layout(prefix, [Continuation(prefix[-1:], ())], targets=False)


def generate(lm, plan: Plan, examples, kinds: Kinds, spec: GenerateSpec, info: DistInfo,
             progress=None) -> dict[int, Generated]:
    """Every example of ``plan``'s packs generated, by example index (on every rank)."""
    shards = prompt_shards(plan, list(range(len(plan.packs))), info.world_size)
    per_rank = [items_units(plan, shard) for shard in shards]
    slots = [ITEMS.pad(per_rank, r) for r in range(info.world_size)]
    was_training = lm.training
    lm.eval()
    results: dict[int, Generated] = {}
    state = None
    with torch.no_grad():
        for k, unit in enumerate(slots[info.rank]):
            new_prompt = k == 0 or any(s[k].prompt != s[k - 1].prompt for s in slots)
            layout = ITEMS.build(unit, plan, examples, kinds.images)
            if layout is not None:
                layout = layout.to(info.device)
            if new_prompt:
                state = lm(PrefixCall(layout if layout is not None else _p_only(plan.prompts[unit.prompt]).to(
                    info.device)))
            items = [(e, len(examples[e].item_ids), examples[e].id) for e in unit.examples]
            out = decode_rows(lm, layout, state, len(plan.prompts[unit.prompt]), items, spec, info)
            results.update({e: out[e] for e in unit.real_examples})
            if progress is not None:
                progress.update(1)
    lm.train(was_training)
    if info.enabled:
        gathered = [None] * info.world_size
        dist.all_gather_object(gathered, results)
        results = {k: v for part in gathered for k, v in part.items()}
    return dict(sorted(results.items()))


def decode_rows(lm, layout, state, prefix_len: int, items: list[tuple[object, int, str]], spec: GenerateSpec,
                info: DistInfo) -> dict[object, Generated]:
    """One unit's items against P's ``state``, then its rows decoded together until every row on every rank has
    stopped. ``items``: (key, item length, example id) in the unit's order; ``layout``: P and the items that have
    tokens, in that order (the ``items`` kind's build, :mod:`packtrain.run.units`)."""
    order = [key for key, n, _ in items if n] + [key for key, n, _ in items if not n]
    length, ids = {key: n for key, n, _ in items}, {key: i for key, _, i in items}
    empty = sum(1 for _, n, _ in items if not n)
    room = max(length.values()) + spec.max_new_tokens
    logits, rows = lm(ItemsCall(layout, state, prefix_len, empty, room))
    sampled = spec.temperature > 0
    generators = {e: example_generator(spec.seed, ids[e]) if sampled else None for e in order}
    tokens: dict[int, list[int]] = {e: [] for e in order}
    stops: dict[int, str] = {}
    stop_token: dict[int, int] = {}
    alive = list(order)  # the example of each row
    for step in range(spec.max_new_tokens):
        picked = choose(logits, spec, [generators[e] for e in alive]).tolist() if alive else []
        keep = []
        for b, (e, t) in enumerate(zip(alive, picked)):
            if t in spec.stop_ids:
                stops[e], stop_token[e] = "eos", t
            else:
                tokens[e].append(t)
                if len(tokens[e]) == spec.max_new_tokens:
                    stops[e] = "length"
                else:
                    keep.append(b)
        if step == spec.max_new_tokens - 1 or not agree([1 if keep else 0], info)[0]:
            break
        if keep:  # the rows still decoding
            if len(keep) < len(alive):
                rows = rows.select(torch.tensor(keep, device=info.device))
            alive = [alive[b] for b in keep]
            last = torch.tensor([picked[b] for b in keep], device=info.device)
        else:  # every row here has stopped but another rank's have not: one row again, its result dropped
            rows = rows.select(torch.zeros(1, dtype=torch.long, device=info.device))
            alive, last = [], torch.zeros(1, dtype=torch.long, device=info.device)
        logits = lm(DecodeCall(rows, last))
    return {e: Generated(tuple(tokens[e]), stops[e], stop_token.get(e)) for e in order}
