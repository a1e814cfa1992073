"""Online GRPO (``rl.num_generations``): each step samples its groups, scores them and trains on them as a tree.

    the step's packs of requests -> K copies of each request -> generate (P prefilled once per prompt group,
        sampled: rl.temperature, rl.top_p, rl.max_completion_length) -> generate.metric against the request's
        target -> OUTPUT/rollouts/step-N.jsonl (the offline format) -> its scored groups -> the step's plan

The run's plan holds the requests (``data.train``: records with a target), cut into steps as any run's
(:class:`~packtrain.run.balance.StepPlan`); each step's completions exist only once it starts, so its packs are
planned then, by the run's planner (a tree: P -> item -> K answers), and :class:`~packtrain.run.step.Step` trains on
them as on scored groups read from a file.

Seeds: completion k of request ID draws from a generator seeded by (``train.seed``, the step's number, ``ID:k``)
(:func:`packtrain.run.generate.example_generator`), so a sample depends on neither the rank, the batch it decodes in,
nor the world size, and a resumed run samples what the uninterrupted one did. Every rank generates its share and
gets every completion (:func:`packtrain.run.generate.generate`); the rewards are rank 0's, broadcast, so every rank
trains the same groups even under a scorer that is not deterministic.

The rollouts file is the pretokenized scored-group format (:mod:`packtrain.data.scored`) with no ``logprobs``: the
online update is on-policy (the old policy is the current one, detached), which is what a replay of the file without
log-probabilities computes, so ``packtrain train`` on step-N.jsonl from step N-1's adapter makes step N's update.
A completion is its sampled tokens and the stop token it drew (none where it reached
``rl.max_completion_length``). The step's groups are read back from the file's records by the reader of that format.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from packtrain.data.planner import PlanError, plan_packs

if TYPE_CHECKING:  # `packtrain plan` reads this module's figures without torch
    from packtrain.distributed import DistInfo
    from packtrain.run.generate import GenerateSpec

DIR = "rollouts"


def rollouts_path(out: Path, step: int) -> Path:
    """OUTPUT/rollouts/step-N.jsonl: step N's groups (N counts from 1, as metrics.jsonl's steps)."""
    return out / DIR / f"step-{step}.jsonl"


def step_seed(train_seed: int, number: int) -> int:
    """The sampling seed of step ``number`` (0-based), from ``train.seed``."""
    return (train_seed * 1_000_003 + number) % 2**31


def worst_case_group(ex, k: int, length: int) -> list:
    """``ex``'s request with ``k`` distinct completions of ``length`` tokens: the largest group it can sample."""
    return [dataclasses.replace(ex, id=f"{ex.id}:{i}", target_ids=(i,) + (0,) * (length - 1), group=ex.id,
                                reward=float(i), group_rewards=tuple(map(float, range(k)))) for i in range(k)]


def check_room(cfg, kinds, plan, examples) -> None:
    """Refuse, before the model is built, requests whose K completions of up to ``rl.max_completion_length``
    tokens would not fit one pack (the planner's refusal of the largest group each prompt can sample)."""
    k, length = cfg.rl.num_generations, cfg.rl.max_completion_length
    longest: dict[int, int] = {}
    for pack in plan.packs:
        for e in pack.examples:
            if pack.prompt not in longest or len(examples[e].item_ids) > len(examples[longest[pack.prompt]].item_ids):
                longest[pack.prompt] = e
    for e in sorted(longest.values()):
        try:
            kinds.plan(dataclasses.replace(cfg, packing=dataclasses.replace(cfg.packing, on_overflow="error")),
                       worst_case_group(examples[e], k, length))
        except PlanError as error:
            raise ValueError(f"rl.num_generations, rl.max_completion_length: {k} completions of up to {length} "
                             f"tokens do not fit one pack with their request: {error}") from None


def epoch_positions(cfg, kinds, plan, examples, steps) -> dict:
    """Epoch 0's training positions when every completion runs to ``rl.max_completion_length``: each step's groups
    planned by the run's planner (a tree: P once per pack, each item once, then its K completions) against the same
    completions each as its own sequence (standalone sampling's P + item + completion, K times per request).
    ``steps``: the run's :class:`~packtrain.run.balance.StepPlan`."""
    k, length = cfg.rl.num_generations, cfg.rl.max_completion_length
    packed = alone = requests = 0
    for i in range(steps.steps_per_epoch):
        step = [examples[e] for p in steps.pack_ids(0, i) for e in plan.packs[p].examples]
        groups = [g for ex in step for g in worst_case_group(ex, k, length)]
        requests += len(step)
        packed += sum(p.positions for p in kinds.plan(cfg, groups).packs)
        alone += sum(len(g.prefix_ids) + g.len_continuation for g in groups)
    return {"requests": requests, "num_generations": k, "max_completion_length": length,
            "positions_standalone": alone, "positions_packed": packed, "position_ratio": alone / packed}


def describe_positions(f: dict, mode: str) -> str:
    """``plan``'s line for :func:`epoch_positions`."""
    return (f"online     {f['requests']:,} requests x {f['num_generations']} completions of up to "
            f"{f['max_completion_length']:,} tokens an epoch: {f['positions_packed']:,} positions in {mode} packs "
            f"vs {f['positions_standalone']:,} as standalone samples ({f['position_ratio']:.1f}x, at most; "
            "sampled each step)")


def sampling_plan(cfg, copies: list):
    """The packs ``copies`` (the step's requests, K times each) are generated in, planned at the longest answer each
    row may sample, ``rl.max_completion_length`` (not its target's length): no generation unit holds more than
    ``packing.token_budget`` positions."""
    length = cfg.rl.max_completion_length
    sized = [dataclasses.replace(c, target_ids=(0,) * length) for c in copies]
    p = cfg.packing
    return plan_packs(sized, p.token_budget, p.max_continuations, "error", cfg.train.seed)


@dataclass
class Online:
    """What each online step samples with: the run's requests and how to score them."""
    cfg: object
    plan: object  # the run's plan of requests
    examples: list  # the requests
    kinds: object
    info: DistInfo
    out: Path
    scorer: object
    tokenizer: object | None

    def check(self, model) -> None:
        """Every request's P + item + ``rl.max_completion_length`` within the model's positions, before step 0."""
        from packtrain.run.task import check_positions

        check_positions(model, self.plan, self.examples, self.cfg.rl.max_completion_length,
                        "rl.max_completion_length")

    def spec(self, model, number: int) -> GenerateSpec:
        from packtrain.run.generate import GenerateSpec, stop_ids

        r = self.cfg.rl
        return GenerateSpec(r.max_completion_length, stop_ids(model, self.tokenizer), r.temperature, r.top_p,
                            step_seed(self.cfg.train.seed, number))

    def sample(self, lm, model, pack_ids: list[int], number: int) -> tuple[list[dict], dict]:
        """Step ``number``'s groups (0-based), as the records of its rollouts file, and its sampling figures."""
        import torch.distributed as dist

        from packtrain.run.generate import generate
        from packtrain.run.task import Task, score_row

        t0 = time.perf_counter()
        k = self.cfg.rl.num_generations
        requests = [self.examples[e] for i in pack_ids for e in self.plan.packs[i].examples]
        copies = [dataclasses.replace(ex, id=f"{ex.id}:{j}") for ex in requests for j in range(k)]
        plan = sampling_plan(self.cfg, copies)
        task = Task(plan, copies, self.spec(model, number), self.scorer, self.cfg.generate.strip_thinking,
                    self.tokenizer, "train")
        generated = generate(lm, plan, copies, self.kinds, task.spec, self.info)
        prompt_of = {e: pack.prompt for pack in plan.packs for e in pack.examples}
        rewards = [score_row(task, e, prompt_of[e], generated[e])["score"] for e in range(len(copies))]
        if self.info.enabled:  # rank 0's rewards: every rank trains the same groups
            shared = [rewards]
            dist.broadcast_object_list(shared, src=0)
            rewards = shared[0]
        records = []
        for i, ex in enumerate(requests):
            drawn = [generated[i * k + j] for j in range(k)]
            records.append({"id": ex.id, "prefix_ids": list(ex.prefix_ids), "item_ids": list(ex.item_ids),
                            "completion_ids": [list(g.ids) + ([g.stop_id] if g.stop == "eos" else []) for g in drawn],
                            "rewards": rewards[i * k:(i + 1) * k]})
        tokens = sum(len(c) for r in records for c in r["completion_ids"])
        return records, {"sampled_tokens": tokens, "sampling_seconds": time.perf_counter() - t0}

    def write(self, records: list[dict], step: int) -> Path:
        """Rank 0 writes step ``step``'s records (1-based), under a temporary name then renamed."""
        path = rollouts_path(self.out, step)
        if self.info.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in records))
            tmp.replace(path)
        return path


def group_examples(records: list[dict], source: Path) -> list:
    """The examples of a rollouts file's records, as the pretokenized reader makes them from its lines."""
    from packtrain.data.jsonl import pretokenized_group

    prefixes: dict = {}
    return [ex for line, record in enumerate(records, 1) for ex in pretokenized_group(record, line, source, prefixes)]
