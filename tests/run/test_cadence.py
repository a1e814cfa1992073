"""The run's cadence (packtrain.run.cadence): when each evaluation and checkpoint is due, what a stopped run's
checkpoint owes, and that a run stopped anywhere and resumed evaluates and saves at the steps the uninterrupted run
does. Expected steps are written from the rules in docs/operations.md, not from the components."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from packtrain.exits import NonFiniteError
from packtrain.run import cadence
from packtrain.run.cadence import Cadence, Checkpoints, Evaluation, Generation
from packtrain.run.objective import Dpo, Sft


class CountedEval(Evaluation):
    def __init__(self, steps_per_epoch, every):
        super().__init__(None, None, None, None, None, steps_per_epoch, every)
        self.ran = []

    def measure(self, step):
        self.ran.append(step)
        return step / 10


class CountedGeneration(Generation):
    def __init__(self, every):
        super().__init__(None, None, None, None, Path("out"), every)
        self.ran = []

    def measure(self, step):
        self.ran.append(step)
        return step / 100


class CountedCheckpoints(Checkpoints):
    def __init__(self, every, total):
        super().__init__(Path("out"), every, total, None, (None,) * 5, lambda: {}, None, None, None)
        self.saved = []

    def save(self, step):
        self.saved.append(step)
        self.last = Path("out/checkpoints") / f"step-{step}"
        return self.last


def _cadence(total, per_epoch, eval_every, generate_every, save_every, evaluations=("eval", "generate")):
    parts = []
    if "eval" in evaluations:
        parts.append(CountedEval(per_epoch, eval_every))
    if "generate" in evaluations:
        parts.append(CountedGeneration(generate_every))
    return Cadence(parts, CountedCheckpoints(save_every, total))


def _run(c: Cadence, first: int, total: int, stop_after: int | None = None) -> list[str] | None:
    """The trainer's loop (packtrain.run.trainer.Trainer._train) over steps first+1..total; stopped after step
    ``stop_after``: its checkpoint, and what its state.json owes."""
    c.start(first)
    for step in range(first + 1, total + 1):
        if step == stop_after:
            c.checkpoints.stopping(step)
            return c.owed(step)
        c.after(step)
    c.end(total)
    return None


def _expected(total, per_epoch, eval_every, generate_every, save_every):
    evals = {0, total} | {s for s in range(1, total + 1) if s % per_epoch == 0 or (eval_every and s % eval_every == 0)}
    gens = {0, total} | {s for s in range(1, total + 1) if s % generate_every == 0}
    saves = {s for s in range(1, total) if s % save_every == 0}
    return sorted(evals), sorted(gens), sorted(saves)


CASES = [  # total steps, steps per epoch, train.eval_every, generate.every, train.save_every
    (12, 4, None, 5, 3),
    (13, 4, 3, 2, 4),  # max_steps mid-epoch: the last evaluation after step 13
    (10, 10, None, 10, 10),  # everything falls on the last step: once each, no checkpoint
    (7, 3, 2, 7, 1),
]


@pytest.mark.parametrize("total,per_epoch,eval_every,generate_every,save_every", CASES)
def test_an_uninterrupted_run_evaluates_and_saves_at_the_documented_steps(total, per_epoch, eval_every,
                                                                          generate_every, save_every):
    c = _cadence(total, per_epoch, eval_every, generate_every, save_every)
    assert _run(c, 0, total) is None
    ev, gen = c.evaluations
    evals, gens, saves = _expected(total, per_epoch, eval_every, generate_every, save_every)
    assert ev.ran == evals and gen.ran == gens and c.checkpoints.saved == saves
    assert (ev.first, ev.last, ev.last_step) == (0.0, total / 10, total)
    assert (gen.first, gen.last, gen.last_step) == (0.0, total / 100, total)


@pytest.mark.parametrize("total,per_epoch,eval_every,generate_every,save_every", CASES)
def test_a_run_stopped_after_any_step_and_resumed_evaluates_as_the_uninterrupted_run(total, per_epoch, eval_every,
                                                                                     generate_every, save_every):
    evals, gens, saves = _expected(total, per_epoch, eval_every, generate_every, save_every)
    for stop in range(1, total):
        first = _cadence(total, per_epoch, eval_every, generate_every, save_every)
        owed = _run(first, 0, total, stop_after=stop)
        assert owed == [name for name, steps in (("eval", evals), ("generate", gens)) if stop in steps]
        assert first.checkpoints.saved == [s for s in saves if s < stop] + [stop]
        resumed = _cadence(total, per_epoch, eval_every, generate_every, save_every)
        resumed.resume(owed, first.checkpoints.last)
        assert _run(resumed, stop, total) is None
        for a, b, steps in zip(first.evaluations, resumed.evaluations, (evals, gens)):
            assert a.ran + b.ran == steps, (stop, a.name, a.ran, b.ran)
        assert resumed.checkpoints.saved == [s for s in saves if s > stop]
        ev = resumed.evaluations[0]
        assert ev.first is None and ev.last_step == total  # step 0's loss is the first run's


def test_a_run_stopped_again_as_it_resumes_keeps_the_checkpoint_it_resumed_from():
    c = _cadence(10, 5, None, 5, 3)
    c.resume(["eval"], Path("out/checkpoints/step-5"))
    assert c.checkpoints.stopping(5) == Path("out/checkpoints/step-5") and c.checkpoints.saved == []
    assert c.owed(5) == ["eval", "generate"]  # nothing ran: what it owed it still owes (and more: 5 % 5 == 0)
    assert c.checkpoints.stopping(6) == Path("out/checkpoints/step-6") and c.checkpoints.saved == [6]


def test_resume_owes_only_the_evaluations_the_run_still_has():
    """data.eval or generate.every removed since (allowed changes): the owed evaluation has nothing to run on."""
    c = _cadence(10, 5, None, 4, 3, evaluations=("generate",))
    c.resume(["eval", "generate", "something else"], Path("out/checkpoints/step-3"))
    c.start(3)
    assert c.evaluations[0].ran == [3] and c.get("eval") is None
    c.after(4)
    assert c.evaluations[0].ran == [3, 4] and c.checkpoints.saved == []
    c2 = _cadence(10, 5, None, 4, 3)
    c2.resume([], Path("out/checkpoints/step-3"))
    c2.start(3)  # owed nothing: nothing runs before step 4
    assert [e.ran for e in c2.evaluations] == [[], []]


def test_an_evaluation_runs_once_per_step():
    ev = CountedEval(4, 2)
    assert ev.due(4) and ev.due(2) and not ev.due(3)
    ev.run(4)
    assert not ev.due(4) and not ev.ending(4) and ev.ending(5)


class Lines:
    def __init__(self):
        self.lines = []

    def write(self, record):
        self.lines.append(record)


def _records():
    info = SimpleNamespace(is_main=True, rank=0, world_size=1, enabled=False)
    metrics, done, beats = Lines(), [], []
    ops = SimpleNamespace(eval_done=done.append, progress=beats.append)
    return cadence.Records(metrics, ops, info, progress=False), metrics, done


def test_an_evaluation_writes_its_metrics_line_and_refuses_a_diverged_model(monkeypatch):
    records, metrics, done = _records()
    rows = [{"id": "a", "loss": 1.0, "target_tokens": 2}, {"id": "b", "loss": 2.0, "target_tokens": 3}]
    monkeypatch.setattr(cadence, "evaluate", lambda *a, **k: rows)
    ev = Evaluation(None, None, None, SimpleNamespace(objective=Sft()), records, 4, None)
    assert ev.run(8) == 1.5
    assert metrics.lines == done == [{"split": "eval", "step": 8, "loss": 1.5, "examples": 2}]
    rows[0] = {"id": "a", "loss": float("nan"), "target_tokens": 2}
    with pytest.raises(NonFiniteError, match="eval at step 12: loss nan"):
        ev.run(12)
    assert len(metrics.lines) == 1 and ev.last_step == 8


def test_an_evaluation_on_pairs_writes_the_reward_figures_and_evaluates_the_reference_once(monkeypatch):
    """Under dpo the metrics line has the DPO loss, pairs, reward accuracy and margin; the reference of data.eval (the
    base model, unchanged by training) is computed at the first evaluation only."""
    records, metrics, _ = _records()
    examples = [SimpleNamespace(id=f"a:{s}", pair="a", side=s, weight=1.0) for s in ("chosen", "rejected")]
    policy = {"a:chosen": -2.0, "a:rejected": -5.0}  # the policy prefers chosen by 3 nats, the reference by 1
    monkeypatch.setattr(cadence, "evaluate", lambda *a, **k: [{"id": i, "loss": -v / 2, "target_tokens": 2}
                                                              for i, v in policy.items()])
    computed = []
    monkeypatch.setattr(cadence.reference, "compute",
                        lambda *a, **k: computed.append(1) or {"a:chosen": -3.0, "a:rejected": -4.0})
    ev = Evaluation(None, None, examples, SimpleNamespace(objective=Dpo(0.5)), records, 4, None)
    margin = 0.5 * ((-2.0 + 3.0) - (-5.0 + 4.0))
    assert ev.run(0) == pytest.approx(math.log1p(math.exp(-margin)))
    policy["a:chosen"] = -6.0  # now the policy prefers rejected: margin 0.5 * ((-6 + 3) - (-5 + 4)) = -1
    ev.run(4)
    assert computed == [1]
    first, last = metrics.lines
    assert (first["pairs"], first["reward_accuracy"], first["reward_margin"]) == (1, 1.0, pytest.approx(margin))
    assert (last["step"], last["reward_accuracy"], last["reward_margin"]) == (4, 0.0, pytest.approx(-1.0))
    assert ev.first_record == first and ev.record == last
