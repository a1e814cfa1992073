"""The task metric: held-out examples generated (:mod:`packtrain.run.generate`), scored
(:mod:`packtrain.run.scoring`) and written, for `packtrain eval --generate` and ``generate.every`` during training.

Per example one JSON line: ``id``, ``prediction_ids`` (up to and excluding the stop token), ``prediction`` and
``target`` as text when there is a tokenizer, ``stop`` (``eos`` | ``length``), ``score`` in [0, 1] and ``match``
(exact match). The target is the example's target up to its first stop token (a chat target ends with
``<|im_end|>``). With ``generate.strip_thinking`` a ``<think>...</think>`` block is removed from both sides before
they are scored and compared. Without a tokenizer (pretokenized data, no ``data.tokenizer``) the ids are compared and
only the ``exact`` metric applies. The mismatches go to a Markdown report next to the lines, grouped by prompt.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from packtrain.data.planner import Plan
from packtrain.distributed import DistInfo
from packtrain.run.generate import Generated, GenerateSpec, generate, stop_ids
from packtrain.run.scoring import Scorer, check_text, errors_markdown, strip_thinking, summarize
from packtrain.run.units import Kinds


@dataclass
class Task:
    plan: Plan
    examples: list  # the examples generated on (the first generate.examples of the split)
    spec: GenerateSpec
    scorer: Scorer
    strip: bool  # generate.strip_thinking
    tokenizer: object | None
    split: str = "eval"


@dataclass
class TaskResult:
    rows: list[dict]  # every example scored, in example order (with the item and prompt the error report reads)
    summary: dict  # examples, exact, exact_match, mean_score, unparsed, skipped, tokens, seconds, tokens_per_second


def task_for(cfg, model, examples: list, scorer: Scorer, tokenizer, kinds, split: str = "eval") -> Task:
    """The task of ``examples`` (their first ``generate.examples``; a pair's item once, scored against its chosen
    answer), planned by the run's ``kinds``."""
    examples = [ex for ex in examples if getattr(ex, "side", "") != "rejected"]  # a pair: its item, scored on chosen
    chosen = examples[:cfg.generate.examples] if cfg.generate.examples else list(examples)
    check_text(scorer, tokenizer)
    spec = GenerateSpec.from_config(cfg.generate, stop_ids(model, tokenizer))
    plan = kinds.plan(cfg, chosen)
    check_positions(model, plan, chosen, cfg.generate.max_new_tokens)
    if not spec.stop_ids and os.environ.get("RANK", "0") == "0":
        print(f"packtrain: warning: no stop token (the model config has no eos_token_id and there is no tokenizer): "
              f"every prediction runs to generate.max_new_tokens={cfg.generate.max_new_tokens}, so an exact match "
              "needs a target of exactly that length; set eos_token_id in the model config", file=sys.stderr)
    return Task(plan, chosen, spec, scorer, cfg.generate.strip_thinking, tokenizer, split)


def check_positions(model, plan: Plan, examples: list, max_new_tokens: int,
                    what: str = "generate.max_new_tokens") -> None:
    """The longest P + item + ``max_new_tokens`` (the setting ``what``) within the model's positions
    (``max_position_embeddings``), before any row is allocated: 1e9 new tokens asked the allocator for 256 GB, a
    traceback."""
    from packtrain.packed.patch import unwrap

    positions = getattr(unwrap(model).config.get_text_config(), "max_position_embeddings", None)
    if positions is None or not plan.packs:
        return
    longest = max(len(plan.prompts[pack.prompt]) + len(examples[e].item_ids) for pack in plan.packs
                  for e in pack.examples)
    if longest + max_new_tokens > positions:
        raise ValueError(f"{what}: {max_new_tokens} new tokens after a prompt of up to {longest} "
                         f"tokens exceed the model's {positions} positions (max_position_embeddings); at most "
                         f"{max(positions - longest, 0)} fit")


def _until_stop(ids, stops) -> list[int]:
    for n, t in enumerate(ids):
        if t in stops:
            return list(ids[:n])
    return list(ids)


def score_row(task: Task, index: int, prompt: int, g: Generated) -> dict:
    ex = task.examples[index]
    target_ids = _until_stop(ex.target_ids, task.spec.stop_ids)
    row = {"id": ex.id, "prediction_ids": list(g.ids)}
    if task.tokenizer is None:
        match = list(g.ids) == target_ids
        row.update(stop=g.stop, score=float(match), match=match)
        return {**row, "prompt": prompt, "item_ids": list(ex.item_ids), "target_ids": target_ids, "parsed": True}
    decode = task.tokenizer.decode
    prediction, target = decode(list(g.ids)), decode(target_ids)
    scored, wanted = (strip_thinking(prediction), strip_thinking(target)) if task.strip else (prediction, target)
    score, parsed = task.scorer.score(scored, wanted, ex)
    row.update(prediction=prediction, target=target, stop=g.stop, score=score, match=scored.strip() == wanted.strip())
    return {**row, "prompt": prompt, "item": decode(list(ex.item_ids)), "scored": scored, "parsed": parsed,
            "item_ids": list(ex.item_ids), "target_ids": target_ids}


PUBLIC = ("id", "prediction_ids", "prediction", "target", "stop", "score", "match")


def public_row(row: dict) -> dict:
    """The JSON line of an example (``parsed`` too under the json metric)."""
    out = {k: row[k] for k in PUBLIC if k in row}
    if not row.get("parsed", True):
        out["parsed"] = False
    return out


def run_task(lm, task: Task, kinds: Kinds, info: DistInfo, progress=None) -> TaskResult:
    """Generate and score every example of the task (on every rank; rank 0 writes)."""
    t0 = time.perf_counter()
    generated = generate(lm, task.plan, task.examples, kinds, task.spec, info, progress)
    seconds = time.perf_counter() - t0
    prompt_of = {e: pack.prompt for pack in task.plan.packs for e in pack.examples}
    rows = [score_row(task, e, prompt_of[e], g) for e, g in generated.items()]
    tokens = sum(len(g.ids) + (g.stop == "eos") for g in generated.values())
    summary = {**summarize(rows), "skipped": len(task.plan.skipped), "tokens": tokens, "seconds": seconds,
               "tokens_per_second": tokens / seconds if seconds > 0 else None}
    return TaskResult(rows, summary)


def describe(summary: dict) -> str:
    """``exact match K/N, mean score s`` (and the unparsed and skipped counts when there are any)."""
    n = summary["examples"]
    text = f"exact match {summary['exact']}/{n}"
    if summary["mean_score"] is not None:
        text += f", mean score {summary['mean_score']:.4f}"
    if summary.get("unparsed"):
        text += f", {summary['unparsed']} predictions not JSON"
    if summary.get("skipped"):
        text += f", {summary['skipped']} examples over the token budget not generated"
    return text


def write_task(result: TaskResult, lines_path: Path, errors_path: Path, task: Task, title: str) -> None:
    """The JSON lines and the error report, each written under a temporary name and renamed."""
    lines_path.parent.mkdir(parents=True, exist_ok=True)
    _write(lines_path, "".join(json.dumps(public_row(r), allow_nan=False) + "\n" for r in result.rows))
    prompts = {i: (task.tokenizer.decode(list(p)) if task.tokenizer is not None else f"{len(p)} tokens: {list(p)}")
               for i, p in enumerate(task.plan.prompts)}
    _write(errors_path, errors_markdown(result.rows, prompts, title))


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def errors_path_for(lines_path: Path) -> Path:
    """FILE.jsonl -> FILE.errors.md (next to it)."""
    name = lines_path.name.removesuffix(".jsonl")
    return lines_path.with_name(name + ".errors.md")
