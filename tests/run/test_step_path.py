"""The files one training step crosses, traced, against the list in docs/design.md ("One training step, file by
file"): a file the step starts to call, or one it no longer calls, fails here until the list says so."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from cli_helpers import REPO, run_in_process

from packtrain.run import trainer as trainer_module

SECTION = "## One training step, file by file"


def _listed() -> tuple[list[str], list[str]]:
    """The section's two tables: (the step's path, the files under the model's forward), each in its order."""
    text = (REPO / "docs" / "design.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    tables = re.findall(r"\| file \|.*?\n\|---\|---\|\n((?:\|.*\|\n)+)", section)
    assert len(tables) == 2, tables
    return tuple([re.match(r"\| `([^`]+)` \|", row).group(1) for row in t.splitlines()] for t in tables)


def _trace_second_step(monkeypatch, tmp_path: Path) -> list[str]:
    """The packtrain files called from ``Trainer._train_step`` of the demo's second step until its
    ``optimizer.step()`` returns, in the order first called."""
    package = str(REPO / "packtrain") + "/"
    seen: list[str] = []
    original = trainer_module.Trainer._train_step

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(package):
            rel = str(Path(name).relative_to(REPO))
            if rel not in seen:
                seen.append(rel)

    def traced(self, epoch, pack_ids, check_gradients):
        if self.counters.step != 1:
            return original(self, epoch, pack_ids, check_gradients)
        optimizer = self.step.optimizer
        update = optimizer.step

        def last(*args, **kwargs):  # the step's end: nothing after optimizer.step() is traced
            result = update(*args, **kwargs)
            sys.setprofile(None)
            return result

        monkeypatch.setattr(optimizer, "step", last)
        sys.setprofile(tracer)
        try:
            return original(self, epoch, pack_ids, check_gradients)
        finally:
            sys.setprofile(None)

    monkeypatch.setattr(trainer_module.Trainer, "_train_step", traced)
    run_in_process("train", REPO / "configs" / "demo.yaml", "--set", f"output_dir={tmp_path / 'run'}",
                   "--set", "train.max_steps=2", "--set", "generate.every=null", "--set", "data.eval=null")
    return seen


def test_the_step_crosses_the_files_design_md_lists(monkeypatch, tmp_path):
    path, model = _listed()
    assert len(path) <= 10, path  # issue 56: the step's own path crosses at most ten files
    traced = _trace_second_step(monkeypatch, tmp_path)
    assert traced[0] == "packtrain/run/trainer.py", traced
    assert sorted(traced) == sorted(path + model), (
        f"called but not listed: {sorted(set(traced) - set(path + model))}; "
        f"listed but not called: {sorted(set(path + model) - set(traced))}")


def test_the_trace_sees_a_file_the_list_lacks(monkeypatch, tmp_path):
    """The comparison can fail: a step that also calls into packtrain/run/metrics.py is caught."""
    from packtrain.run import metrics, step

    finish = step.Step._finish

    def with_a_detour(self, *args):
        metrics.peak_memory_bytes(self.info.device)
        return finish(self, *args)

    monkeypatch.setattr(step.Step, "_finish", with_a_detour)
    traced = _trace_second_step(monkeypatch, tmp_path)
    path, model = _listed()
    assert "packtrain/run/metrics.py" in set(traced) - set(path + model)
