"""`packtrain train` and `packtrain eval` on preference pairs (train.objective dpo) and weighted examples: the eval
metrics lines, the terminal lines and the footer; `eval`'s per-pair rows agree with the run's last evaluation;
`eval --generate` generates each pair's answer once and scores it against the chosen answer."""

import json
from pathlib import Path

from cli_helpers import RULEBOOKS, run_in_process, write_config

WORDS = ["red", "blue", "green", "red blue"]


def _pairs(path, n=2, offset=0, weights=False):
    lines = []
    for r, system in enumerate(RULEBOOKS):
        for i in range(n):
            w = WORDS[(i + offset + r) % len(WORDS)]
            row = {"id": f"r{r}-{i + offset}", "system": system, "item": f"Colour: {w}",
                   "chosen": f"code for {w} under rulebook {'ABC'[r]}", "rejected": f"code for {w} under rulebook Z"}
            if weights:
                row = {"id": row["id"], "system": system, "item": row["item"], "target": row["chosen"],
                       "weight": [1.0, -0.5, 2.0][(r + i) % 3]}
            lines.append(row)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_dpo_training_reports_reward_accuracy_and_eval_rows_per_pair(tmp_path):
    cfg = write_config(tmp_path, data={"train": str(_pairs(tmp_path / "p_train.jsonl")),
                                       "eval": str(_pairs(tmp_path / "p_eval.jsonl", 1, 2))},
                       packing={"mode": "tree", "token_budget": 400, "max_continuations": 4},
                       train={"objective": "dpo", "dpo_beta": 0.5, "epochs": 1, "packs_per_step": 1},
                       generate={"max_new_tokens": 4}, optim={"lr": 1e-2})
    proc = run_in_process("train", cfg)
    evals = [r for r in _read(tmp_path / "run/metrics.jsonl") if r.get("split") == "eval"]
    assert [r["step"] for r in evals] == [0, 3]  # 3 packs, one a step: step 0 and the end
    for r in evals:
        assert r["pairs"] == 3 and r["examples"] == 6 and 0 <= r["reward_accuracy"] <= 1
        assert {"loss", "reward_margin"} <= set(r)
        assert (f"eval  step {r['step']}: dpo loss {r['loss']:.4f}, reward accuracy {r['reward_accuracy']:.2f}"
                in proc.stdout)
    first, last = evals
    assert (f"reward accuracy: {first['reward_accuracy']:.2f} at step 0 -> {last['reward_accuracy']:.2f} at step "
            f"{last['step']}") in proc.stdout
    assert f"eval loss: {first['loss']:.4f} at step 0 -> {last['loss']:.4f}" in proc.stdout

    out = tmp_path / "pairs.jsonl"
    printed = run_in_process("eval", cfg, "--adapter", tmp_path / "run/adapter", "--out", out).stdout
    rows = _read(out)
    assert [r["id"] for r in rows] == ["r0-2", "r1-2", "r2-2"]
    for r in rows:
        assert (r["chosen"], r["rejected"]) == (f"{r['id']}:chosen", f"{r['id']}:rejected")
        assert abs(r["policy_margin"] - (r["policy_chosen"] - r["policy_rejected"])) < 1e-12
        assert abs(r["reference_margin"] - (r["reference_chosen"] - r["reference_rejected"])) < 1e-12
        assert abs(r["reward_margin"] - 0.5 * (r["policy_margin"] - r["reference_margin"])) < 1e-12
        assert r["correct"] == (r["reward_margin"] > 0)
    # the eval command on the final adapter is the run's last evaluation (float64: to rounding)
    assert abs(sum(r["loss"] for r in rows) / 3 - last["loss"]) < 1e-9
    assert sum(r["correct"] for r in rows) / 3 == last["reward_accuracy"]
    assert abs(sum(r["reward_margin"] for r in rows) / 3 - last["reward_margin"]) < 1e-9
    assert "objective dpo: dpo loss" in printed and "over 3 pairs" in printed

    generated = tmp_path / "gen.jsonl"
    run_in_process("eval", cfg, "--adapter", tmp_path / "run/adapter", "--out", generated, "--generate")
    gen = [r for r in _read(generated) if "id" in r]
    assert [r["id"] for r in gen] == ["r0-2:chosen", "r1-2:chosen", "r2-2:chosen"]
    assert all(r["target"].endswith(f"code for {w} under rulebook {b}")  # after the template's think block
               for r, w, b in zip(gen, ["green", "red blue", "red"], "ABC", strict=True))


def test_weighted_eval_reports_the_weighted_loss(tmp_path):
    cfg = write_config(tmp_path, data={"train": str(_pairs(tmp_path / "p_train.jsonl", weights=True)),
                                       "eval": str(_pairs(tmp_path / "p_eval.jsonl", 1, 2, weights=True))},
                       train={"objective": "weighted", "max_steps": 1})
    proc = run_in_process("train", cfg)
    evals = [r for r in _read(tmp_path / "run/metrics.jsonl") if r.get("split") == "eval"]
    out = tmp_path / "rows.jsonl"
    run_in_process("eval", cfg, "--adapter", tmp_path / "run/adapter", "--out", out)
    rows = _read(out)
    assert [r["weight"] for r in rows] == [1.0, -0.5, 2.0]
    weighted = sum(r["weight"] * r["loss"] for r in rows) / 3
    assert abs(evals[-1]["weighted_loss"] - weighted) < 1e-9
    assert abs(evals[-1]["loss"] - sum(r["loss"] for r in rows) / 3) < 1e-9
    assert f"(weighted {evals[-1]['weighted_loss']:.4f}) over 3 examples" in proc.stdout


def _weighted_data(tmp_path, weight_of) -> Path:
    from cli_helpers import write_text_data

    path = write_text_data(tmp_path / "weighted.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "weight": weight_of(r["id"])}) + "\n" for r in rows))
    return path


def test_a_first_step_whose_weights_are_all_0_trains_on(tmp_path):
    """train.objective weighted, every example of step 1's packs weighing 0 (a group whose advantages are all 0, in
    RL): step 1 is a zero update (loss 0, no gradient), not a cut-off adapter; the run trains on and checks that the
    loss reaches the adapters at step 2, the first step with a weight. Data whose every weight is 0 is refused at
    load in one line, for weighted and dpo."""
    from packtrain.config import load_config
    from packtrain.run.balance import StepPlan
    from packtrain.run.session import open_session

    data = _weighted_data(tmp_path, lambda _: 1.0)
    cfg = write_config(tmp_path, data={"train": str(data), "eval": None},
                       train={"objective": "weighted", "max_steps": 2, "packs_per_step": 1})
    s = open_session(load_config(cfg), None, model=False, savings=False)
    first = {s.examples[e].id for i in StepPlan.for_run(s.cfg, s.plan, s.examples, 1).pack_ids(0, 0)
             for e in s.plan.packs[i].examples}
    assert first and len(first) < len(s.examples)
    _weighted_data(tmp_path, lambda i: 0.0 if i in first else 1.0)
    run_in_process("train", cfg)
    steps = [m for m in (json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines())
             if m.get("split") != "eval"]
    assert [m["step"] for m in steps] == [1, 2]
    assert steps[0]["loss"] == 0.0 and steps[0]["grad_norm"] == 0.0 and steps[1]["grad_norm"] > 0

    _weighted_data(tmp_path, lambda _: 0.0)
    proc = run_in_process("train", cfg, "--overwrite", check=False)
    assert proc.returncode == 2 and f"{data}: every data.train example has weight 0" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"id": f"p{i}", "system": RULEBOOKS[0], "item": f"Colour {i}",
                                         "chosen": "yes", "rejected": "no", "weight": 0}) + "\n" for i in range(3)))
    proc = run_in_process("train", cfg, "--overwrite", "--set", f"data.train={pairs}", "--set",
                          "train.objective=dpo", check=False)
    assert proc.returncode == 2 and f"{pairs}: every data.train example has weight 0" in proc.stderr, proc.stderr
