"""`packtrain export OUTPUT_DIR --merged DIR`: the base checkpoint of a run with its adapter merged in, in the
base's own layout (:mod:`packtrain.models.export`). The base is ``model.path`` of OUTPUT_DIR/config.yaml (a relative path
is looked for from the current directory, OUTPUT_DIR and its parent; ``--base`` overrides it), or
OUTPUT_DIR/base for a run whose base came from ``model.config``. The adapter directory is left as it is."""

from __future__ import annotations

from pathlib import Path

import yaml


def _base_dir(output: Path, run: dict, override: str | None) -> Path:
    if override is not None:
        return Path(override)
    model = run.get("model") or {}
    if model.get("config") is not None:
        return output / "base"
    if not model.get("path"):
        raise ValueError(f"{output / 'config.yaml'}: model.path is not set; give the base with --base")
    path = Path(model["path"]).expanduser()
    if path.is_absolute():
        return path
    # config.yaml keeps model.path as written, relative to the training config's folder, which it does not record
    candidates = [path, output / path, output.parent / path]
    return next((c for c in candidates if (c / "config.json").is_file()), path)


def run_export(args) -> int:
    from packtrain.data.examples import BUNDLED_TOKENIZER
    from packtrain.data.images import BUNDLED_PROCESSOR
    from packtrain.models.export import export_merged
    from packtrain.rundir.disk import check_not_an_input, check_output_path

    output = Path(args.output_dir)
    check_output_path(args.merged, "--merged", directory=True)
    run_config = output / "config.yaml"
    if not run_config.is_file():
        raise ValueError(f"{output}: no config.yaml (not the output directory of a packtrain train run)")
    run = yaml.safe_load(run_config.read_text()) or {}
    base = _base_dir(output, run, args.base)
    if not (base / "config.json").is_file():
        raise ValueError(f"base {base}: not a local model directory (no config.json); give it with --base")
    adapter = Path(args.adapter) if args.adapter else output / "adapter"
    data = run.get("data") or {}
    # a base without tokenizer or processor files gets the ones the run used (the bundled ones for a random base)
    extra = [Path(p) for p in (data.get("tokenizer"), data.get("processor")) if p]
    if (run.get("model") or {}).get("config") is not None:
        extra += [BUNDLED_TOKENIZER, BUNDLED_PROCESSOR]
    inputs = [("the run's config", run_config), ("--adapter", adapter), ("the base", base),
              *((f"data.{k}", Path(data[k])) for k in ("tokenizer", "processor") if data.get(k))]
    check_not_an_input(args.merged, "--merged", inputs)
    export_merged(base, adapter, Path(args.merged), extra_dirs=extra)
    return 0
