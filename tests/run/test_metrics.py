"""metrics.jsonl, peak memory and the loss plot (packtrain/run/metrics.py): a new run starts the file afresh and a
resumed one keeps it, a resume drops the lines after its checkpoint and those a kill cut off, the CPU peak is in
bytes, and the plot gains a panel for each extra series."""

import json
import re
from pathlib import Path

import pytest
import torch

from packtrain.run.metrics import MetricsLog, peak_memory_bytes, plot_losses


def _steps(path: Path) -> list:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_new_log_replaces_an_old_file_and_a_resumed_one_appends(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 7}\n')
    MetricsLog(path, resume=True).write({"step": 8})
    assert _steps(path) == [7, 8]
    log = MetricsLog(path)
    assert not path.exists()
    log.write({"step": 1, "loss": 2.5})
    log.write({"step": 2, "split": "eval", "loss": 2.0})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "loss": 2.5}, {"step": 2, "split": "eval", "loss": 2.0}]


def test_a_disabled_log_neither_removes_nor_writes(tmp_path):
    """Ranks other than 0 hold a disabled log: they must not touch rank 0's file."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 3}\n')
    log = MetricsLog(path, enabled=False)
    log.write({"step": 4})
    log.truncate_after(0)
    assert path.read_text() == '{"step": 3}\n'


def test_a_non_finite_value_is_refused_not_written(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    with pytest.raises(ValueError):
        log.write({"step": 1, "loss": float("nan")})


def test_truncate_after_keeps_the_steps_up_to_the_checkpoint_and_drops_a_cut_off_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = ['{"step": 1, "loss": 3.0}', '{"step": 2, "split": "eval", "loss": 2.9}', '{"step": 2, "loss": 2.8}',
             '{"step": 3, "loss": 2.7}', '', '{"step": 4, "lo']
    path.write_text("\n".join(lines))
    warnings = []
    MetricsLog(path, resume=True).truncate_after(2, warn=warnings.append)
    assert path.read_text() == "".join(line + "\n" for line in lines[:3])
    (warning,) = warnings  # the blank line is no damage; the cut-off one is named by its line number
    assert re.search(r"metrics.jsonl: line 6 is damaged .*dropped: '\{\"step\": 4, \"lo'", warning), warning


def test_the_cpu_peak_is_the_resident_set_in_bytes():
    """Linux reports ru_maxrss in KiB: the peak is about the resident set now (VmRSS) or more, not 1024 times less
    (the kernel updates the peak lazily, so it may trail VmRSS a little)."""
    rss = int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    assert rss // 2 <= peak_memory_bytes(torch.device("cpu")) < 512 * rss


def test_the_loss_plot_gains_a_task_panel_with_generation_lines(tmp_path):
    import matplotlib.image

    from packtrain.run.metrics import plot_losses

    lines = [{"step": 1, "loss": 3.0}, {"split": "eval", "step": 1, "loss": 2.5}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    one = matplotlib.image.imread(plot_losses(metrics, tmp_path / "one.png")).shape
    lines += [{"split": "generate", "step": 0, "mean_score": 0.0}, {"split": "generate", "step": 1, "mean_score": 0.5}]
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    two = matplotlib.image.imread(plot_losses(metrics, tmp_path / "two.png")).shape
    assert two[1] == one[1] and two[0] > 1.5 * one[0]  # the same width, a second panel below the losses


def test_the_loss_plot_gains_a_reward_accuracy_panel_under_dpo(tmp_path):
    import matplotlib.image

    from packtrain.run.metrics import plot_losses

    lines = [{"step": 1, "loss": 0.69}, {"split": "eval", "step": 1, "loss": 0.6}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    one = matplotlib.image.imread(plot_losses(metrics, tmp_path / "one.png")).shape
    lines[1] |= {"pairs": 3, "reward_accuracy": 0.5, "reward_margin": 0.1}
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    two = matplotlib.image.imread(plot_losses(metrics, tmp_path / "two.png")).shape
    assert two[1] == one[1] and two[0] > 1.5 * one[0]  # a second panel below the losses


def test_the_loss_plot_gains_grpos_reward_clip_and_kl_panels(tmp_path):
    """Under grpo each step's record carries its mean reward, clip fraction and (beta > 0) KL: a panel each, below
    the losses; a reward outside [0, 1] is drawn on its own scale."""
    import matplotlib.image

    from packtrain.run.metrics import plot_losses

    lines = [{"step": s, "loss": 0.1 * s} for s in (1, 2, 3)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    one = matplotlib.image.imread(plot_losses(metrics, tmp_path / "one.png")).shape
    for x, reward in zip(lines, (-3.0, 2.5, 7.0)):
        x |= {"reward_mean": reward, "clip_fraction": 0.01 * x["step"]}
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    three = matplotlib.image.imread(plot_losses(metrics, tmp_path / "three.png")).shape
    for x in lines:
        x["kl"] = 0.002 * x["step"]
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    four = matplotlib.image.imread(plot_losses(metrics, tmp_path / "four.png")).shape
    assert three[1] == one[1] == four[1] and three[0] > 2 * one[0] and four[0] > three[0]  # two panels, then three


def test_no_metrics_file_draws_no_plot(tmp_path):
    assert plot_losses(tmp_path / "metrics.jsonl", tmp_path / "loss.png") is None
    assert not (tmp_path / "loss.png").exists()
