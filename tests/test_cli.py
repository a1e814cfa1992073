"""packtrain/cli.py on its own: the argument types ``whole`` and ``amount`` as tables, and ``main``'s one error policy
(a user error -> 2 in one line, a path -> 2 naming it, a stop -> its own code, a lost peer -> 124, Ctrl-C -> 130,
anything else a traceback) through a stand-in command, so no test here trains or loads a model. The real commands'
refusals through the CLI are tests/commands/*_cli.py's."""

import argparse
import ast
import errno
import importlib.util
import io
import logging
import sys
import types
import warnings
from pathlib import Path

import pytest

from packtrain import cli, exits, versions
from packtrain.exits import PeerLost, Preempted, RunStopped

# --- whole(low, high) and amount(unit, high) --------------------------------------------------------------------

# (low, high, text, value): accepted, the bounds included
WHOLE_ACCEPTED = [(1, 8, "1", 1), (1, 8, "8", 8), (1, 8, "3", 3), (0, 2**20, "0", 0), (-5, -1, "-5", -5)]
# (low, high, text, the refusal)
WHOLE_REFUSED = [(1, 8, "0", "must be from 1 to 8, got 0"), (1, 8, "9", "must be from 1 to 8, got 9"),
                 (1, 2**20, "-2", "must be from 1 to 1,048,576, got -2"),
                 (1, 2**20, "1048577", "must be from 1 to 1,048,576, got 1048577"),
                 (1, 8, "1.5", "expected a whole number, got '1.5'"), (1, 8, "2.0", "expected a whole number, got '2.0'"),
                 (1, 8, "1e3", "expected a whole number, got '1e3'"), (1, 8, "", "expected a whole number, got ''"),
                 (1, 8, "four", "expected a whole number, got 'four'"), (1, 8, "0x4", "expected a whole number, got '0x4'")]


@pytest.mark.parametrize("low, high, text, value", WHOLE_ACCEPTED)
def test_whole_accepts_a_whole_number_within_its_bounds(low, high, text, value):
    got = cli.whole(low, high)(text)
    assert got == value and type(got) is int


@pytest.mark.parametrize("low, high, text, message", WHOLE_REFUSED)
def test_whole_refuses_naming_what_it_got(low, high, text, message):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        cli.whole(low, high)(text)
    assert str(e.value) == message


AMOUNT_ACCEPTED = [("80", 80.0), ("1e-300", 1e-300), ("0.5", 0.5), ("1024", 1024.0), ("1.5e2", 150.0)]
AMOUNT_REFUSED = [*((text, f"must be a finite number of GiB above 0 and at most 1,024, got {text}")
                    for text in ("0", "-0", "-1", "nan", "NaN", "inf", "-inf", "1e400", "1024.0001")),
                  ("lots", "expected a number of GiB, got 'lots'"), ("", "expected a number of GiB, got ''"),
                  ("80GiB", "expected a number of GiB, got '80GiB'")]


@pytest.mark.parametrize("text, value", AMOUNT_ACCEPTED)
def test_amount_accepts_a_finite_number_above_0_up_to_its_bound(text, value):
    got = cli.amount("GiB", 1024)(text)
    assert got == value and type(got) is float


@pytest.mark.parametrize("text, message", AMOUNT_REFUSED)
def test_amount_refuses_zero_negatives_nan_inf_and_words(text, message):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        cli.amount("GiB", 1024)(text)
    assert str(e.value) == message


def test_amount_is_finite_even_without_a_bound():
    unbounded = cli.amount("TFLOP/s", float("inf"))
    assert unbounded("1e300") == 1e300
    for text in ("inf", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"must be a finite number of TFLOP/s above 0 .*got {text}"):
            unbounded(text)


def test_a_refused_flag_exits_2_naming_it_before_any_work(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_check_versions", lambda command: pytest.fail("ran before the flags were read"))
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "run.yaml", "--world-size", "0"])
    assert e.value.code == 2
    assert "packtrain plan: error: argument --world-size: must be from 1 to 1,048,576, got 0" in capsys.readouterr().err


# --- the parser's shape -------------------------------------------------------------------------------------------


def _subcommands() -> dict:
    action = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_subcommand_has_a_function_in_its_module():
    """COMMANDS and the subparsers name the same commands, and each entry's function is defined in its module (read,
    not imported: importing train would load transformers)."""
    assert set(_subcommands()) == set(cli.COMMANDS)
    for command, (module, name) in cli.COMMANDS.items():
        source = Path(importlib.util.find_spec(module).origin).read_text()
        defined = {n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
        assert name in defined, (command, module, name)


def test_a_command_is_required_and_version_names_the_package(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2 and "the following arguments are required: command" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"packtrain {cli._version()}\n"


def test_the_version_falls_back_to_the_installed_metadata(monkeypatch):
    import importlib.metadata

    import packtrain

    assert cli._version() == packtrain.__version__
    monkeypatch.delattr(packtrain, "__version__")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: f"{name} 9.9")
    assert cli._version() == "packtrain 9.9"

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert cli._version() == "unknown (not installed)"


# --- main's error policy ------------------------------------------------------------------------------------------


def _main(monkeypatch, capsys, run, *argv) -> tuple[int, str, str]:
    """``cli.main(["plan", "run.yaml", *argv])`` with plan's function replaced by ``run(args)``; versions pass."""
    fake = types.ModuleType("fake_command")
    fake.run = run
    monkeypatch.setitem(sys.modules, "fake_command", fake)
    monkeypatch.setitem(cli.COMMANDS, "plan", ("fake_command", "run"))
    monkeypatch.setattr(versions, "check_versions", list)  # nothing found
    code = cli.main(["plan", "run.yaml", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _raising(error: BaseException):
    def run(args):
        print("started")
        raise error

    return run


def test_main_returns_what_the_command_returns_with_its_arguments(monkeypatch, capsys):
    seen = []
    code, out, err = _main(monkeypatch, capsys, lambda args: seen.append(args) or 7, "--set", "a.b=1", "--set", "c=2")
    assert (code, out, err) == (7, "", "")
    assert (seen[0].command, seen[0].config, seen[0].overrides) == ("plan", "run.yaml", ["a.b=1", "c=2"])


@pytest.mark.parametrize("error", [ValueError("data.train: no such file"),
                                   versions.UntestedVersionError(["peft 0.1.0 is outside the tested range"])],
                         ids=["ValueError", "a ValueError subclass"])
def test_a_user_error_exits_2_in_one_line(monkeypatch, capsys, error):
    code, out, err = _main(monkeypatch, capsys, _raising(error))
    assert (code, out, err) == (2, "started\n", f"packtrain plan: error: {error}\n")


OS_ERRORS = [
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/train.jsonl"),
     "packtrain plan: error: /data/train.jsonl: No such file or directory (FileNotFoundError)\n"),
    (PermissionError(errno.EACCES, "Permission denied", "/runs/out"),
     "packtrain plan: error: /runs/out: Permission denied (PermissionError)\n"),
    (OSError(errno.ENOSPC, "No space left on device"), "packtrain plan: error: No space left on device (OSError)\n"),
    (OSError("the socket went away"), "packtrain plan: error: the socket went away (OSError)\n"),
]


@pytest.mark.parametrize("error, line", OS_ERRORS, ids=["missing file", "permission", "no file named", "no errno"])
def test_an_os_error_exits_2_in_one_line_naming_the_path(monkeypatch, capsys, error, line):
    code, _, err = _main(monkeypatch, capsys, _raising(error))
    assert (code, err) == (2, line)


STOPS = [exits.Finished, exits.NonFiniteError, Preempted, exits.Stalled, PeerLost, RunStopped]


@pytest.mark.parametrize("stop", STOPS, ids=[s.__name__ for s in STOPS])
def test_a_stop_exits_with_its_own_code_in_one_line(monkeypatch, capsys, stop):
    code, _, err = _main(monkeypatch, capsys, _raising(stop("stopped at step 3")))
    assert (code, err) == (stop.exit_code, "packtrain plan: stopped at step 3\n")


def test_a_quiet_stop_prints_nothing(monkeypatch, capsys):
    code, _, err = _main(monkeypatch, capsys, _raising(Preempted("rank 0 says it", quiet=True)))
    assert (code, err) == (75, "")


def _lost_peer_module(monkeypatch, answer):
    seen = []
    monkeypatch.setitem(sys.modules, "packtrain.distributed",
                        types.SimpleNamespace(lost_peer=lambda e: seen.append(e) or answer))
    return seen


def test_a_lost_peer_exits_124_in_one_line(monkeypatch, capsys):
    seen = _lost_peer_module(monkeypatch, "rank 1 on machine 0 stopped answering")
    error = RuntimeError("Connection closed by peer [10.0.0.2]:4242")
    code, _, err = _main(monkeypatch, capsys, _raising(error))
    assert seen == [error]
    assert code == 124
    assert err == "packtrain plan: rank 1 on machine 0 stopped answering; run it again on every machine (exit 124)\n"


def test_a_stop_is_not_taken_for_a_lost_peer(monkeypatch, capsys):
    """RunStopped is a RuntimeError: it keeps its own code even where a lost peer would be found."""
    _lost_peer_module(monkeypatch, "rank 1 on machine 0 stopped answering")
    code, _, err = _main(monkeypatch, capsys, _raising(Preempted("checkpoint written")))
    assert (code, err) == (75, "packtrain plan: checkpoint written\n")


@pytest.mark.parametrize("distributed", ["absent", "no peer lost"])
def test_any_other_runtime_error_is_a_traceback(monkeypatch, capsys, distributed):
    if distributed == "absent":  # no command started ranks: no peers to lose
        monkeypatch.delitem(sys.modules, "packtrain.distributed", raising=False)
    else:
        _lost_peer_module(monkeypatch, None)
    error = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError) as e:
        _main(monkeypatch, capsys, _raising(error))
    assert e.value is error


@pytest.mark.parametrize("error", [TypeError("a bug"), KeyError("a bug"), AssertionError("an invariant")])
def test_a_bug_is_a_traceback(monkeypatch, capsys, error):
    with pytest.raises(type(error)) as e:
        _main(monkeypatch, capsys, _raising(error))
    assert e.value is error


def test_ctrl_c_before_training_exits_130_in_one_line(monkeypatch, capsys):
    code, _, err = _main(monkeypatch, capsys, _raising(KeyboardInterrupt()))
    assert (code, err) == (130, "packtrain plan: interrupted\n")


def test_an_untested_version_is_refused_before_the_command_runs(monkeypatch, capsys):
    ran = []
    fake = types.ModuleType("fake_command")
    fake.run = lambda args: ran.append(args) or 0
    monkeypatch.setitem(sys.modules, "fake_command", fake)
    monkeypatch.setitem(cli.COMMANDS, "plan", ("fake_command", "run"))

    def refuse():
        raise versions.UntestedVersionError(["torch 1.0 is outside"])

    monkeypatch.setattr(versions, "check_versions", refuse)
    assert cli.main(["plan", "run.yaml"]) == 2 and ran == []
    assert capsys.readouterr().err.startswith("packtrain plan: error: torch 1.0 is outside: packtrain is tested only")


def test_stdout_is_line_buffered_for_a_log_file(monkeypatch, capsys):
    log = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", log)
    assert _main(monkeypatch, capsys, lambda args: print("step 1") or 0)[0] == 0
    assert log.line_buffering and log.buffer.getvalue() == b"step 1\n"  # written at the newline, not at a flush


# --- which commands check versions before any work ----------------------------------------------------------------

# (command, WORLD_SIZE, checked here): under a launcher the collective commands check together once the ranks are up;
# check-nodes and dump-stacks show the versions instead
VERSION_CHECKS = [("plan", None, True), ("plan", "4", True), ("export", "8", True), ("train", None, True),
                  ("train", "1", True), ("train", "", True), ("train", "2", False), ("eval", "2", False),
                  ("smoke", "2", False), ("pretune-fla", "2", False), ("bench", "2", False), ("bench", "1", True),
                  ("check-nodes", None, False), ("check-nodes", "2", False), ("dump-stacks", None, False)]


@pytest.mark.parametrize("command, world, checked", VERSION_CHECKS)
def test_which_commands_refuse_an_untested_version_at_start(monkeypatch, command, world, checked):
    calls = []
    monkeypatch.setattr(versions, "check_versions", lambda: calls.append(command))
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    cli._check_versions(command)
    assert calls == ([command] if checked else [])


def test_every_command_is_placed_for_the_version_check():
    """A new command is either checked at start alone, collective, or shows the versions: none falls in two."""
    assert not set(cli.COLLECTIVE) & set(cli.VERSIONS_SHOWN)
    assert set(cli.COLLECTIVE) | set(cli.VERSIONS_SHOWN) <= set(cli.COMMANDS)


# --- library noise ------------------------------------------------------------------------------------------------

FALLBACK = "The fast path is not available: falling back to its reference PyTorch implementation"


@pytest.fixture
def transformers_logging(monkeypatch):
    """transformers' root logger, its handlers' filters and its progress bar put back after the test."""
    from transformers.utils import logging as hf_logging

    root = logging.getLogger("transformers")
    kept = [(x, list(x.filters)) for x in (root, *root.handlers, *logging.getLogger().handlers)]
    bar = hf_logging.is_progress_bar_enabled()
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    with warnings.catch_warnings():
        yield root
    for x, filters in kept:
        x.filters[:] = filters
    (hf_logging.enable_progress_bar if bar else hf_logging.disable_progress_bar)()


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("transformers.models.qwen3_5", logging.WARNING, __file__, 1, message, None, None)


def test_a_model_command_drops_the_unpacked_kernels_fallback_notice(transformers_logging):
    from transformers.utils import logging as hf_logging

    cli._quiet_library_noise("train")
    root = transformers_logging
    assert not root.filter(_record(FALLBACK)) and root.filter(_record("something else"))
    for handler in root.handlers:  # what a child logger propagates is filtered at the handler
        assert not handler.filter(_record(FALLBACK)) and handler.filter(_record("something else"))
    assert not hf_logging.is_progress_bar_enabled()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        cli._quiet_library_noise("train")
        warnings.warn("Triton is not supported on current platform, roll back to CPU.")
        warnings.warn("something else")
    assert [str(w.message) for w in caught] == ["something else"]


def test_plan_leaves_transformers_logging_alone(transformers_logging):
    import os

    root = transformers_logging
    before = [list(x.filters) for x in (root, *root.handlers)]
    cli._quiet_library_noise("plan")
    assert [list(x.filters) for x in (root, *root.handlers)] == before
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"


def test_a_world_size_that_is_no_number_is_refused_naming_it(monkeypatch, capsys):
    from packtrain.cli import main

    monkeypatch.setenv("WORLD_SIZE", "x")
    assert main(["train", "nowhere.yaml"]) == 2
    assert capsys.readouterr().err.strip() == ("packtrain train: error: WORLD_SIZE: expected a whole number of ranks "
                                               "(the launcher sets it), got 'x'")
