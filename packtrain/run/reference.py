"""The reference log-probabilities computed once before training (``train.dpo_reference: precompute``), cached in
``OUTPUT/reference.json``: DPO's, and GRPO's on scored groups from the data where ``rl.beta`` > 0.

The pass is an evaluation of the training plan (:func:`packtrain.run.evaluate.evaluate`: the same packed units,
under no_grad, every rank its share, gathered on every rank) with the adapter disabled: the base model
(``model.adapter`` folded in). Under dpo an example's reference is its answer's summed token log-probability, ``-mean
loss * target tokens``; under grpo the list of its completion's token log-probabilities (the k3 KL is per token).

The file holds the table by example id and the digests of what it was computed from: the data (every training
example's id, tokens and images, the images' contents too), the base (``model.config`` and its seed and dtype, or
``model.path``'s config and weight files; and ``model.adapter``'s files, folded into it) and the tokenizer (its
files, ``data.chat_template``, ``data.template_kwargs``). A resumed run reads it instead of computing it again; one
whose digests differ is refused, naming what changed (a stale reference would train silently wrong). Its contents
are checked on read too: every example the plan trains holds a finite entry, and a digest of the table written
beside it (``content``) still matches, so an edited or damaged table (a value set to -Infinity or NaN, an entry
gone, values scaled) is refused, naming the entry or the digest, never trained on; a table written without that
digest (an older packtrain's) is computed again. Rank 0 writes it atomically (a temporary, then a rename), so an
interrupted pass leaves no file and the next start computes it again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

from packtrain.config import Config

FILE = "reference.json"


def data_digest(examples) -> str:
    """Every example's id, tokens (P, item, target, loss spans) and images: their paths, grids and contents (each
    file's size and sampled pieces of it, the whole of an image under 512 KiB: an image repainted at
    the same size and path is other data)."""
    h = hashlib.sha256()
    contents: dict[str, bytes] = {}  # an image several examples show is read once
    for ex in sorted(examples, key=lambda ex: ex.id):
        h.update(repr((ex.id, ex.prefix_ids, ex.item_ids, ex.target_ids, ex.spans,
                       [(r.path, r.grid_thw) for r in ex.images])).encode())
        for r in ex.images:
            if r.path not in contents:
                contents[r.path] = _image_digest(Path(r.path))
            h.update(contents[r.path])
    return h.hexdigest()[:16]


def _image_digest(path: Path) -> bytes:
    try:
        from packtrain.models.start_adapter import sampled_bytes

        return hashlib.sha256(f"{path.stat().st_size}:".encode() + sampled_bytes(path)).digest()
    except OSError as e:  # read when the examples were made; gone since: the digest says so
        return f"unreadable: {type(e).__name__}".encode()


def base_digest(cfg: Config) -> str:
    """The base model: ``model.config`` with ``model.seed`` (a random init), or ``model.path``'s config.json and its
    weight files (names, sizes and sampled pieces of each: a checkpoint of 54 GB is not read whole); ``model.dtype``;
    and ``model.adapter``'s files, the start folded into the base."""
    from packtrain.models.start_adapter import adapter_digest, feed_checkpoint

    h = hashlib.sha256(repr(cfg.model.dtype).encode())
    if cfg.model.config is not None:
        h.update(json.dumps(cfg.model.config, sort_keys=True).encode() + repr(cfg.model.seed).encode())
    else:
        feed_checkpoint(h, cfg.resolve_path(cfg.model.path))
    if cfg.model.adapter is not None:  # the start folded into it: a reference of another start is another table
        h.update(f"adapter:{adapter_digest(cfg.resolve_path(cfg.model.adapter))}".encode())
    return h.hexdigest()[:16]


def tokenizer_digest(cfg: Config) -> str:
    """The tokenizer's files (its directory's JSON, Jinja and text files), ``data.chat_template`` and
    ``data.template_kwargs``."""
    from packtrain.data.jsonl import chat_template_of, tokenizer_dir

    h = hashlib.sha256(json.dumps(cfg.data.template_kwargs or {}, sort_keys=True).encode())
    folder = tokenizer_dir(cfg)
    if folder.is_dir():
        for file in sorted(folder.iterdir()):
            if file.is_file() and file.suffix in (".json", ".jinja", ".txt", ".model") and file.name != "config.json":
                h.update(file.name.encode() + file.read_bytes())
    template = chat_template_of(cfg)
    if template is not None:
        h.update(template.read_bytes())
    return h.hexdigest()[:16]


def digests(cfg: Config, examples) -> dict[str, str]:
    return {"data": data_digest(examples), "base": base_digest(cfg), "tokenizer": tokenizer_digest(cfg)}


_CHANGED = {"data": "training data (data.train)", "base": "base model (model.path / model.config / model.adapter)",
            "tokenizer": "tokenizer (data.tokenizer, data.chat_template, data.template_kwargs)"}


Entry = float | tuple[float, ...]  # dpo: an answer's summed log-probability; grpo: each of its tokens'


def content_digest(table: dict[str, Entry]) -> str:
    """The table's entries (ids and values as JSON writes them, which reads back to the same floats)."""
    return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()[:16]


def _entry(value) -> Entry:
    return tuple(float(v) for v in value) if isinstance(value, list) else float(value)


def _finite(value: Entry) -> bool:
    return all(map(math.isfinite, value)) if isinstance(value, tuple) else math.isfinite(value)


def read(out: Path, expected: dict[str, str], ids: Iterable[str] = ()) -> dict[str, Entry] | None:
    """The cached table, or None when there is none (or it has no content digest: computed again); refused when it
    was computed from other data, base or tokenizer, when one of ``ids`` (the examples the plan trains) has no
    entry or a value that is not finite, or when the entries no longer match their digest."""
    path = out / FILE
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text())
        found, table = raw["digests"], {str(k): _entry(v) for k, v in raw["log_probs"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: unreadable reference cache ({type(e).__name__}: {e}); remove it to compute "
                         "the reference again") from None
    changed = [name for name in expected if found.get(name) != expected[name]]
    if changed:
        what = ", ".join(_CHANGED[name] for name in changed)
        raise ValueError(f"{path}: the reference log-probabilities were computed with another {what}: refused "
                         f"(they would train wrong); remove {FILE} to compute them again for this run")
    if "content" not in raw:
        return None
    again = f"refused (a reference table is never trained on unchecked); remove {FILE} to compute it again"
    partial = raw.get("partial") is True  # a pass stopped by a signal: the entries it finished, the rest to compute
    for i in ids:
        if i not in table:
            if partial:
                continue
            raise ValueError(f"{path}: log_probs has no entry for example {i!r}: {again}")
        if not _finite(table[i]):
            raise ValueError(f"{path}: log_probs[{i!r}] is {raw['log_probs'][i]}, not a finite log-probability: "
                             f"{again}")
    if raw["content"] != content_digest(table):
        raise ValueError(f"{path}: log_probs no longer match the digest written with them (content "
                         f"{raw['content']!r}): edited or damaged since this run computed them; {again}")
    return table


def write(out: Path, expected: dict[str, str], table: dict[str, Entry], partial: bool = False) -> Path:
    """The table with its digests; ``partial``: a pass stopped part way (:func:`compute_in_batches`), whose missing
    entries the next start computes."""
    path = out / FILE
    tmp = out / f".tmp-{FILE}"
    tmp.write_text(json.dumps({"digests": expected, "examples": len(table), "content": content_digest(table),
                               **({"partial": True} if partial else {}), "log_probs": table}))
    os.replace(tmp, path)
    return path


def compute_in_batches(lm, plan, examples, kinds, info, have: dict[str, Entry], stop, progress=None
                       ) -> tuple[dict[str, Entry], bool]:
    """The reference of the plan's packs whose examples ``have`` lacks (a partial table read back), in batches of
    one pack a rank, ``stop()`` asked before each (every rank's answer agreed: a signal is acted on between
    batches, not at the pass's end, so a launcher's 30 s grace is enough). Returns (the table so far, whether it is
    complete)."""
    from packtrain import faults

    todo = [i for i, pack in enumerate(plan.packs) if any(examples[e].id not in have for e in pack.examples)]
    table = dict(have)
    for n, start in enumerate(range(0, len(todo), info.world_size), start=1):
        if stop():
            return table, False
        faults.reference_batch(n)
        batch = dataclasses.replace(plan, packs=[plan.packs[i] for i in todo[start:start + info.world_size]])
        table.update(compute(lm, batch, examples, kinds, info, progress))
    return table, True


def compute(lm, plan, examples, kinds, info, progress=None) -> dict[str, Entry]:
    """The reference of every planned example, by id: the training plan evaluated with the adapter disabled (per
    token where the objective's KL is, grpo's)."""
    from packtrain.run.evaluate import evaluate
    from packtrain.run.objective import adapters_disabled

    tokens = kinds.objective.per_token_reference
    with adapters_disabled(lm):
        rows = evaluate(lm, plan, examples, kinds, info, progress, tokens=tokens)
    if tokens:
        return {row["id"]: tuple(row["token_logp"]) for row in rows}
    return table_of(rows)


def table_of(rows: list[dict]) -> dict[str, float]:
    """Each evaluated example's summed answer log-probability by id, from its mean loss and target tokens."""
    return {row["id"]: -row["loss"] * row["target_tokens"] for row in rows}
