"""Why a run stopped before its end, and the exit code each reason gives (docs/operations.md, "Long runs").

A stop is not a crash: the message is one line, there is no traceback, and the exit code tells a scheduler what
to do next (0 and 1 are Python's own; 2 is a user error from the CLI; 3 is ``smoke`` running out of memory).
"""

from __future__ import annotations

NONFINITE_EXIT = 4  # the loss or gradient norm was NaN/inf: no update made; change the config before resuming
PREEMPTED_EXIT = 75  # SIGTERM/SIGINT: a checkpoint was written; `train --resume` continues (sysexits EX_TEMPFAIL)
STALLED_EXIT = 124  # no progress for ops.hang_timeout + ops.hang_abort seconds (like timeout(1)); resume


class RunStopped(RuntimeError):
    """A deliberate stop: the CLI prints the message (on rank 0) and exits with ``exit_code``."""

    exit_code = 1

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet  # another rank says the same: print nothing here


class Finished(RunStopped):
    """``--resume`` of a run that has trained all its steps: nothing to do, said in one line."""

    exit_code = 0


class NonFiniteError(RunStopped):
    exit_code = NONFINITE_EXIT


class Preempted(RunStopped):
    exit_code = PREEMPTED_EXIT


class Stalled(RunStopped):
    exit_code = STALLED_EXIT


class PeerLost(RunStopped):
    """A collective failed because another rank went away (killed, its machine lost): retryable, like a stall."""

    exit_code = STALLED_EXIT
