"""How a run shows its steps: a progress bar on a terminal, plain lines everywhere else.

A bar redraws itself with ``\\r``: in a log file (``packtrain train ... > log 2>&1``, a cluster job) that is one
endless line that ``tail`` shows nothing of. So the bar is drawn only when stderr is a terminal and
``logging.progress`` is on; otherwise rank 0 prints one line at the first step this process runs, every
``logging.every`` steps and at the last step, as HF Trainer's logging does::

    step 20/340 (epoch 1): loss 1.2345, lr 4.00e-03, 1,234 positions/s, 45,678 tokens seen, 0:00:12 elapsed, ETA 0:03:20

``tokens seen`` counts the positions the packs trained (P once per pack), from step 1 of the run (a resumed run
goes on from its checkpoint's count). positions/s is over the steps since the previous line, the ETA the steps
left at this process's mean wall time per step so far (evaluations and checkpoints included).
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

from tqdm.auto import tqdm


def clock(seconds: float) -> str:
    """``H:MM:SS`` (days as hours: an ETA of 30 hours reads 30:00:00)."""
    return str(timedelta(seconds=round(seconds))) if seconds < 86400 else (
        f"{int(seconds // 3600)}:{int(seconds % 3600 // 60):02d}:{int(seconds % 60):02d}")


class Progress:
    """Rank 0's view of the steps (``show``: this rank prints), a bar or lines; :meth:`step` after every step."""

    def __init__(self, show: bool, bar: bool, every: int | None, total: int, start: int, log=print,
                 terminal: bool | None = None):
        terminal = sys.stderr.isatty() if terminal is None else terminal
        self.total, self.start, self.log = total, start, log
        self.bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True,
                        disable=not (show and bar and terminal))
        self.every = every if show and self.bar.disable else None
        self.began = time.perf_counter()
        self.window_positions, self.window_seconds = 0, 0.0

    def step(self, record: dict, tokens_seen: int) -> None:
        loss = "skipped" if record["loss"] is None else f"{record['loss']:.4f}"
        rl = {k: f"{record[k]:.{d}}" for k, d in (("reward_mean", 3), ("clip_fraction", 3), ("kl", "2e"))
              if k in record}
        self.window_positions += record["positions"]
        self.window_seconds += record["seconds"]
        if not self.bar.disable:
            self.bar.set_postfix(loss=loss, lr=f"{record['lr']:.2e}",
                                 pos_s=f"{record['positions'] / max(record['seconds'], 1e-9):.0f}",
                                 **{_SHORT[k]: v for k, v in rl.items()})
            self.bar.update(1)
            return
        step = record["step"]
        if self.every is None or not (step == self.start + 1 or step % self.every == 0 or step == self.total):
            return
        elapsed = time.perf_counter() - self.began
        eta = elapsed / (step - self.start) * (self.total - step)
        rate = self.window_positions / max(self.window_seconds, 1e-9)
        figures = "".join(f"{_SHORT[k]} {v}, " for k, v in rl.items())
        self.log(f"step {step}/{self.total} (epoch {record['epoch'] + 1}): loss {loss}, {figures}"
                 f"lr {record['lr']:.2e}, "
                 f"{rate:,.0f} positions/s, {tokens_seen:,} tokens seen, {clock(elapsed)} elapsed, "
                 f"ETA {clock(eta)}")
        self.window_positions, self.window_seconds = 0, 0.0

    def close(self) -> None:
        self.bar.close()


# grpo's figures in the progress line (packtrain.run.objective.Grpo: the step's reward, clip fraction and KL)
_SHORT = {"reward_mean": "reward", "clip_fraction": "clipped", "kl": "kl"}

