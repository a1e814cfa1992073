"""Data as a user coming from TRL or axolotl writes it, through the CLI (`packtrain plan` / `packtrain train`, in
process): every bad line of a file named at once, a message's `name` trained where the chat template writes it and
refused where it would be dropped, TRL's preference forms trained under train.objective dpo where they map onto a
chat pair and refused with the mapping where they do not (docs/data.md)."""

import json

from chat_data import CHATML, TUTOR, write_jsonl
from cli_helpers import RULEBOOKS, metrics_of, refused, run_in_process, train_losses, write_config

from packtrain.config import load_config
from packtrain.data.jsonl import load_split, load_tokenizer

# ChatML writing a message's name after its role
NAMED = CHATML.replace("message['role'] + '\\n'",
                       "message['role'] + (' ' + message['name'] if message['name'] is defined else '') + '\\n'")
PAIRS = {"packing": {"mode": "tree", "token_budget": 400, "max_continuations": 4},
         "train": {"objective": "dpo", "epochs": 1, "packs_per_step": 1}}


def _text_rows(n: int) -> list[dict]:
    return [{"id": f"r{i}", "system": RULEBOOKS[i % 3], "item": f"Colour {i}", "target": f"code {i}"}
            for i in range(1, n + 1)]


def test_every_bad_line_of_a_data_file_is_reported_at_once(tmp_path):
    rows = [json.dumps(r) for r in _text_rows(100)]
    rows[10] = json.dumps({**json.loads(rows[10]), "target": 5})  # line 11
    rows[36] = '{"system": "s", "item": "i" "target": "t"}'  # line 37
    rows[90] = json.dumps({k: v for k, v in json.loads(rows[90]).items() if k != "item"})  # line 91
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(rows) + "\n")
    cfg = write_config(tmp_path, data={"train": str(data), "eval": None})
    expected = "\n".join([
        f"{data}: 3 bad lines:",
        f"  - {data}:11: field 'target': expected a string, got 5",
        f"  - {data}:37: not valid JSON: Expecting ',' delimiter (column 29)",
        f"  - {data}:91: field 'item': missing (the text format needs it)"])
    for command in ("plan", "train"):  # train reads the data as plan does, before any model
        err = refused(run_in_process(command, cfg, check=False))
        assert err == f"packtrain {command}: error: {expected}\n", err


def _named_chat(n: int, name_key: str = "name") -> list[dict]:
    return [{"id": f"c{i}", "messages": [{"role": "system", "content": TUTOR},
                                         {"role": "user", name_key: ["alice", "bob"][i % 2], "content": f"Colour {i}"},
                                         {"role": "assistant", "content": ["alpha", "beta", "gamma"][i % 3]}]}
            for i in range(n)]


def test_a_message_name_trains_where_the_template_writes_it(tmp_path):
    data = write_jsonl(tmp_path / "named.jsonl", _named_chat(6))
    (tmp_path / "named.jinja").write_text(NAMED)
    cfg = write_config(tmp_path, data={"train": data, "eval": None, "chat_template": "named.jinja"},
                       train={"epochs": 1, "packs_per_step": 1})
    run_in_process("train", cfg)
    assert len(metrics_of(tmp_path / "run")) >= 1
    tok = load_tokenizer()
    items = [tok.decode(ex.item_ids) for ex in load_split(load_config(cfg), "train")]
    assert [item.split("\n")[0] for item in items] == ["<|im_start|>user alice", "<|im_start|>user bob"] * 3


def test_a_message_name_the_template_would_drop_is_refused(tmp_path):
    data = write_jsonl(tmp_path / "named.jsonl", _named_chat(2))
    cfg = write_config(tmp_path, data={"train": data, "eval": None})  # the bundled template: Qwen's, no names
    err = refused(run_in_process("plan", cfg, check=False))
    for line in (1, 2):
        assert f"{data}:{line}: field 'messages[1].name': the chat template " in err
    assert "does not render a message's name: it would be dropped" in err


def _trl_pairs(conversational: bool = True) -> list[dict]:
    rows = []
    for r, system in enumerate(RULEBOOKS):
        for colour in ("red", "blue"):
            chosen, rejected = f"code {colour} {'ABC'[r]}", f"code {colour} Z"
            if conversational:
                rows.append({"id": f"r{r}-{colour}", "prompt": [{"role": "system", "content": system},
                                                                {"role": "user", "content": f"Colour: {colour}"}],
                             "chosen": [{"role": "assistant", "content": chosen}],
                             "rejected": [{"role": "assistant", "content": rejected}]})
            else:
                rows.append({"id": f"r{r}-{colour}", "prompt": f"{system}\nColour: {colour}", "chosen": chosen,
                             "rejected": rejected})
    return rows


def test_trls_conversational_pairs_train_under_dpo(tmp_path):
    trl = write_jsonl(tmp_path / "trl.jsonl", _trl_pairs())
    own = write_jsonl(tmp_path / "own.jsonl", [{"id": r["id"], "messages": r.pop("prompt"), **r}
                                               for r in _trl_pairs()])
    cfg = write_config(tmp_path, data={"train": trl, "eval": None}, **PAIRS)
    plans = [json.loads(run_in_process("plan", cfg, "--json", "--set", f"data.train={path}").stdout)
             for path in (trl, own)]
    assert plans[0] == plans[1] and plans[0]["preference_pairs"] == 6
    # the same run as on packtrain's own form
    for name, path in (("trl", trl), ("own", own)):
        out = run_in_process("train", cfg, "--set", f"data.train={path}", "--set", f"output_dir={tmp_path / name}")
        assert "objective dpo" in out.stdout and "6 preference pairs" in out.stdout
    assert train_losses(tmp_path / "trl") == train_losses(tmp_path / "own") and len(train_losses(tmp_path / "trl")) == 3


def test_trls_plain_text_pairs_are_refused_with_the_mapping(tmp_path):
    trl = write_jsonl(tmp_path / "trl.jsonl", _trl_pairs(conversational=False))
    cfg = write_config(tmp_path, data={"train": trl, "eval": None}, **PAIRS)
    err = refused(run_in_process("plan", cfg, check=False))
    assert f"{trl}: 6 bad lines:" in err
    for line in range(1, 7):
        assert (f"{trl}:{line}: field 'prompt': a plain-text prompt (TRL's standard form, trained as raw text without "
                "a chat template): packtrain's text pair is {system, item, chosen, rejected}") in err
    assert "rename prompt to item and give the system prompt as system" in err
