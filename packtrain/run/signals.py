"""SIGTERM and SIGINT end a run at the next step boundary with a checkpoint, instead of killing it mid-step.

Why: a scheduler sends SIGTERM before it preempts a job (torchrun forwards it to every rank and sends SIGKILL 30 s
later by default); the default action exits 143 at once and loses everything since the last checkpoint, and
SIGINT raised a KeyboardInterrupt traceback. Here a signal only sets a flag. The trainer folds the flag into the
one all-reduce each step makes (:mod:`packtrain.run.finite`), so when any rank has been signalled every rank agrees
at the same step, writes the checkpoint with every rank taking part, and exits
:data:`~packtrain.exits.PREEMPTED_EXIT`. A second signal changes nothing (a scheduler and torchrun may both send
one); SIGKILL still ends the process at once. The first signal is acknowledged at once on stderr (rank 0), since
the step it waits for can take a minute.

The handlers are installed when the trainer starts, so a signal at any moment gives exit 75: one during setup
(model load, resume) stops before the first step without a save (nothing was trained since the last checkpoint).
"""

from __future__ import annotations

import os
import signal

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """``requested``: a signal has come (the flag the step folds into its boundary's agreement)."""

    def __init__(self, announce: bool = True):
        self.announce = announce  # say at once that the signal was heard (rank 0: a terminal's Ctrl-C reaches all)
        self.received: int | None = None
        self.requested = False
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            self.requested = True
            if self.announce:  # os.write: a print could re-enter a write the signal interrupted
                os.write(2, f"packtrain: {signal.Signals(signum).name} received: stopping after the step that is "
                            "running, with a checkpoint (a second signal changes nothing; SIGKILL ends it at "
                            "once)\n".encode())

    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a signal on another rank"

    def restore(self) -> None:
        """Put the previous handlers back (a finished run, or an in-process caller such as a test)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
