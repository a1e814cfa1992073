"""`packtrain export OUTPUT_DIR (--merged DIR | --for vllm|sglang DIR)`: a run's adapter in the form a server loads
(:mod:`packtrain.models.exports`). The base is ``model.path`` of OUTPUT_DIR/config.yaml (a relative path is looked
for from the current directory, OUTPUT_DIR and its parent; ``--base`` overrides it), or OUTPUT_DIR/base for a run
whose base came from ``model.config``. A run that started from a trained adapter (``model.adapter``, looked for as
``model.path`` is) has it folded into that base first. The tokenizer and chat template are the run's
(OUTPUT_DIR/tokenizer). The adapter directory is left as it is."""

from __future__ import annotations

from pathlib import Path

import yaml


def _found(output: Path, value: str | None) -> Path | None:
    """A path of OUTPUT_DIR/config.yaml: config.yaml keeps it as written, relative to the training config's folder,
    which it does not record."""
    if not value:
        return None
    path = Path(value).expanduser()
    if path.is_absolute():
        return path
    candidates = [path, output / path, output.parent / path]
    return next((c for c in candidates if c.exists()), path)


def _base_dir(output: Path, run: dict, override: str | None) -> Path:
    if override is not None:
        return Path(override)
    model = run.get("model") or {}
    if model.get("config") is not None:
        return output / "base"
    if not model.get("path"):
        raise ValueError(f"{output / 'config.yaml'}: model.path is not set; give the base with --base")
    return _found(output, model["path"])


def _start(output: Path, run: dict, base: Path, override: str | None):
    """The run's ``model.adapter`` chain, checked against the base the export reads (for a ``model.config`` run's
    OUTPUT_DIR/base, also against the config and seed it was made from); None without one."""
    from packtrain.models.start_adapter import checkpoint_identity, config_identity, read_chain

    model = run.get("model") or {}
    if not model.get("adapter"):
        return None
    identities = [checkpoint_identity(base)]
    if model.get("config") is not None and override is None:
        identities.append(config_identity(model["config"], model.get("seed", 0)))
    start = read_chain(_found(output, model["adapter"]), identities, f"the base {base}")
    if start.note:
        print(start.note)
    return start


def _run_files(output: Path, run: dict, base: Path):
    """The run's tokenizer, chat template and processor: OUTPUT_DIR/tokenizer, or for a run directory written before
    packtrain kept it there, the config's data.tokenizer / data.chat_template / data.processor (else the base's own
    files, else the bundled ones the run read)."""
    from packtrain.data.chat import read_template
    from packtrain.data.images import BUNDLED_PROCESSOR
    from packtrain.data.jsonl import BUNDLED_TOKENIZER
    from packtrain.models.exports import RunFiles
    from packtrain.rundir.tokenizer import run_files

    kept = run_files(output)
    if kept is not None:
        return kept
    data = run.get("data") or {}
    random_base = (run.get("model") or {}).get("config") is not None
    tokenizer = _found(output, data.get("tokenizer")) or (BUNDLED_TOKENIZER if random_base else base)
    # as data.examples.processor_dir: data.processor, else the base's own processor, else the bundled one
    processor = _found(output, data.get("processor")) or (
        base if (base / "preprocessor_config.json").is_file() else BUNDLED_PROCESSOR)
    template = _found(output, data.get("chat_template"))
    if template is not None and not template.is_file():
        raise ValueError(f"{output / 'config.yaml'}: data.chat_template {data['chat_template']} not found (looked "
                         f"from here, {output} and {output.parent}); the export must carry the template the run "
                         "trained with")
    return RunFiles(tokenizer, read_template(template) if template is not None else None, processor)


def run_export(args) -> int:
    from packtrain.models.exports import adapter_name, export_for, export_merged
    from packtrain.models.serving import SERVERS
    from packtrain.rundir.disk import check_not_an_input, check_output_path

    output = Path(args.output_dir)
    server, target = (None, args.merged) if args.merged else args.serve
    if server is not None and server not in SERVERS:
        raise ValueError(f"--for: unknown server {server!r} (one of {', '.join(SERVERS)})")
    flag = f"--for {server}" if server else "--merged"
    check_output_path(target, flag, directory=True)
    run_config = output / "config.yaml"
    if not run_config.is_file():
        raise ValueError(f"{output}: no config.yaml (not the output directory of a packtrain train run)")
    run = yaml.safe_load(run_config.read_text()) or {}
    base = _base_dir(output, run, args.base)
    if not (base / "config.json").is_file():
        raise ValueError(f"base {base}: not a local model directory (no config.json); give it with --base")
    adapter = Path(args.adapter) if args.adapter else output / "adapter"
    start = _start(output, run, base, args.base)
    files = _run_files(output, run, base)
    inputs = [("the run's config", run_config), ("--adapter", adapter), ("the base", base),
              *([("the run's model.adapter", start.top.dir)] if start else []),
              *((f"the run's {k}", p) for k, p in (("tokenizer", files.tokenizer), ("processor", files.processor))
                if p is not None)]
    check_not_an_input(target, flag, inputs)
    if server is None:
        export_merged(base, adapter, Path(target), files, start=start)
    else:
        export_for(server, base, adapter, Path(target), files, adapter_name(output), args.server_version,
                   start=start)
    return 0
