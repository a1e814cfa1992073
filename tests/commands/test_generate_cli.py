"""`packtrain eval --generate` and ``generate.every`` through the CLI: the predictions against transformers' own
``generate`` with the same base and adapter, the files a user reads, 2 ranks against 1, and the errors a bad
``generate.metric`` gives."""

import json

import pytest
import torch
from cli_helpers import run_in_process, run_ranks, write_config
from peft import PeftModel

from packtrain.config import load_config
from packtrain.data.jsonl import load_split, load_tokenizer
from packtrain.models.build import build_base_model
from packtrain.run.scoring import strip_thinking

GEN = {"max_new_tokens": 6}


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_eval_generate_is_transformers_generate_with_the_adapter(trained, tmp_path):
    run = trained()
    out = tmp_path / "gen.jsonl"
    proc = run_in_process("eval", run.config, "--adapter", run.run / "adapter", "--generate", "--out", out,
                          "--set", "generate.max_new_tokens=6")
    rows = read_lines(out)
    cfg = load_config(run.config)
    examples = load_split(cfg, "eval")
    assert [r["id"] for r in rows] == [ex.id for ex in examples]
    tok = load_tokenizer(None)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    model = PeftModel.from_pretrained(build_base_model(cfg), run.run / "adapter").eval()
    for ex, row in zip(examples, rows):
        ids = torch.tensor([list(ex.prefix_ids) + list(ex.item_ids)])
        with torch.no_grad():
            new = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                 do_sample=False, eos_token_id=[im_end], pad_token_id=0)[0, ids.shape[1]:].tolist()
        stop = "eos" if im_end in new else "length"
        new = new[:new.index(im_end)] if im_end in new else new
        assert row["prediction_ids"] == new and row["stop"] == stop, (ex.id, row, new)
        target = list(ex.target_ids)
        target = target[:target.index(im_end)]
        assert row["prediction"] == tok.decode(new) and row["target"] == tok.decode(target)
        assert row["match"] is (row["prediction"].strip() == row["target"].strip())
        assert row["score"] == float(row["match"])
    assert f"exact match 0/{len(rows)}" in proc.stdout and "tokens/s" in proc.stdout
    errors = (tmp_path / "gen.errors.md").read_text()
    assert all(f"### {r['id']}" in errors for r in rows if not r["match"])


def test_a_user_scorer_next_to_the_config_scores_every_example(trained, tmp_path):
    run = trained()
    (tmp_path / "lenscore.py").write_text(
        "def score(prediction, target, example):\n"
        "    return min(1.0, len(prediction) / max(1, len(target)))\n")
    cfg = write_config(tmp_path, generate={"metric": "python:lenscore:score", "max_new_tokens": 4})
    out = tmp_path / "gen.jsonl"
    run_in_process("eval", cfg, "--adapter", run.run / "adapter", "--generate", "--out", out)
    rows = read_lines(out)
    # the scorer sees both sides without the think block (generate.strip_thinking): the prompt opened it, the target
    # closes it (empty) before the answer
    assert rows and all(r["target"].startswith("\n</think>\n\n") for r in rows)
    assert all(r["score"] == min(1.0, len(strip_thinking(r["prediction"])) / max(1, len(strip_thinking(r["target"]))))
               for r in rows)


@pytest.mark.parametrize("metric,message", [
    ("python:no_such_module:score", "no_such_module"),
    ("python:lenscore", "python:lenscore"),
    ("fuzzy", "fuzzy"),
])
def test_a_bad_metric_is_refused_before_the_model_loads(tmp_path, metric, message):
    (tmp_path / "lenscore.py").write_text("def score(p, t, e):\n    return 1.0\n")
    cfg = write_config(tmp_path, generate={"metric": metric})
    proc = run_in_process("eval", cfg, "--adapter", "none", "--generate", "--out", tmp_path / "g.jsonl",
                          check=False)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("packtrain eval: error: generate.metric") and message in line


def test_a_scorer_that_raises_names_itself_and_the_example(tmp_path):
    (tmp_path / "broken.py").write_text("def score(p, t, e):\n    raise KeyError('field')\n")
    cfg = write_config(tmp_path, generate={"metric": "python:broken:score", "max_new_tokens": 2})
    proc = run_in_process("eval", cfg, "--adapter", "none", "--generate", "--out", tmp_path / "g.jsonl",
                          check=False)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "python:broken:score" in line and "KeyError" in line and "r0-3" in line, line



def test_a_scorer_that_exits_during_training_stops_the_run_naming_it(tmp_path):
    # sys.exit() in a scorer at step 2's generation: before, the run ended with exit 0, no adapter and no message
    (tmp_path / "exiting.py").write_text("calls = []\n\ndef score(p, t, e):\n    calls.append(e.id)\n"
                                         "    if len(calls) > 1:\n        raise SystemExit(0)\n    return 0.5\n")
    cfg = write_config(tmp_path, generate={"metric": "python:exiting:score", "max_new_tokens": 2, "every": 2,
                                           "examples": 1},
                       train={"max_steps": 3, "packs_per_step": 1, "save_every": 1})
    proc = run_in_process("train", cfg, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("packtrain train: error: generate.metric python:exiting:score: the scorer raised "
                           "SystemExit: 0 on example "), line
    run = tmp_path / "run"
    assert not (run / "adapter").exists() and sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1"]


def test_a_scorer_may_return_a_torch_scalar_as_it_may_a_bool(tmp_path):
    from packtrain.run.scoring import load_scorer

    (tmp_path / "tensorscore.py").write_text("import torch\n\ndef score(p, t, e):\n"
                                             "    return torch.tensor(p == t, dtype=torch.float64)\n")
    scorer = load_scorer("python:tensorscore:score", [tmp_path])
    assert scorer.score("x", "x", None) == (1.0, True) and scorer.score("x", "y", None) == (0.0, True)

@pytest.mark.process
@pytest.mark.distributed
@pytest.mark.parametrize("sampling", [False, True])
def test_two_ranks_give_the_predictions_of_one(tmp_path, sampling):
    """3 prompt groups on 2 ranks: one rank holds two groups, the other one (and a dummy unit)."""
    gen = {**GEN, "temperature": 1.3, "top_p": 0.95, "seed": 5} if sampling else GEN
    cfg = write_config(tmp_path, generate=gen)
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    run_in_process("eval", cfg, "--adapter", "none", "--generate", "--out", one)
    run_ranks(2, "eval", cfg, "--adapter", "none", "--generate", "--out", two)
    assert read_lines(one) == read_lines(two)
    assert len({tuple(r["prediction_ids"]) for r in read_lines(one)}) > 1


@pytest.mark.process
@pytest.mark.distributed
def test_generation_during_training_on_two_ranks(tmp_path):
    """generate.every under FSDP on 2 ranks: the same files and predictions as 1 rank, at step 0, every 2 steps and
    at the end; the metrics line, the footer, and the plot's second panel."""
    sections = dict(generate={**GEN, "every": 2}, train={"epochs": 1, "packs_per_step": 1, "seed": 0,
                                                         "save_every": 100})
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one, two = write_config(tmp_path / "a", **sections), write_config(tmp_path / "b", **sections)
    proc = run_in_process("train", one)
    run_ranks(2, "train", two)
    steps = sorted(int(p.stem.split("-")[1]) for p in (tmp_path / "a/run/generations").glob("step-*.jsonl"))
    total = json.loads((tmp_path / "a/run/metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert steps[0] == 0 and steps[-1] == total and steps == sorted({0, total} | set(range(2, total + 1, 2)))
    for s in steps:
        a = read_lines(tmp_path / f"a/run/generations/step-{s}.jsonl")
        b = read_lines(tmp_path / f"b/run/generations/step-{s}.jsonl")
        assert [r["prediction_ids"] for r in a] == [r["prediction_ids"] for r in b], s
        assert (tmp_path / f"a/run/generations/step-{s}.errors.md").is_file()
    lines = [json.loads(x) for x in (tmp_path / "a/run/metrics.jsonl").read_text().splitlines()]
    gen_lines = [r for r in lines if r.get("split") == "generate"]
    assert [r["step"] for r in gen_lines] == steps and all(0 <= r["mean_score"] <= 1 for r in gen_lines)
    assert "task score: " in proc.stdout and "generations" in proc.stdout


def test_pretokenized_data_without_a_tokenizer_compares_ids(tmp_path):
    """No text: the lines hold ids only, the exact metric compares them, and a text metric is refused at start."""
    data = tmp_path / "ids.jsonl"
    rows = [{"id": f"e{i}", "prefix_ids": [7, 8, 9, 10 + i % 2], "item_ids": [20 + i] * (i % 3),
             "target_ids": [5, 6]} for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write_config(tmp_path, data={"train": str(data), "eval": str(data), "format": "pretokenized"},
                       generate={"max_new_tokens": 3})
    out = tmp_path / "g.jsonl"
    proc = run_in_process("eval", cfg, "--adapter", "none", "--generate", "--out", out)
    lines = read_lines(out)
    assert [sorted(r) for r in lines] == [["id", "match", "prediction_ids", "score", "stop"]] * 4
    # the tiny config has no eos_token_id and there is no tokenizer: no stop token, said rather than silent
    assert all(r["stop"] == "length" for r in lines) and "warning: no stop token" in proc.stderr, proc.stderr
    assert all(r["match"] is (r["prediction_ids"] == [5, 6]) for r in lines)
    refused = run_in_process("eval", cfg, "--adapter", "none", "--generate", "--out", out, "--set",
                             "generate.metric=json", check=False)
    assert refused.returncode == 2 and "no tokenizer" in refused.stderr and "Traceback" not in refused.stderr


def test_the_line_of_a_prediction_that_is_not_json_says_parsed_false(tmp_path):
    """generate.metric json: a prediction that does not parse scores 0 and its JSON line carries "parsed": false
    (the summary's unparsed count is the number of such lines); a parsed one carries no "parsed" key."""
    from packtrain.run.scoring import load_scorer

    data = tmp_path / "json.jsonl"
    data.write_text("".join(json.dumps({"id": f"j{i}", "system": "Answer in JSON.", "item": f"Colour {i}",
                                        "target": json.dumps({"code": i})}) + "\n" for i in range(3)))
    cfg = write_config(tmp_path, data={"train": str(data), "eval": str(data)},
                       generate={"metric": "json", "max_new_tokens": 3})
    out = tmp_path / "g.jsonl"
    proc = run_in_process("eval", cfg, "--adapter", "none", "--generate", "--out", out)
    lines = read_lines(out)
    unparsed = [r for r in lines if r.get("parsed") is False]
    assert unparsed and all(r["score"] == 0.0 for r in unparsed)
    for r in lines:
        parses = load_scorer("json").score(strip_thinking(r["prediction"]), strip_thinking(r["target"]), None)[1]
        assert ("parsed" in r) is (not parses), r
    assert f"{len(unparsed)} predictions not JSON" in proc.stdout


def test_max_new_tokens_beyond_the_models_positions_is_refused(tmp_path):
    """generate.max_new_tokens=1e9 asked the allocator for 256 GB (a traceback); now the model's
    max_position_embeddings bounds P + item + the new tokens, checked before any row is allocated."""
    from cli_helpers import TINY_MODEL

    cfg = write_config(tmp_path, model={"config": {**TINY_MODEL, "max_position_embeddings": 64}},
                       generate={"max_new_tokens": 50})
    proc = run_in_process("eval", cfg, "--adapter", "none", "--generate", "--out", tmp_path / "g.jsonl", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("packtrain eval: error: generate.max_new_tokens: 50 new tokens after a prompt of up to "), line
    assert "exceed the model's 64 positions (max_position_embeddings); at most " in line, line
    assert not (tmp_path / "g.jsonl").exists()


def test_the_watchdog_says_a_generation_is_still_running(tmp_path):
    """Stacks written while step 0's generation runs: they said "last completed: generation at step 0", as if it had
    finished. The scorer holds the generation until the watchdog has written more stacks (bounded): the setup may
    have had its own dump, and the generation's beats re-armed the watchdog."""
    stacks = tmp_path / "run" / "hang" / "rank-0.txt"
    (tmp_path / "waiting.py").write_text(
        "import os, time\n\ndef score(p, t, e):\n    size = os.path.getsize(STACKS)\n"
        "    deadline = time.monotonic() + 60\n    while os.path.getsize(STACKS) == size:\n"
        "        if time.monotonic() > deadline:\n            raise TimeoutError('no stacks after 60 s')\n"
        f"        time.sleep(0.02)\n    return 1.0\n\nSTACKS = {str(stacks)!r}\n")
    cfg = write_config(tmp_path, generate={"metric": "python:waiting:score", "max_new_tokens": 2, "every": 1,
                                           "examples": 1}, train={"max_steps": 1}, ops={"hang_timeout": 0.5})
    run_in_process("train", cfg)
    text = stacks.read_text()
    assert "last completed: a generation pack at step 0 (the generation still running)" in text, text[-3000:]


def test_a_generation_whose_files_were_not_written_leaves_no_metrics_line(tmp_path, monkeypatch):
    """A full disk while step 1's generations are written: the run stops naming it, and metrics.jsonl has no line
    for a generation whose file does not exist (it had one before)."""
    import errno

    from packtrain.run import cadence

    written = cadence.write_task

    def full_at_step_1(result, lines, *args):
        if lines.name == "step-1.jsonl":
            raise OSError(errno.ENOSPC, "No space left on device", str(lines))
        written(result, lines, *args)

    monkeypatch.setattr(cadence, "write_task", full_at_step_1)
    cfg = write_config(tmp_path, generate={"max_new_tokens": 2, "every": 1, "examples": 1}, train={"max_steps": 2})
    proc = run_in_process("train", cfg, check=False)
    assert proc.returncode == 2 and "no space left on device" in proc.stderr, proc.stderr[-2000:]
    run = tmp_path / "run"
    steps = [x["step"] for x in read_lines(run / "metrics.jsonl") if x.get("split") == "generate"]
    assert steps == [0] and sorted(p.name for p in (run / "generations").glob("*.jsonl")) == ["step-0.jsonl"]
