"""A run's step lines: a bar on a terminal only, elsewhere a plain line at the first step, every N and the last."""

import pytest

from packtrain.run.progress import Progress, clock


def _record(step: int, positions: int = 100, seconds: float = 0.5) -> dict:
    return {"step": step, "epoch": (step - 1) // 4, "loss": 1.0 / step, "lr": 1e-3, "positions": positions,
            "seconds": seconds}


def _lines(total: int, start: int = 0, every: int | None = 5, show: bool = True, bar: bool = True,
           terminal: bool = False) -> list[str]:
    out = []
    progress = Progress(show, bar, every, total, start, log=out.append, terminal=terminal)
    seen = 0
    for step in range(start + 1, total + 1):
        seen += 100
        progress.step(_record(step), seen)
    progress.close()
    return out


def test_lines_fall_on_the_first_step_every_n_and_the_last():
    lines = _lines(12)
    assert [line.split()[1] for line in lines] == ["1/12", "5/12", "10/12", "12/12"]
    assert lines[1].startswith("step 5/12 (epoch 2): loss 0.2000, lr 1.00e-03, 200 positions/s, 500 tokens seen")
    assert "ETA 0:00:00" in lines[-1]


def test_a_resumed_run_starts_its_lines_at_its_first_step():
    assert [line.split()[1] for line in _lines(12, start=6)] == ["7/12", "10/12", "12/12"]


@pytest.mark.parametrize("terminal,bar,expected", [(True, True, 0), (True, False, 4), (False, True, 4)])
def test_the_bar_only_on_a_terminal_and_lines_without_it(terminal, bar, expected):
    assert len(_lines(12, bar=bar, terminal=terminal)) == expected


def test_other_ranks_and_every_null_print_nothing():
    assert _lines(12, show=False) == [] and _lines(12, every=None) == []


def test_positions_per_second_are_over_the_steps_since_the_last_line():
    out = []
    progress = Progress(True, False, 2, 4, 0, log=out.append, terminal=False)
    for step, (positions, seconds) in enumerate([(100, 1.0), (300, 1.0), (50, 0.5), (950, 0.5)], start=1):
        progress.step(_record(step, positions, seconds), 0)
    assert [line.split(", ")[2] for line in out] == ["100 positions/s", "300 positions/s", "1,000 positions/s"]


def test_clock_reads_hours_past_a_day():
    assert clock(75) == "0:01:15" and clock(30 * 3600 + 61) == "30:01:01"
