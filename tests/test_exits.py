"""packtrain/exits.py: each deliberate stop as a literal table of its exit code, and what the CLI relies on of a
stop (its message, ``quiet``, and that it is no ``ValueError``, which ``cli.main`` would turn into exit 2)."""

import os

import pytest

from packtrain import exits
from packtrain.exits import (
    NONFINITE_EXIT,
    PREEMPTED_EXIT,
    STALLED_EXIT,
    Finished,
    NonFiniteError,
    PeerLost,
    Preempted,
    RunStopped,
    Stalled,
)

# (stop, its exit code): what a scheduler reads to decide what to do next
EXIT_CODES = [(RunStopped, 1), (Finished, 0), (NonFiniteError, 4), (Preempted, 75), (Stalled, 124), (PeerLost, 124)]
# the codes cli.main and the commands give besides the stops: a user error, smoke out of memory, Ctrl-C
OTHER_EXITS = {2: "user error", 3: "smoke out of memory", 130: "interrupted"}


def _all_stops(cls=RunStopped) -> set:
    return {cls}.union(*(_all_stops(sub) for sub in cls.__subclasses__()))


def test_the_constants():
    assert (NONFINITE_EXIT, PREEMPTED_EXIT, STALLED_EXIT) == (4, 75, 124)
    assert PREEMPTED_EXIT == os.EX_TEMPFAIL  # sysexits: "try again later"


@pytest.mark.parametrize("stop, code", EXIT_CODES, ids=[s.__name__ for s, _ in EXIT_CODES])
def test_each_stop_exits_with_its_code(stop, code):
    assert stop.exit_code == code
    assert stop("why").exit_code == code  # a class attribute: every instance gives it


def test_the_table_lists_every_stop_of_the_module():
    """A new stop in exits.py needs a row above (and a decision about its code)."""
    defined = {v for v in vars(exits).values() if isinstance(v, type) and issubclass(v, RunStopped)}
    assert defined == {stop for stop, _ in EXIT_CODES}
    assert defined <= _all_stops()


def test_no_stop_exits_with_a_code_that_means_something_else():
    for stop in _all_stops():
        assert 0 <= stop.exit_code <= 255, stop  # an exit status is one byte
        assert stop.exit_code not in OTHER_EXITS, (stop, OTHER_EXITS[stop.exit_code])


def test_the_retryable_stops_share_the_stall_code_and_nothing_else_does():
    """A lost peer is retried like a stall; a non-finite loss must not be (resuming repeats it)."""
    retry = {stop for stop in _all_stops() if stop.exit_code == STALLED_EXIT}
    assert retry == {Stalled, PeerLost}
    codes = [stop.exit_code for stop in _all_stops() - retry]
    assert len(codes) == len(set(codes))  # each other stop tells its own reason


@pytest.mark.parametrize("stop", [s for s, _ in EXIT_CODES], ids=[s.__name__ for s, _ in EXIT_CODES])
def test_a_stop_is_a_runtime_error_and_never_a_value_error(stop):
    # cli.main catches ValueError (exit 2) before RunStopped: a stop that were a ValueError would lose its code
    assert issubclass(stop, RunStopped) and issubclass(stop, RuntimeError)
    assert not issubclass(stop, (ValueError, OSError, KeyboardInterrupt))


@pytest.mark.parametrize("stop", [s for s, _ in EXIT_CODES], ids=[s.__name__ for s, _ in EXIT_CODES])
def test_the_message_is_the_one_line_printed_and_quiet_is_off_unless_asked(stop):
    e = stop("rank 1 stopped at step 7")
    assert str(e) == "rank 1 stopped at step 7" and e.args == ("rank 1 stopped at step 7",)
    assert e.quiet is False
    assert stop("same", quiet=True).quiet is True
    assert stop("same", True).quiet is True


def test_raising_and_catching_keep_the_code():
    with pytest.raises(RunStopped) as caught:
        raise Preempted("checkpoint written at step 3", quiet=True)
    assert (caught.value.exit_code, caught.value.quiet, str(caught.value)) == (75, True, "checkpoint written at step 3")
