"""What the run prints around its steps (packtrain/run/header.py): the footer's before -> after lines (a resumed run's
step 0 read back from metrics.jsonl) and the memory savings' lines. The header itself reads a whole trainer: the
CLI tests of `train` check its lines."""

import json
from types import SimpleNamespace

from packtrain.memory.estimate import GiB
from packtrain.run.header import footer, savings_lines

OUTPUTS = ["adapter: RUN/adapter", "loss plot: RUN/loss.png"]


def _summary(**over):
    summary = {"eval_before": 2.5, "eval_after": 1.25, "eval_after_step": 12, "adapter": "RUN/adapter",
               "plot": "RUN/loss.png"}
    return summary | over


def test_the_footer_gives_each_figure_from_step_0_to_the_end_then_the_outputs(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    summary = _summary(reward_accuracy_before=0.5, reward_accuracy_after=0.75, task_before=0.125,
                       task_after=0.625, task_after_step=10)
    assert footer(summary, metrics) == ["eval loss: 2.5000 at step 0 -> 1.2500 at step 12",
                                        "reward accuracy: 0.50 at step 0 -> 0.75 at step 12",
                                        "task score: 0.1250 at step 0 -> 0.6250 at step 10",
                                        *OUTPUTS, f"metrics: {metrics}"]


def test_a_resumed_run_reads_step_0_back_from_metrics_jsonl(tmp_path):
    """The run resumed after step 0: its step-0 figures are the step-0 lines of their splits (a cut-off line and a
    later step's lines are passed over)."""
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"split": "eval", "step": 3, "loss": 9.0}, {"step": 0, "loss": 8.0},
             {"split": "eval", "step": 0, "loss": 3.0, "reward_accuracy": 0.25},
             {"split": "generate", "step": 0, "mean_score": 0.5}]
    metrics.write_text('{"split": "eval", "st\n' + "".join(json.dumps(x) + "\n" for x in lines))
    summary = _summary(eval_before=None, reward_accuracy_after=1.0, task_after=0.75, task_after_step=12)
    assert footer(summary, metrics)[:3] == ["eval loss: 3.0000 at step 0 -> 1.2500 at step 12",
                                            "reward accuracy: 0.25 at step 0 -> 1.00 at step 12",
                                            "task score: 0.5000 at step 0 -> 0.7500 at step 12"]


def test_a_figure_missing_at_either_end_has_no_line(tmp_path):
    """No eval data (nothing after), or a resumed run whose metrics.jsonl is gone (nothing before)."""
    metrics = tmp_path / "metrics.jsonl"
    assert footer(_summary(eval_after=None), metrics) == [*OUTPUTS, f"metrics: {metrics}"]
    assert footer(_summary(eval_before=None, task_after=0.5, task_after_step=3), metrics) == [
        *OUTPUTS, f"metrics: {metrics}"]


def _choice(warning, device="cuda"):
    chosen = SimpleNamespace(savings=SimpleNamespace(checkpointing=True, offload_layers=2, loss_rows=1024,
                                                     mlp_rows=0, norm_rows=512),
                             device_bytes=int(3.25 * GiB), peak_phase="backward", relative_cost=1.3125)
    return SimpleNamespace(chosen=chosen, layers=8, lines=lambda: ["-> candidate a", "   candidate b"],
                           warning=lambda: warning, budget=SimpleNamespace(device=device))


def test_the_savings_lines_give_the_chosen_estimate_each_candidate_and_a_warning_when_there_is_one():
    first = ("  memory: checkpointing, 2 of 8 layer inputs in host memory, loss in chunks of 1,024 rows, MLP whole, "
             "norms in tiles of 512 rows: about 3.2 GiB per GPU at the largest unit (the estimate, peak in "
             "backward), step cost 1.312 of the step without savings")
    assert savings_lines(_choice(None)) == [first, "  -> candidate a", "     candidate b"]
    assert savings_lines(_choice("warning: it does not fit"))[-1] == "  warning: it does not fit"
    # on the CPU the estimate is a rank's (its process's memory), there is no GPU
    assert savings_lines(_choice(None, "cpu"))[0] == first.replace("per GPU", "per rank")
