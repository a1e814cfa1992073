"""metrics.jsonl (one line per step, eval lines marked ``"split": "eval"``), peak memory, and the loss plot."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: peak allocated on the device; CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class MetricsLog:
    def __init__(self, path: Path, enabled: bool = True, resume: bool = False):
        self.path = Path(path)
        self.enabled = enabled
        if enabled and not resume and self.path.exists():
            self.path.unlink()

    def truncate_after(self, step: int, warn=print) -> None:
        """On resume: drop lines a killed run wrote after the checkpoint it resumes from, and lines a kill cut
        off mid-write (with a warning naming them)."""
        if not (self.enabled and self.path.exists()):
            return
        kept = []
        for n, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
            rec = _parse(line)
            if rec is None and line.strip():
                warn(f"{self.path}: line {n} is damaged (cut off by a kill?); dropped: {line[:80]!r}")
            elif rec is not None and rec["step"] <= step:
                kept.append(line)
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record, allow_nan=False) + "\n")  # NaN/inf is stopped before it gets here


def _parse(line: str) -> dict | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("step"), int) else None


def plot_losses(metrics_path: Path, out_png: Path) -> Path | None:
    """Train loss per step and eval loss at each evaluation (under weighted also the eval's weighted loss); below it
    a panel for each of: the reward accuracy on data.eval's pairs at each evaluation (train.objective dpo), the task's
    mean score at each generation line (``generate.every``), and under grpo each step's mean reward, its clip
    fraction and its KL. One PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not metrics_path.exists():
        return None
    train, evals, weighted, accuracy, scores = [], [], [], [], []
    rl = {"reward_mean": [], "clip_fraction": [], "kl": []}  # grpo's step figures
    for line in metrics_path.read_text(errors="replace").splitlines():
        rec = _parse(line) or {}
        if rec.get("split") == "generate":
            if rec.get("mean_score") is not None:
                scores.append((rec["step"], rec["mean_score"]))
        elif rec.get("loss") is not None:  # a step whose every unit was skipped has no loss
            (evals if rec.get("split") == "eval" else train).append((rec["step"], rec["loss"]))
            for key, points in rl.items():
                if rec.get("split") is None and rec.get(key) is not None:
                    points.append((rec["step"], rec[key]))
            if rec.get("split") == "eval" and rec.get("weighted_loss") is not None:
                weighted.append((rec["step"], rec["weighted_loss"]))
            if rec.get("split") == "eval" and rec.get("reward_accuracy") is not None:
                accuracy.append((rec["step"], rec["reward_accuracy"]))
    panels = [p for p in (("reward accuracy", accuracy, "D-", "tab:purple",
                           "eval: reward accuracy (share of pairs whose implicit reward prefers chosen)", True),
                          ("task score", scores, "s-", "tab:green", "task: mean score on data.eval", True),
                          ("reward", rl["reward_mean"], "-", "tab:orange", "train: the step's mean reward", False),
                          ("clipped", rl["clip_fraction"], "-", "tab:red",
                           "train: share of the step's tokens the clip took", True),
                          ("KL", rl["kl"], "-", "tab:brown", "train: mean k3 KL to the reference per token", False))
              if p[1]]
    # a Figure on the Agg canvas, not pyplot: no figure manager, no global state
    height = 4 + 2.5 * len(panels)
    fig = Figure(figsize=(7, height))
    FigureCanvasAgg(fig)
    # fixed margins in inches (tight_layout drew the figure a second time: a third of the plot's time)
    fig.subplots_adjust(left=0.75 / 7, right=1 - 0.15 / 7, top=1 - 0.15 / height, bottom=0.55 / height,
                        hspace=0.15)
    axes = fig.subplots(1 + len(panels), 1, sharex=True, squeeze=False)
    ax = axes[0, 0]
    if train:
        what = "mean DPO loss" if accuracy else "GRPO loss" if rl["reward_mean"] else "mean per-example loss"
        ax.plot(*zip(*train), label=f"train ({what})", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval" if not accuracy else "eval (mean DPO loss over pairs)", lw=1.5)
    if weighted:
        ax.plot(*zip(*weighted), "^--", label="eval, weighted", lw=1.5)
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    for (ylabel, points, style, color, label, unit), panel in zip(panels, axes[1:, 0]):
        panel.plot(*zip(*points), style, color=color, label=label, lw=1.5)
        panel.set_ylabel(ylabel)
        if unit:  # a share, from 0 to 1 (a reward or a KL takes the range of its points)
            panel.set_ylim(-0.02, 1.02)
        panel.grid(alpha=0.3)
        panel.legend()
    axes[-1, 0].set_xlabel("optimizer step")
    fig.savefig(out_png, dpi=100)
    return out_png
