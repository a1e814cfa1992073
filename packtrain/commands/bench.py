"""`packtrain bench [CONFIG] [--preset tiny|cpu|gpu] [--set ...] [--out DIR] [--variants ...]`: time one epoch of the
same examples trained five ways (packtrain shared-prefix under each ``packing.context_grad``: full, kv_only, frozen;
packtrain standalone; a plain transformers + peft loop), interleaved in one process; print a table and write
DIR/bench.json and DIR/bench.png (:mod:`packtrain.bench`).

Without CONFIG the preset (default ``cpu``) gives the config and the data shape; with CONFIG, its model, LoRA,
optimizer, packing and steps are used, and its ``data.train`` unless a data-shape option asks for generated data.
Generated data is written beside the results, DIR/train.jsonl (pre-tokenized) with DIR/config.yaml, so that
``packtrain train DIR/config.yaml`` trains the same steps the bench's packtrain variants train.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path


def _range(flag: str, value: str) -> tuple[int, int]:
    lo, _, hi = value.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"{flag}: expected N or MIN:MAX, got {value!r}") from None


def _shape(args, preset):
    shape = preset.shape
    if args.cont_tokens is not None:
        shape = dataclasses.replace(shape, cont_tokens=_range("--cont-tokens", args.cont_tokens))
    if args.turns is not None:
        shape = dataclasses.replace(shape, turns=_range("--turns", args.turns))
    for name in ("prompts", "prefix_tokens", "continuations"):
        if getattr(args, name) is not None:
            shape = dataclasses.replace(shape, **{name: getattr(args, name)})
    if args.extra_continuations:
        shape = dataclasses.replace(shape, extra=tuple(parse_extra(spec) for spec in args.extra_continuations))
    return shape


def _variants(args, known, default) -> list[str]:
    if args.variants is None:
        return list(default)
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in known]
    if unknown or not chosen:
        raise ValueError(f"--variants: unknown {', '.join(unknown) or 'empty list'} (known: {', '.join(known)})")
    return chosen


def parse_extra(spec: str) -> tuple[int, int, int]:
    """``COUNTxN`` or ``COUNTxMIN:MAX`` -> (count, shortest, longest)."""
    count, _, lengths = spec.partition("x")
    lo, _, hi = lengths.partition(":")
    try:
        return int(count), int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--extra-continuations: expected COUNTxN or COUNTxMIN:MAX, got {spec!r}") from None


def _generated(args) -> bool:
    return any(getattr(args, n) is not None for n in ("prompts", "prefix_tokens", "continuations", "cont_tokens",
                                                      "extra_continuations", "turns"))


def _model_summary(cfg, text: dict, backend, trainable: int, kinds) -> dict:
    from packtrain.models.text_config import FULL

    types = text["layer_types"]
    full = sum(t == FULL for t in types)
    ckpt = ", checkpointed layers" if cfg.train.activation_checkpointing or cfg.train.offload else ""
    ckpt += "".join(f", {line}" for line in kinds.pack.runs({}))
    describe = (f"{len(types)} layers ({len(types) - full} GDN + {full} attention), hidden {text['hidden_size']:,}, "
                f"vocab {text['vocab_size']:,}, {cfg.model.dtype}, LoRA r {cfg.lora.r} on "
                f"{','.join(cfg.lora.target_modules)} ({trainable:,} parameters){ckpt}; kernels {backend.describe()}")
    return {"layers": len(types), "full_attention_layers": full, "hidden_size": text["hidden_size"],
            "vocab_size": text["vocab_size"], "dtype": cfg.model.dtype, "kernels": backend.describe(),
            "activation_checkpointing": bool(cfg.train.activation_checkpointing or cfg.train.offload),
            "lora_r": cfg.lora.r,
            "lora_targets": list(cfg.lora.target_modules), "trainable_parameters": trainable,
            "continuation_groups": kinds.n_groups, "describe": describe}


def _machine(device, load_before: float) -> dict:
    import torch
    import transformers

    cuda = device.type == "cuda"
    if cuda:
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu, {torch.get_num_threads()} torch threads of {os.cpu_count()} cores"
    return {"device": name, "cuda": cuda, "torch": torch.__version__, "transformers": transformers.__version__,
            "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_before": load_before,
            "load_after": os.getloadavg()[0]}


def _config_and_data(args, preset):
    """(config, text config dict, the generated examples or None (the config's data.train), what the data is, the
    generated shape or None)."""
    from packtrain.bench.presets import generate_examples
    from packtrain.config import config_from_dict, load_config
    from packtrain.config.typed import apply_overrides
    from packtrain.models.text_config import config_dict_of, text_config

    if args.config is not None:
        cfg = load_config(args.config, args.overrides)
    else:
        cfg = config_from_dict(apply_overrides(preset.config, args.overrides), source=f"preset {preset.name}")
    text = text_config(config_dict_of(cfg))
    if args.config is not None and cfg.data.train is not None and not _generated(args):
        return cfg, text, None, str(cfg.resolve_path(cfg.data.train)), None  # the session reads data.train
    shape = _shape(args, preset)
    examples = generate_examples(shape, text["vocab_size"], cfg.train.seed)
    return cfg, text, examples, f"generated: {shape.describe()}", shape


def write_run_config(out: Path, cfg, examples) -> Path:
    """DIR/train.jsonl (the generated examples, pre-tokenized) and DIR/config.yaml (the bench's config reading it,
    one epoch): the run ``packtrain train`` makes of the same steps."""
    import json

    import yaml

    from packtrain.data.preference import pair_examples
    from packtrain.data.scored import group_examples

    rows = [{"id": ex.id, "prefix_ids": list(ex.prefix_ids), "item_ids": list(ex.item_ids),
             "target_ids": list(ex.target_ids)} for ex in examples if not ex.pair and not ex.group]
    rows += [{"id": examples[g[0]].group, "prefix_ids": list(examples[g[0]].prefix_ids),
              "item_ids": list(examples[g[0]].item_ids), "completion_ids": [list(examples[k].target_ids) for k in g],
              "rewards": [examples[k].reward for k in g]} for g in group_examples(examples)]
    rows += [{"id": examples[c].pair, "prefix_ids": list(examples[c].prefix_ids),
              "item_ids": list(examples[c].item_ids), "chosen_ids": list(examples[c].target_ids),
              "rejected_ids": list(examples[r].target_ids)} for c, r in pair_examples(examples)]
    lines = [json.dumps(row) for row in rows]
    (out / "train.jsonl").write_text("\n".join(lines) + "\n")
    tree = cfg.to_dict()
    tree["data"] = {**tree["data"], "train": "train.jsonl", "eval": None, "format": "pretokenized"}
    tree["train"] = {**tree["train"], "epochs": 1, "max_steps": None}  # the bench trains one epoch
    tree["output_dir"] = "run"
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def run_bench(args) -> int:
    import torch

    from packtrain.bench.presets import H100_BF16_DENSE_TFLOPS, H100_SOURCE, get_preset
    from packtrain.bench.report import format_table, plot, speedups, versus, write_json
    from packtrain.bench.timing import interleave, summarize
    from packtrain.bench.variants import DEFAULT_VARIANTS, VARIANTS, Models, Workload
    from packtrain.data.planner import plan_stats, target_count
    from packtrain.distributed import init_distributed
    from packtrain.run.header import savings_lines
    from packtrain.run.session import open_session
    from packtrain.rundir.disk import check_not_an_input, check_output_path, config_inputs

    check_output_path(args.out, "--out", directory=True)  # before the models are built and timed
    load_before = os.getloadavg()[0]
    preset = get_preset(args.preset or "cpu")
    threads = args.threads or preset.threads
    if threads is not None:
        torch.set_num_threads(threads)
    repeats = preset.repeats if args.repeats is None else args.repeats
    cfg, text, examples, data, shape = _config_and_data(args, preset)
    run_files = ("config.yaml", "train.jsonl") if shape is not None else ()
    check_not_an_input(args.out, "--out", config_inputs(cfg, args.config), writes=("bench.json", "bench.png", *run_files))
    info = init_distributed(cfg.train.device, cfg.ops.collective_timeout)
    device = info.device
    given_cfg = cfg
    # the run's setup (packtrain/run/session.py) on the bench's data: its plan and the savings train would take for
    # the largest pack on this device
    session = open_session(cfg, info, "train", examples=examples)
    plan, choice, cfg, examples = session.plan, session.choice, session.run_cfg, session.examples
    stats = plan_stats(plan, examples)
    work = Workload.of(session)
    print(f"packtrain bench: {data}; {stats['examples']} examples -> {stats['packs']} pack(s), {len(work.steps)} step(s); "
          f"position ratio {stats['position_ratio']:.2f}x; building the models on {device}")
    print("\n".join(savings_lines(choice)))
    models = Models(work)
    warmup = preset.warmup if args.warmup is None else args.warmup
    chosen = _variants(args, VARIANTS, preset.variants or DEFAULT_VARIANTS)
    target_tokens = sum(target_count(examples[e]) for pack in plan.packs for e in pack.examples)
    figures, notes = {}, []
    for name in chosen:  # each variant's own plan (the tree's: the tree planner's), planned before any is timed
        variant = VARIANTS[name]
        own = plan_stats(work.for_variant(variant).plan, examples)
        if own != stats:
            stats[name] = own
        figures[name] = variant.figures(work, own, target_tokens)
        note = variant.note.format(**own, base=stats["positions_packed"])
        notes += [note] if note and note not in notes else []
    runs = interleave(models, work, chosen, repeats, warmup)
    peak = args.peak_tflops or (H100_BF16_DENSE_TFLOPS if device.type == "cuda" else None)
    result = {
        "title": f"packtrain bench ({f'preset {preset.name}' if args.config is None else args.config}): {data}",
        "command": "packtrain " + " ".join(sys.argv[1:]),
        "preset": preset.name if args.config is None else None,
        "config": args.config,
        "data": data,
        "shape": None if shape is None else dataclasses.asdict(shape),
        "model": _model_summary(cfg, text, models.backend, models.trainable_parameters(), session.kinds),
        "memory": {"savings": dataclasses.asdict(choice.chosen.savings),
                   "relative_step_cost": choice.chosen.relative_cost,
                   "total_device_bytes": choice.chosen.device_bytes, "device_budget_bytes": choice.budget.device_bytes,
                   "fits": choice.chosen.fits, "choice": choice.as_json()},
        "machine": _machine(device, load_before),
        "plan": stats,
        "position_ratio": stats["position_ratio"],
        "attention_pair_ratio": stats["attention_pair_ratio"],
        "target_tokens": target_tokens,
        "steps_per_epoch": len(work.steps),
        "repeats": repeats,
        "warmup": warmup,
        "peak_tflops": peak,
        "peak_source": None if peak is None else ("--peak-tflops" if args.peak_tflops else H100_SOURCE),
        "variants": summarize(runs, figures, stats, target_tokens, text, peak),
        "notes": notes,
    }
    result["speedup"], result["speedup_over_position_ratio"], result["final_loss_rel_diff"] = speedups(result)
    result["cpu_speedup"], result["cpu_speedup_over_position_ratio"], _ = speedups(result, "cpu_seconds")
    if preset.name in ("dpo", "rl") and args.config is None:
        result["tree_vs_standalone"] = {clock: versus(result, "tree", "standalone", clock)
                                        for clock in ("seconds", "cpu_seconds")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(format_table(result))
    print(f"json: {write_json(result, out)}")
    png = plot(result, out)
    print(f"chart: {png}" if png else "chart: skipped (matplotlib is not installed)")
    if shape is not None:
        print(f"the same run: packtrain train {write_run_config(out, given_cfg, examples)}")
    return 0
