"""`packtrain eval CONFIG --adapter DIR --out FILE.jsonl`: one ``{"id", "loss", "target_tokens"}`` line per example,
packed by default, standalone with ``--set packing.mode=standalone``. Uses data.eval, else data.train. Under
``train.objective weighted`` each line has the example's ``weight`` too, and the summary the weighted mean loss; under
``dpo`` one line per preference pair (its policy and reference log-probabilities and margins, the implicit reward
margin and the DPO loss; the reference a second no-grad pass with the adapter disabled), and the summary the DPO loss,
the reward accuracy and the mean reward margin (:mod:`packtrain.run.eval_figures`).

With ``--generate``: every example's answer generated (P prefilled once per prompt group, :mod:`packtrain.run.generate`)
and scored with ``generate.metric`` (:mod:`packtrain.run.task`; of a preference pair, the answer to its item
generated once and scored against the chosen answer): one ``{"id", "prediction_ids", "prediction",
"target", "stop", "score", "match"}`` line per example, the mismatches in ``FILE.errors.md``, and a summary line.
``--adapter none`` runs the base model. A config with ``model.adapter`` evaluates on the base with that adapter
folded in (the run's own starting point): an adapter packtrain trained from another start, or from none, is refused."""

from __future__ import annotations

import json
import sys
import math
from pathlib import Path

from packtrain.config import load_config
from packtrain.distributed import init_distributed, shutdown
from packtrain.exits import NonFiniteError
from packtrain.rundir.disk import check_not_an_input, check_output_path, config_inputs


def run_eval(args) -> int:
    from packtrain.models.loading import read_adapter
    from packtrain.models.start_adapter import check_trained_adapter
    from packtrain.run import eval_figures, reference
    from packtrain.run.evaluate import evaluate
    from packtrain.run.session import open_session
    from packtrain.run.task import errors_path_for

    cfg = load_config(args.config, args.overrides)
    check_output_path(args.out, "--out", directory=False)
    adapter = None if args.adapter == "none" else Path(args.adapter)
    inputs = [*config_inputs(cfg, args.config), ("--adapter", adapter)]
    for written in (Path(args.out), errors_path_for(Path(args.out))) if args.generate else (Path(args.out),):
        check_not_an_input(written, "--out", inputs)
    if adapter is not None and not (adapter / "adapter_config.json").is_file():
        raise ValueError(f"--adapter: {adapter} is not a PEFT adapter directory (no adapter_config.json; "
                         "`--adapter none` evaluates the base model)")
    if adapter is not None:
        read_adapter(adapter)  # a damaged or truncated file: one line naming it, before the model is built
    if not cfg.data.eval and not cfg.data.train:
        raise ValueError("data.eval and data.train are both unset: nothing to evaluate")
    split = "eval" if cfg.data.eval else "train"
    info = init_distributed(cfg.train.device, cfg.ops.collective_timeout)
    try:
        # the run's setup (packtrain/run/session.py) on the split evaluated, each pack one call; the task's scorer
        # checked before the model loads
        session = open_session(cfg, info, split, savings=False, task=args.generate, n_groups=1)
        if adapter is not None:  # trained on top of a start adapter: evaluated on that start (model.adapter)
            check_trained_adapter(adapter, session.start)
        session.build_model(adapter=adapter, training=False)
        lm, examples, kinds = session.lm, session.examples, session.kinds
        out = Path(args.out)
        if args.generate:
            _generate(cfg, session, out, split, args.adapter)
            return 0
        plan = session.plan
        rows = evaluate(lm, plan, examples, kinds, info)
        ref = None
        if kinds.objective.paired:  # the reference: the base model; --adapter none evaluated it already
            ref = reference.table_of(rows) if adapter is None else reference.compute(lm, plan, examples, kinds, info)
        diverged = [r for r in rows if not math.isfinite(r["loss"])]
        if diverged:  # the same on every rank: the rows are gathered everywhere
            raise NonFiniteError(f"eval: {len(diverged)} of {len(rows)} examples of data.{split} have a non-finite "
                                 f"loss (the first: {diverged[0]['id']!r}, {diverged[0]['loss']!r}); the adapter "
                                 f"{args.adapter} has diverged; nothing written to {out}", quiet=not info.is_main)
        written, summary = eval_figures.figures(kinds.objective, rows, examples, ref)
        if info.is_main:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in written))
            print(f"packtrain eval: {len(rows)} examples of data.{split}, mode {cfg.packing.mode}, "
                  f"context_grad {cfg.packing.context_grad}, kernels {session.backend.describe()}, objective "
                  f"{kinds.objective.name}: {eval_figures.describe(summary)} -> {out}")
    finally:
        shutdown()
    return 0


def _generate(cfg, session, out: Path, split: str, adapter: str) -> None:
    from tqdm.auto import tqdm

    from packtrain.run.task import describe, errors_path_for, run_task, write_task

    info = session.info
    task = session.task(session.examples, split)
    bar = tqdm(total=None, desc="generate", unit="pack",  # a terminal only: a bar in a log file is one long line
               disable=not (info.is_main and cfg.logging.progress and sys.stderr.isatty()))
    result = run_task(session.lm, task, session.kinds, info, progress=bar)
    bar.close()
    if info.is_main:
        errors = errors_path_for(out)
        write_task(result, out, errors, task, f"packtrain eval --generate: adapter {adapter}, data.{split}")
        s, g = result.summary, cfg.generate
        how = "greedy" if g.temperature == 0 else f"sampled (temperature {g.temperature}, top_p {g.top_p}, seed {g.seed})"
        rate = f"{s['tokens_per_second']:.1f} tokens/s" if s["tokens_per_second"] else "n/a"
        print(f"packtrain eval --generate: {s['examples']} examples of data.{split} in {len(task.plan.prompts)} "
              f"prompt groups, {how}, metric {g.metric}: {describe(s)}; {s['tokens']} tokens generated in "
              f"{s['seconds']:.1f} s ({rate}) -> {out}")
        print(f"  mismatches: {errors}")
