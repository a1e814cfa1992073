"""`packtrain eval`'s refusals before any model loads (packtrain/commands/eval.py), in this process: an
``--adapter`` that is not a PEFT adapter directory, and a config with neither data.eval nor data.train. What it
writes is checked through the CLI (tests/commands/test_train.py, test_generate_cli.py, test_pairs_cli.py). Named
after the subcommand: tests/run/test_evaluate.py is packtrain/run/evaluate.py's, and a test file's name is in one
folder only (no __init__.py: pytest imports a test file by its name alone)."""

import argparse

import pytest
from cli_helpers import write_config

from packtrain.commands.eval import run_eval


def _args(config, adapter, out, generate=False):
    return argparse.Namespace(config=str(config), overrides=[], adapter=str(adapter), out=str(out),
                              generate=generate)


def test_an_adapter_directory_without_adapter_config_json_is_refused(tmp_path):
    """A run directory given for its adapter: nothing written, nothing loaded."""
    cfg = write_config(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ValueError, match=rf"^--adapter: {run} is not a PEFT adapter directory \(no "
                                         r"adapter_config.json; `--adapter none` evaluates the base model\)$"):
        run_eval(_args(cfg, run, tmp_path / "e.jsonl"))
    assert not (tmp_path / "e.jsonl").exists()


def test_nothing_to_evaluate_is_refused(tmp_path):
    cfg = write_config(tmp_path, data={"train": None, "eval": None})
    with pytest.raises(ValueError, match="^data.eval and data.train are both unset: nothing to evaluate$"):
        run_eval(_args(cfg, "none", tmp_path / "e.jsonl"))
