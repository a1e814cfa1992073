"""`packtrain plan` through the real command line (in this process; the installed console script in one of its own):
statistics out, one clear error for bad input."""

import json
import subprocess
import sys
from pathlib import Path

import cli_helpers
import pytest
from cli_helpers import REPO, run_in_process

RULEBOOK = "You are the clerk. Rule 1. Answer with the codes only.\n- falcon is written juru"


def run_plan(*args) -> subprocess.CompletedProcess:
    return run_in_process("plan", *args, check=False)


def write_config(tmp_path, lines, extra="") -> Path:
    """A config planning a data file written next to it (a list of records or raw lines)."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    config = tmp_path / "run.yaml"
    config.write_text(f"# packtrain plan {config}\ndata:\n  train: train.jsonl\n{extra}")
    return config


def assert_one_clear_error(result, expected: str):
    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr == f"packtrain plan: error: {expected}\n"


def text_record(**kw):
    return {"system": RULEBOOK, "item": "Encode: falcon", "target": "juru", **kw}


def test_the_seeds_illustration_as_json(tmp_path):
    prefix = json.dumps([k % 1000 for k in range(64_000)])
    lines = [f'{{"id": "c{k}", "prefix_ids": {prefix}, "item_ids": {json.dumps([5] * 999)}, "target_ids": [6]}}'
             for k in range(80)]
    result = run_plan(write_config(tmp_path, lines, "packing:\n  token_budget: 150000\n"), "--json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert {k: stats[k] for k in ("examples", "prompts", "packs", "positions_standalone", "positions_packed",
                                  "attention_pairs_standalone", "attention_pairs_packed")} == {
        "examples": 80,
        "prompts": 1,
        "packs": 1,
        "positions_standalone": 5_200_000,
        "positions_packed": 144_000,
        "attention_pairs_standalone": 169_002_600_000,
        "attention_pairs_packed": 7_208_072_000,
    }
    assert f"{stats['position_ratio']:.1f}" == "36.1"
    assert f"{stats['attention_pair_ratio']:.1f}" == "23.4"


def test_table_output(tmp_path):
    # P of 4, budget 10: [c] and [a, b], as in the planner's small table
    records = [{"id": i, "prefix_ids": [1, 2, 3, 4], "item_ids": [5] * (n - 1), "target_ids": [6]}
               for i, n in (("a", 3), ("b", 3), ("c", 5))]
    result = run_plan(write_config(tmp_path, records, "packing:\n  token_budget: 10\n"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:] == [
        "  examples   3",
        "  data       3 conversations, 3 assistant turns trained, 3 target tokens",
        "  prompts    1",
        "  packs      2  (continuations per pack: min 1, median 1, max 2)",
        "  budget     10 positions per pack, 95.0% used",
        "",
        "                     standalone      packed    ratio",
        "  positions                  23          19     1.2x",
        "  attention pairs           101          91     1.1x",
        "  (attention pairs: query-key pairs of causal attention, per full-attention layer and head)",
        "",
        # one pack per step on one rank: nobody waits; no model config: positions are the cost
        "steps at world size 1 (1 pack per step; train.balance cost)",
        "  utilisation (mean / largest rank cost per step, epoch 0) cost 1.000, round_robin 1.000",
        "  distinct prompts per step: cost 1.0, round_robin 1.0",
        "  cost model: 1 per position + 0 per attention pair (train.cost_per_position, train.cost_per_pair)",
        "serve: vllm yes, sglang yes, merged yes",  # lora.target_modules' default: q, k, v, o, gate_proj
    ]


TREE_RECORDS = [{"id": i, "prefix_ids": [1, 2, 3, 4], "item_ids": item, "target_ids": target}
                for i, item, target in (("a", [5, 6], [7]), ("b", [5, 6], [8]), ("c", [5, 6, 7], [9]),
                                        ("d", [10], [11]))]


def test_tree_positions_packed_are_the_distinct_prefixes(tmp_path):
    config = write_config(tmp_path, TREE_RECORDS, "packing:\n  mode: tree\n  token_budget: 100\n")
    stats = json.loads(run_plan(config, "--json").stdout)
    continuations = [tuple(r["item_ids"] + r["target_ids"]) for r in TREE_RECORDS]
    distinct = len({c[:k] for c in continuations for k in range(1, len(c) + 1)})  # one prompt group
    assert stats["packs"] == 1
    assert stats["positions_packed"] == 4 * stats["packs"] + distinct == 11
    assert stats["pack_positions"] == [11]
    assert (stats["positions_standalone"], stats["positions_shared_prefix"]) == (28, 16)


def test_tree_table_has_a_row_per_mode(tmp_path):
    config = write_config(tmp_path, TREE_RECORDS, "packing:\n  mode: tree\n  token_budget: 100\n")
    lines = run_plan(config).stdout.splitlines()
    # pairs: standalone 28 + 28 + 36 + 21; flat 10 + 18 + 18 + 26 + 11; tree 10 + each token's |P| + depth
    assert lines[7:12] == [
        "                     positions  vs tree  attention pairs  vs tree",
        "  standalone                28     2.5x              113     2.1x",
        "  shared_prefix             16     1.5x               83     1.5x",
        "  tree                      11     1.0x               54     1.0x",
        "  (attention pairs: query-key pairs of causal attention, per full-attention layer and head)",
    ]


def test_set_overrides_the_config(tmp_path):
    records = [{"prefix_ids": [1, 2, 3, 4], "item_ids": [5, 5], "target_ids": [6]} for _ in range(6)]
    config = write_config(tmp_path, records, "packing:\n  token_budget: 10\n")
    assert json.loads(run_plan(config, "--json").stdout)["packs"] == 3
    result = run_plan(config, "--json", "--set", "packing.token_budget=100", "--set", "packing.max_continuations=4")
    assert json.loads(result.stdout)["packs"] == 2


def test_demo_config(tmp_path):
    result = run_plan(REPO / "configs/demo.yaml", "--json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert (stats["examples"], stats["prompts"], stats["skipped"]) == (300, 5, 0)
    # positions standalone, counted independently: each example rendered whole and tokenized alone
    from packtrain.data.jsonl import load_tokenizer

    tok = load_tokenizer()
    records = [json.loads(line) for line in (REPO / "data/demo/train.jsonl").read_text().splitlines()]
    template = (REPO / "data/demo/chatml.jinja").read_text()  # the demo's data.chat_template
    whole = [tok.apply_chat_template([{"role": "system", "content": r["system"]}, {"role": "user", "content": r["item"]},
                                      {"role": "assistant", "content": r["target"]}], tokenize=False,
                                     chat_template=template) for r in records]
    assert stats["positions_standalone"] == sum(len(ids) for ids in tok(whole, add_special_tokens=False)["input_ids"])


@pytest.mark.process
def test_console_script_exists():
    script = Path(sys.executable).parent / "packtrain"
    if not script.exists():
        pytest.skip("packtrain is not installed in this environment (pip install -e .)")
    result = subprocess.run([str(script), "plan", "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and "--json" in result.stdout


# --- bad input: one message naming file, line and field; exit 2; no traceback -----------------------------------------

def test_malformed_json(tmp_path):
    config = write_config(tmp_path, [text_record(), '{"system": "s", "item": "i", "target": }'])
    assert_one_clear_error(run_plan(config), f"{tmp_path / 'train.jsonl'}:2: not valid JSON: Expecting value "
                                             "(column 40)")


def test_missing_field(tmp_path):
    config = write_config(tmp_path, [text_record(), {"system": RULEBOOK, "target": "juru"}])
    assert_one_clear_error(run_plan(config), f"{tmp_path / 'train.jsonl'}:2: field 'item': missing (the text format "
                                             "needs it)")


def test_mistyped_field(tmp_path):
    config = write_config(tmp_path, [text_record(target=["juru"])])
    assert_one_clear_error(run_plan(config), f"{tmp_path / 'train.jsonl'}:1: field 'target': expected a string, got "
                                             '["juru"]')


def test_empty_target(tmp_path):
    config = write_config(tmp_path, [text_record(), text_record(), text_record(target="")])
    assert_one_clear_error(run_plan(config), f"{tmp_path / 'train.jsonl'}:3: field 'target': empty")


def test_empty_file(tmp_path):
    config = write_config(tmp_path, [])
    assert_one_clear_error(run_plan(config), f"{tmp_path / 'train.jsonl'}: empty file: no examples")


def test_chat_without_a_system_message(tmp_path):
    chat = {"messages": [{"role": "user", "content": "Encode: falcon"}, {"role": "assistant", "content": "juru"}]}
    config = write_config(tmp_path, [chat])
    assert_one_clear_error(run_plan(config), f"{tmp_path / 'train.jsonl'}:1: field 'messages[0].role': the first "
                                             "message must be the system message, got user")


def test_p_that_is_not_a_token_prefix(tmp_path):
    from packtrain.data.jsonl import load_tokenizer

    tok = load_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # no separators: BPE merges across
    tok.save_pretrained(tmp_path / "tokenizer")
    config = write_config(tmp_path, [text_record(), text_record(system="jur", item="u", target="x")],
                          "  tokenizer: tokenizer\n")
    assert_one_clear_error(run_plan(config), f"{tmp_path / 'train.jsonl'}:2: field 'system': the system turn's tokens "
                                             "are not a prefix of the prompt's tokens (the tokenizer merges across "
                                             "the end of the system turn)")


def test_example_over_the_budget(tmp_path):
    records = [{"id": "long", "prefix_ids": [1, 2, 3, 4], "item_ids": [5] * 6, "target_ids": [6]}]
    config = write_config(tmp_path, records, "packing:\n  token_budget: 10\n")
    assert_one_clear_error(run_plan(config), f"{tmp_path / 'train.jsonl'}:1: example 'long' needs 11 positions (P 4 + "
                                             "continuation 7), over packing.token_budget=10; raise the budget or set "
                                             "packing.on_overflow=skip")
    result = run_plan(config, "--json", "--set", "packing.on_overflow=skip")
    assert_one_clear_error(result, "no example fits packing.token_budget=10 (1 skipped)")


def test_bad_config_lists_every_problem(tmp_path):
    config = write_config(tmp_path, [text_record()], "packing:\n  token_budget: 1\n  max_continuation: 3\n")
    result = run_plan(config, "--set", "train.seed=x")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"packtrain plan: error: invalid config in {config}:",
        "  - packing.max_continuation: unknown key (known: context_grad, continuation_groups, max_continuations, mode, on_overflow, token_budget, walk)",
        "  - train.seed: expected int, got 'x'",
        "  - packing.token_budget: must be at least 2, got 1",
    ]


def test_missing_train_data(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("packing:\n  token_budget: 100\n")
    result = run_plan(config)
    assert_one_clear_error(result, f"invalid config in {config}:\n  - data.train: not set (the training data to plan)")


# --- plan --memory without the data: the largest pack the config allows -----------------------------------------------

def test_plan_memory_needs_no_data(tmp_path):
    """`plan --memory CONFIG` whose data file is missing stopped on it, though the estimate needs none: it sizes
    packing.token_budget's pack and says so in one line; plain `plan` still reads the data (and refuses without
    it), and --measure, which runs the step on the data's largest pack, refuses too."""
    missing = tmp_path / "nowhere.jsonl"
    config = cli_helpers.write_config(tmp_path, data={"train": str(missing), "eval": None})
    out = run_plan(config, "--memory")
    assert out.returncode == 0, out.stderr
    said = out.stdout[:out.stdout.index("\nserve: ")]  # one line, wrapped where the path is long
    assert " ".join(said.split()) == (f"no data ({missing} not found): estimating the pack of "
                                      "packing.token_budget positions that needs the most memory")
    assert "memory per GPU for the largest pack: 208 positions, 3 continuations, 208 target tokens" in out.stdout
    assert "total on the device" in out.stdout and "each packing.context_grad" in out.stdout
    mem = _strict_json(run_plan(config, "--memory", "--json", "--gpu-memory", "8").stdout)["memory"]
    assert mem["unit"] == {"from": "packing.token_budget", "no_data": f"{missing} not found", "prefix": 0,
                           "positions": 208, "continuations": 3, "target_tokens": 208}
    assert mem["max_token_budget"] > 208
    assert_one_clear_error(run_plan(config), f"{missing}: file not found")
    refused = run_plan(config, "--memory", "--measure")
    assert refused.returncode == 2 and "--measure runs the training step on the data's largest pack" in refused.stderr
    unset = tmp_path / "unset.yaml"
    unset.write_text("# packtrain plan unset.yaml\n" + config.read_text().replace(f"train: {missing}", "train: null"))
    assert run_plan(unset, "--memory").stdout.startswith("no data (data.train not set): ")


@pytest.mark.parametrize("packing", [{"mode": "shared_prefix"}, {"mode": "standalone"}, {"mode": "tree"},
                                     {"continuation_groups": 2}, {"context_grad": "frozen"}],
                         ids=["shared_prefix", "standalone", "tree", "groups", "frozen"])
def test_the_estimate_without_data_bounds_the_datas(tmp_path, packing):
    """Without data the pack sized is the budget's of the most memory: at least the estimate of the data's largest
    unit under each packing mode, the same savings chosen (every one fits). Under continuation groups that is a P
    of nearly the whole budget (P's graph is kept whole while each group runs): no P held less than the data's."""
    config = cli_helpers.write_config(tmp_path, packing=packing)
    with_data = _strict_json(run_plan(config, "--memory", "--json").stdout)["memory"]
    no_data = _strict_json(run_plan(config, "--memory", "--json", "--set",
                                    f"data.train={tmp_path / 'gone.jsonl'}").stdout)["memory"]
    assert with_data["unit"]["from"] == "data" and no_data["unit"]["from"] == "packing.token_budget"
    assert no_data["savings"] == with_data["savings"]
    assert no_data["total_device_bytes"] >= with_data["total_device_bytes"]
    assert no_data["unit"]["positions"] == 208 >= with_data["unit"]["positions"]


def test_without_data_groups_size_the_largest_p_where_it_holds_more():
    """The 27B in 8 continuation groups: P's graph, kept whole while each group runs, outweighs every target's
    logits (the loss in chunks), so the pack sized is a P of all but one position per continuation; in whole packs,
    no P."""
    def unit(*sets):
        out = run_plan(REPO / "configs" / "qwen3.6-27b.yaml", "--memory", "--json", *sets)
        assert out.returncode == 0, out.stderr
        return _strict_json(out.stdout)["memory"]["unit"]

    assert unit("--set", "packing.continuation_groups=8")["prefix"] == 150_000 - 90
    assert unit()["prefix"] == 0


# --- the checks train makes at start ----------------------------------------------------------------------------------

def test_plan_refuses_the_task_metric_train_refuses(tmp_path):
    """`generate.metric: jsonn` under generate.every: train refuses it at start, plan ran; now plan refuses it with
    train's message (with the data and, under --memory, without)."""
    config = cli_helpers.write_config(tmp_path, generate={"metric": "jsonn", "every": 2})
    train = cli_helpers.refused(run_in_process("train", config, check=False))
    message = train.strip().splitlines()[-1].removeprefix("packtrain train: error: ")
    assert message.startswith("generate.metric: 'jsonn' is not a metric")
    assert_one_clear_error(run_plan(config), message)
    assert_one_clear_error(run_plan(config, "--memory", "--set", f"data.train={tmp_path / 'gone.jsonl'}"), message)
    assert run_plan(config, "--set", "generate.metric=json").returncode == 0


def _strict_json(text: str):
    """json.loads without Python's NaN / Infinity extension: what any other JSON reader accepts."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


# (flag, value): each was accepted (nan, inf: "gpu_memory_gib": NaN and a budget for "nan GiB"; -1, 0) or failed late
# (host memory inf: OverflowError; --ranks-per-node 0 silently became 8)
BAD_FLAGS = [*(("--gpu-memory", v) for v in ("nan", "inf", "-inf", "0", "-1", "1e400", "lots")),
             *(("--host-memory-per-node", v) for v in ("nan", "inf", "0", "-1")),
             ("--ranks-per-node", "0"), ("--ranks-per-node", "-2"), ("--world-size", "0"), ("--world-size", "1.5")]


@pytest.mark.parametrize("flag, value", BAD_FLAGS, ids=[f"{f}={v}" for f, v in BAD_FLAGS])
def test_a_flag_out_of_range_is_refused_naming_it(tmp_path, flag, value):
    config = cli_helpers.write_config(tmp_path, train={"offload": True})
    result = run_plan(config, "--memory", "--json", f"{flag}={value}")
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr, result
    assert f"packtrain plan: error: argument {flag}: " in result.stderr, result.stderr


def test_gpu_memory_zero_is_refused(tmp_path):
    # `<= 0` made `< 0` let 0 GiB through: a budget search for nothing
    result = run_plan(cli_helpers.write_config(tmp_path), "--memory", "--gpu-memory", "0")
    assert result.returncode == 2 and result.stdout == ""
    assert "argument --gpu-memory: must be a finite number of GiB above 0" in result.stderr, result.stderr


def test_plan_json_is_strict_json_with_every_figure(tmp_path):
    config = cli_helpers.write_config(tmp_path, train={"offload": True})
    out = run_plan(config, "--memory", "--json", "--gpu-memory", "80", "--host-memory-per-node", "512",
                   "--ranks-per-node", "4", "--world-size", "8")
    assert out.returncode == 0, out.stderr
    mem = _strict_json(out.stdout)["memory"]
    assert mem["budget_search"]["gpu_memory_gib"] == 80 and mem["node"]["ranks_per_node"] == 4, mem["node"]


def test_the_budget_search_stays_within_what_the_config_takes_and_the_node_within_the_world(tmp_path):
    """--gpu-memory of a petabyte: the largest budget is the largest packing.token_budget the config accepts
    (2**31 - 1), not 4,249,419,775; --ranks-per-node above --world-size is refused (it sized a host pool for ranks
    the run does not have)."""
    from packtrain.config import MAX_POSITIONS

    config = cli_helpers.write_config(tmp_path)
    out = run_plan(config, "--memory", "--json", "--gpu-memory", "1048576")
    assert out.returncode == 0, out.stderr
    assert _strict_json(out.stdout)["memory"]["budget_search"]["token_budget"] == MAX_POSITIONS == 2**31 - 1
    refused = run_plan(config, "--memory", "--ranks-per-node", "16", "--world-size", "8")
    assert refused.returncode == 2 and "--ranks-per-node 16: more than the run's --world-size 8" in refused.stderr
    assert run_plan(config, "--memory", "--ranks-per-node", "8", "--world-size", "8").returncode == 0
