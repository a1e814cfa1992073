"""One run's setup, the same for every command that runs the model (train, eval, smoke, pretune-fla, bench, and
``plan --measure``'s data): what differs between them is a parameter here, never a copy of the setup.

    the splits -> every check -> the plan -> the savings chosen for the largest unit on this device
        -> (the model, assembled) -> the kinds with the images' loader -> (the task's scorer and examples)

:func:`open_session` does the part before the model (torch-free apart from the process group it is given: a refusal
here leaves nothing written and no weights loaded), :meth:`Session.build_model` the rest. The run keeps one config:
the user's (``Session.cfg``, as ``config.yaml`` and the checkpoints record it), with the savings that were chosen
beside it (``Session.choice``; :attr:`Session.run_cfg` is the config the model is assembled with).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from packtrain.config import Config, support
from packtrain.data.jsonl import detect_format, load_split, load_tokenizer
from packtrain.data.planner import Plan
from packtrain.run.scoring import Scorer, check_text, load_scorer
from packtrain.run.units import Kinds, choose_savings, image_loader

if TYPE_CHECKING:  # `plan` opens a session without torch: no process group, no savings, no model
    from packtrain.distributed import DistInfo


@dataclass
class Session:
    """What a command runs on (:func:`open_session`, then :meth:`build_model`)."""
    cfg: Config  # the user's config (the savings as written: auto stays auto)
    info: DistInfo | None  # None: no process group (``plan``)
    split: str  # the split the command trains on or evaluates
    examples: list
    plan: Plan
    kinds: Kinds  # built once from the config; its image loader set by build_model
    eval_examples: list | None = None  # data.eval beside data.train (train)
    eval_plan: Plan | None = None
    choice: object | None = None  # the savings chosen (packtrain.memory.savings.Choice), None: not chosen
    scorer: object | None = None  # the task metric's scorer and tokenizer (generate.every, eval --generate)
    task_tokenizer: object | None = None
    model: object | None = None  # the peft model, its root (PackedLM) and the kernel back end, once built
    lm: object | None = None
    backend: object | None = None
    base_copy: object | None = None
    start: object | None = None  # model.adapter's chain, read and checked (packtrain.models.start_adapter)

    @property
    def run_cfg(self) -> Config:
        """The config the model is assembled with: the user's, with the chosen savings in place of ``auto``."""
        return self.choice.apply(self.cfg) if self.choice is not None else self.cfg

    @property
    def all_examples(self) -> list:
        return self.examples + (self.eval_examples or [])

    def build_model(self, adapter: str | Path | None = "new", training: bool = True,
                    save_base_to: Path | None = None, meta: bool = True, copy_base: bool = False,
                    backend=None, device=None) -> None:
        """The base model (``model.path`` on the meta device, each rank filling its own shards; or ``model.config``
        at random, saved to ``save_base_to``), LoRA (``"new"``, or a trained ``adapter`` directory, frozen; None:
        the base alone), the patch, checkpointing and offload as chosen (``training``), FSDP under a launcher; then
        the kinds' image loader for the examples' images. ``model.adapter`` is folded into the base, and the model
        carries the record its adapter is saved with (``packtrain_base_record``: the base and the start).
        ``copy_base``: a copy of the base before anything touches it, in ``base_copy`` (the bench's plain
        transformers + peft loop). ``backend`` and ``device``: kernels and a device in place of ``model.kernels`` and
        the process's (``plan --measure`` runs CUDA's kernels on the CPU under fake tensors)."""
        import copy

        from packtrain.models.build import build_base_model
        from packtrain.models.start_adapter import record_for
        from packtrain.models.wrap import assemble

        base = build_base_model(self.cfg, save_to=save_base_to, meta=meta, start=self.start)
        if copy_base:
            self.base_copy = copy.deepcopy(base)
        device = device if device is not None else self.info.device
        shard = self.info is not None and self.info.enabled
        self.model, self.lm, self.backend = assemble(base, self.run_cfg, device, shard=shard, backend=backend,
                                                     adapter=adapter, training=training)
        self.model.packtrain_base_record = record_for(self.cfg, self.start, save_base_to)
        images = image_loader(self.cfg, self.model, self.all_examples)
        self.kinds = dataclasses.replace(self.kinds, images=images)

    def task(self, examples: list | None = None, split: str | None = None):
        """The task metric's generation on ``examples`` (default the eval split's), for ``generate.every`` and
        ``eval --generate`` (:mod:`packtrain.run.task`)."""
        from packtrain.run.task import task_for

        examples = self.eval_examples if examples is None else examples
        return task_for(self.cfg, self.model, examples, self.scorer, self.task_tokenizer, self.kinds,
                        split or ("eval" if examples is self.eval_examples else self.split))


def data_free_kinds(cfg: Config) -> Kinds:
    """``plan --memory`` without data: the checks :func:`open_session` makes that need none (the model family, and
    under ``generate.every`` the task metric), then the run's kinds, as a session makes them."""
    from packtrain.packed.families import check_model

    check_model(cfg)
    if cfg.generate.every is not None:
        load_task_scorer(cfg)
    return Kinds.of(cfg)


def open_session(cfg: Config, info: DistInfo | None, split: str = "train", with_eval: bool = False,
                 savings: bool = True, task: bool = False, n_groups: int | None = None,
                 examples: list | None = None, model: bool = True, plan: Plan | None = None) -> Session:
    """A command's setup before the model: its ``split`` (and data.eval with ``with_eval``) loaded and checked (the
    model family, the kinds' and the objective's refusals), planned; with ``task`` the task metric's scorer, checked
    before any weight loads; with ``savings`` the memory savings for the plan's largest unit on ``info``'s device,
    agreed by every rank. ``n_groups`` replaces ``packing.continuation_groups`` (1: whole packs, as an evaluation
    and pretune-fla run them); ``examples``: the split's examples, made by the caller (the bench's generated
    data), in place of reading it, and ``plan`` their plan, made already; ``model`` False: no model is built or
    sized (``plan`` of the data alone), so none is asked for."""
    from packtrain.packed.families import check_model

    start = None
    if model:
        from packtrain.models.start_adapter import read_start

        check_model(cfg)  # an unsupported model family or layer type is refused before any data is read
        start = read_start(cfg)  # and model.adapter: a missing, damaged or other base's adapter
        if start is not None and (info is None or info.is_main):
            print(start.describe())
            if start.note:
                print(start.note)
    examples = load_split(cfg, split) if examples is None else examples
    if examples is None:
        raise ValueError(f"data.{split}: not set")
    eval_examples = load_split(cfg, "eval") if with_eval else None
    scorer = tokenizer = None
    if task:
        scorer, tokenizer = task_start(cfg, "eval" if with_eval else split)
    kinds = Kinds.of(cfg, n_groups=n_groups)
    _check_images(cfg, kinds, examples + (eval_examples or []))
    kinds.check(examples, f"data.{split}")
    if eval_examples:
        kinds.objective.check(eval_examples, "data.eval")
    plan = kinds.plan(cfg, examples) if plan is None else plan
    session = Session(cfg, info, split, examples, plan, kinds, eval_examples,
                      kinds.plan(cfg, eval_examples) if eval_examples else None, scorer=scorer,
                      task_tokenizer=tokenizer, start=start)
    if savings:
        _, session.choice = choose_savings(cfg, plan, examples, info, kinds)
    return session


def _check_images(cfg: Config, kinds: Kinds, examples: list) -> None:
    """The support table on the data: what the run's kinds build with images (continuation groups take text only),
    naming the first example that has one."""
    pictured = next((ex for ex in examples if getattr(ex, "images", ())), None)
    if pictured is None:
        return
    refused = support.refusals(dataclasses.replace(support.Combination.of(cfg, images=True), groups=kinds.n_groups))
    if refused:
        raise ValueError(f"{pictured.source}: {refused[0]}")


# The task metric's start: torch-free, so `packtrain plan` checks it without importing the model code
def load_task_scorer(cfg) -> Scorer:
    """``generate.metric`` loaded at startup, the config file's directory and the working directory searched
    first for a ``python:`` scorer's module."""
    return load_scorer(cfg.generate.metric, [cfg.base_dir, "."])


def task_tokenizer(cfg, fmt: str | None):
    """The tokenizer that turns ids into text: the data's (``data.tokenizer``, else the model directory's, else, for
    text and chat, the bundled one); None for pretokenized data with no tokenizer directory."""
    path = cfg.resolve_path(cfg.data.tokenizer or cfg.model.path)
    if path is not None and (path / "tokenizer.json").is_file():
        return load_tokenizer(path)
    if fmt == "pretokenized":
        return None
    return load_tokenizer(None)


def task_start(cfg, split: str = "eval") -> tuple[Scorer, object | None]:
    """What the task metric needs before the model loads, checked at start: (the scorer, the tokenizer or None)."""
    if getattr(cfg.data, split) is None:  # online GRPO's rewards without data.eval: the training requests'
        split = "train"
    fmt = cfg.data.format or detect_format(cfg.resolve_path(getattr(cfg.data, split)))
    scorer, tokenizer = load_task_scorer(cfg), task_tokenizer(cfg, fmt)
    check_text(scorer, tokenizer)
    return scorer, tokenizer
