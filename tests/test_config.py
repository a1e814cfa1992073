"""The config tree: YAML in, every problem reported at once with its dotted path, `--set` overrides typed."""

from pathlib import Path

import pytest

from packtrain.config import Config, ConfigError, config_from_dict, load_config

REPO = Path(__file__).resolve().parents[1]


def write_yaml(tmp_path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def problems_of(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    return e.value.problems


def test_empty_config_is_all_defaults():
    assert config_from_dict({}) == Config()


def test_values_are_read_into_the_typed_tree(tmp_path):
    path = write_yaml(tmp_path, "packing:\n  token_budget: 4096\n  on_overflow: skip\noptim:\n  lr: 1\n")
    cfg = load_config(path)
    assert cfg.packing.token_budget == 4096
    assert cfg.packing.on_overflow == "skip"
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)  # an int is accepted where a float is expected


def test_exponent_without_a_dot_is_a_float(tmp_path):
    # YAML 1.1 (PyYAML's default) reads `1e-4` as a string; a learning rate written that way must still load.
    cfg = load_config(write_yaml(tmp_path, "optim:\n  lr: 1e-4\n  eps: 1E-8\n"))
    assert (cfg.optim.lr, cfg.optim.eps) == (0.0001, 1e-08)


def test_unknown_key():
    assert problems_of({"packing": {"token_budgett": 10}}) == [
        "packing.token_budgett: unknown key (known: context_grad, continuation_groups, max_continuations, mode, on_overflow, token_budget, walk)"
    ]


def test_unknown_section():
    [problem] = problems_of({"pakcing": {}})
    assert problem.startswith("pakcing: unknown key")


def test_wrong_type():
    assert problems_of({"train": {"seed": "zero"}}) == ["train.seed: expected int, got 'zero'"]


def test_bool_is_not_an_int():
    assert problems_of({"train": {"epochs": True}}) == ["train.epochs: expected int, got True"]


def test_value_outside_a_literal():
    assert problems_of({"packing": {"on_overflow": "ignore"}}) == [
        "packing.on_overflow: expected 'error' | 'skip' | 'walk', got 'ignore'"
    ]


def test_bad_value():
    assert problems_of({"packing": {"token_budget": 1}}) == ["packing.token_budget: must be at least 2, got 1"]


def test_section_that_is_not_a_mapping():
    assert problems_of({"lora": 8}) == ["lora: expected a mapping, got int"]


def test_several_problems_are_listed_together(tmp_path):
    path = write_yaml(
        tmp_path,
        "packing:\n  token_budget: 1\n  max_continuations: many\n  colour: red\ntrain:\n  epochs: 0\n",
    )
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert sorted(e.value.problems) == sorted([
        "packing.max_continuations: expected int, got 'many'",
        "packing.colour: unknown key (known: context_grad, continuation_groups, max_continuations, mode, on_overflow, token_budget, walk)",
        "packing.token_budget: must be at least 2, got 1",
        "train.epochs: must be at least 1, got 0",
    ])
    message = str(e.value)
    assert str(path) in message
    for p in e.value.problems:
        assert p in message


def test_set_overrides_a_value(tmp_path):
    path = write_yaml(tmp_path, "packing:\n  token_budget: 4096\n")
    cfg = load_config(path, ["packing.token_budget=8192", "train.seed=7"])
    assert cfg.packing.token_budget == 8192
    assert cfg.train.seed == 7


def test_set_overrides_nested_dict_value(tmp_path):
    path = write_yaml(tmp_path, "model:\n  config:\n    hidden_size: 64\n    num_hidden_layers: 4\n")
    cfg = load_config(path, ["model.config.hidden_size=32"])
    assert cfg.model.config == {"hidden_size": 32, "num_hidden_layers": 4}


def test_set_parses_yaml_values(tmp_path):
    path = write_yaml(tmp_path, "")
    cfg = load_config(path, ["optim.max_grad_norm=null", "lora.target_modules=[q_proj, v_proj]", "optim.lr=1e-3"])
    assert cfg.optim.max_grad_norm is None
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.optim.lr == 0.001


def test_set_is_type_checked(tmp_path):
    path = write_yaml(tmp_path, "")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["packing.token_budget=lots", "packing.max_continuations=0", "data.trian=x.jsonl"])
    assert sorted(e.value.problems) == sorted([
        "packing.token_budget: expected int, got 'lots'",
        "packing.max_continuations: must be at least 1, got 0",
        "data.trian: unknown key (known: chat_template, eval, format, processor, template_kwargs, tokenizer, train, train_on)",
    ])


def test_malformed_set(tmp_path):
    path = write_yaml(tmp_path, "")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["packing.token_budget", "a..b=1"])
    assert e.value.problems == [
        "--set 'packing.token_budget': expected section.key=value",
        "--set 'a..b=1': expected section.key=value",
    ]


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write_yaml(tmp_path, "packing: [\n"))


def test_relative_paths_resolve_against_the_config_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "run.yaml"
    path.write_text("data:\n  train: ../train.jsonl\n")
    cfg = load_config(path)
    assert cfg.resolve_path(cfg.data.train).resolve() == (tmp_path / "train.jsonl").resolve()
    assert cfg.resolve_path("/abs/x.jsonl") == Path("/abs/x.jsonl")


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_starts_with_its_command_and_loads(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and path.relative_to(REPO).as_posix() in first, first
    load_config(path)


def _plan_refusal(tmp_path, *overrides):
    from cli_helpers import run_in_process, write_config

    proc = run_in_process("plan", write_config(tmp_path), *overrides, check=False)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    return proc.stderr


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_a_cost_must_be_finite(tmp_path, value):
    # cost_per_position=.inf gave utilisation NaN, and `plan --json` printed NaN / Infinity (not JSON)
    err = _plan_refusal(tmp_path, "--json", "--set", f"train.cost_per_position={value}")
    assert "train.cost_per_position: must be a finite number, not negative" in err, err


def test_both_costs_zero_are_refused(tmp_path):
    err = _plan_refusal(tmp_path, "--set", "train.cost_per_position=0", "--set", "train.cost_per_pair=0")
    assert "train.cost_per_position, train.cost_per_pair: both 0 gives every pack cost 0" in err, err
    assert config_from_dict({"train": {"cost_per_position": 0}}).train.cost_per_pair is None  # one 0 is fine


def test_an_alias_bomb_in_template_kwargs_is_refused_without_expanding_it(tmp_path):
    # 6 levels of 10 aliases: 10^6 values once expanded (a few more lines make it 10^9: `plan` grew to 5 GB and hung)
    lines = ["data:", "  template_kwargs:", "    a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 7)]
    path = write_yaml(tmp_path, "\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.problems == [("data.template_kwargs: more than 10000 values or 16 levels deep (YAML aliases count "
                                 "each time they are used); template switches are a few scalars")]
    deep = {"k": "v"}
    for _ in range(20):
        deep = {"k": deep}
    assert problems_of({"data": {"template_kwargs": deep}})[0].startswith("data.template_kwargs: more than")



@pytest.mark.parametrize("packing, problem", [
    ({"context_grad": "kv_only"}, "packing.mode tree: packing.context_grad kv_only is not built (full only)"),
    ({"context_grad": "frozen"}, "packing.mode tree: packing.context_grad frozen is not built (full only)"),
    ({"on_overflow": "walk"}, "packing.mode tree: packing.on_overflow walk is not built (error or skip)"),
    ({"continuation_groups": 2}, ("packing.continuation_groups: groups a pack's continuations, so it needs "
                                  "packing.mode shared_prefix, got mode 'tree' with 2 groups")),
])
def test_what_tree_does_not_build_is_refused_in_one_line(packing, problem):
    assert problems_of({"packing": {"mode": "tree", **packing}}) == [problem]


def test_tree_mode_loads():
    assert config_from_dict({"packing": {"mode": "tree", "on_overflow": "skip"}}).packing.mode == "tree"


# (key, value as --set writes it, what the refusal says): each passed validation before, and failed later (after
# output_dir was written: "Overflow when unpacking long long" at the first forward; a traceback in data/examples.py)
# or printed NaN into JSON
HUGE_OR_NOT_FINITE = [
    ("train.loss_chunk_rows", "100000000000000000000000", "must be at most 2,147,483,647"),
    ("packing.token_budget", "100000000000000000000000", "must be at most 2,147,483,647"),
    ("packing.max_continuations", "4294967296", "must be at most 2,147,483,647"),
    ("train.mlp_chunk_rows", "100000000000000000000000", "must be at most 2,147,483,647"),
    ("train.max_positions", "0", "must be at least 1"),
    ("train.seed", "100000000000000000000000", "too large (an integer below 2**63)"),
    ("optim.lr", ".nan", "must be a finite number, got nan"),
    ("optim.lr", "1e999", "must be a finite number, got inf"),
    ("optim.betas", "[.nan, 0.9]", "must be a finite number"),
    ("lora.alpha", "-.inf", "must be a finite number"),
    ("generate.temperature", ".nan", "must be a finite number"),
    ("ops.collective_timeout", "1e300", "must be at most 31,536,000"),
    ("ops.host_memory_per_node_gib", ".inf", "must be a finite number"),
    ("lora.r", "1000000000", "must be at most 65,536"),
]


@pytest.mark.parametrize("key, value, says", HUGE_OR_NOT_FINITE, ids=[f"{k}={v}" for k, v, _ in HUGE_OR_NOT_FINITE])
def test_a_huge_or_non_finite_value_is_refused_naming_its_key(tmp_path, key, value, says):
    err = _plan_refusal(tmp_path, "--set", f"{key}={value}")
    line = next((x for x in err.splitlines() if x.startswith(f"  - {key}: ")), None)
    assert line is not None and says in line, err


@pytest.mark.parametrize("key, value, says", HUGE_OR_NOT_FINITE[:3], ids=[k for k, _, _ in HUGE_OR_NOT_FINITE[:3]])
def test_train_refuses_them_before_it_writes_anything(tmp_path, key, value, says):
    from cli_helpers import run_in_process, write_config

    proc = run_in_process("train", write_config(tmp_path), "--set", f"{key}={value}", check=False)
    assert proc.returncode == 2 and f"{key}: {says}" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


SAVINGS = ("activation_checkpointing", "offload", "loss_chunk_rows", "mlp_chunk_rows", "norm_chunk_rows")


def test_the_memory_savings_are_auto_unless_given(tmp_path):
    cfg = config_from_dict({})
    assert [getattr(cfg.train, k) for k in SAVINGS] == ["auto"] * 5
    given = load_config(write_yaml(tmp_path, "train:\n  activation_checkpointing: true\n  offload: 12\n"
                                             "  loss_chunk_rows: 0\n  mlp_chunk_rows: null\n  norm_chunk_rows: 8192\n"))
    assert [getattr(given.train, k) for k in SAVINGS] == [True, 12, 0, None, 8192]
    assert load_config(write_yaml(tmp_path, "train:\n  offload: false\n")).train.offload is False
    assert load_config(write_yaml(tmp_path, "train:\n  offload: auto\n")).train.offload == "auto"


def test_a_saving_takes_auto_or_its_type_and_nothing_else():
    assert sorted(problems_of({"train": {"offload": "some", "norm_chunk_rows": -1, "activation_checkpointing": 1,
                                         "loss_chunk_rows": 2.5}})) == [
        "train.activation_checkpointing: expected bool | 'auto', got 1",
        "train.loss_chunk_rows: expected int | 'auto', got 2.5",
        "train.norm_chunk_rows: must be >= 0 (0: whole) or auto, got -1",
        "train.offload: expected bool | int | 'auto', got 'some'",
    ]
    assert problems_of({"train": {"offload": -3}}) == [
        "train.offload: must be true, false, auto or a number of layers >= 0, got -3"]


def test_offload_with_checkpointing_off_is_refused_not_turned_on():
    """train.offload keeps checkpointed layers' inputs in host memory: with activation_checkpointing false it turned
    checkpointing on silently."""
    for offload in (1, True):
        (problem,) = problems_of({"train": {"offload": offload, "activation_checkpointing": False}})
        assert problem.startswith("train.offload: keeps checkpointed layers' inputs in host memory") and \
            f"got {offload!r}" in problem, problem
    for offload in (0, False, "auto"):
        assert config_from_dict({"train": {"offload": offload, "activation_checkpointing": False}}).train.offload \
            == offload
    assert config_from_dict({"train": {"offload": 1, "activation_checkpointing": "auto"}}).train.offload == 1


def test_plan_refuses_offload_with_checkpointing_off(tmp_path):
    """The same refusal through the command line, before any planning."""
    from cli_helpers import run_in_process, write_config

    proc = run_in_process("plan", write_config(tmp_path), "--set", "train.offload=1", "--set",
                          "train.activation_checkpointing=false", check=False)
    assert proc.returncode == 2 and "train.offload: keeps checkpointed layers' inputs in host memory" in proc.stderr
