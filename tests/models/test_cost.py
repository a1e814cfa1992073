"""packtrain/models/cost.py, the one FLOP count: its figures counted by hand and from the model's own linear layers,
the three users (the balance, the savings' step time, the bench's model FLOPs) returning the same FLOPs for the same
unit, and no second FLOP formula anywhere in the package."""

import ast
from pathlib import Path

import pytest
import torch
from cli_helpers import REPO, TINY_MODEL, write_config
from tiny_models import tiny_text_config

import packtrain
from packtrain.config import load_config
from packtrain.data.attention_pairs import pack_pairs
from packtrain.models.cost import CostModel
from packtrain.models.text_config import text_config


def test_cost_model_from_the_config_counts_flops_by_hand():
    text = text_config(TINY_MODEL)
    model = CostModel.of_text(text)
    H, I = 32, 48
    attention = H * 2 * 4 * 16 + 2 * H * 2 * 16 + 4 * 16 * H  # q (gated: twice), k, v, o
    key, value = 2 * 8, 4 * 8
    gdn = H * (2 * key + value) + H * value + 2 * H * 4 + value * H  # in_proj_qkv, in_proj_z, in_proj_b/a, out
    mlp = 3 * H * I
    assert model.per_position == 6 * (attention + 2 * gdn + 3 * mlp)
    assert model.per_pair == 12 * 4 * 16  # one full-attention layer: 4 heads of 16
    assert model.per_head_row == 6 * H * 1024
    assert model.flops(3 + 2 + 1, pack_pairs(3, [2, 1])) == model.per_position * 6 + model.per_pair * (
        6 + (2 * 3 + 3) + (1 * 3 + 1))
    assert model.flops(1, 0, 4) == model.per_position + 4 * model.per_head_row
    assert model.forward_flops(3, 5, 7) * 3 == model.flops(3, 5, 7)


def test_model_flops_count_the_models_linear_layers():
    """The per-position figure against the linear layers of transformers' own model: 6 per weight."""
    layer_types = ["linear_attention", "full_attention"]
    cfg = tiny_text_config(layer_types, vocab=97)
    model = __import__("transformers").Qwen3_5ForCausalLM(cfg)
    weights = sum(m.in_features * m.out_features for m in model.model.layers.modules()
                  if isinstance(m, torch.nn.Linear))
    cost = CostModel.of_text(text_config(cfg.to_dict()))
    assert cost.flops(10, 0) == 10 * 6 * weights
    assert cost.flops(0, 0, 3) == 3 * 6 * cfg.hidden_size * cfg.vocab_size
    assert cost.flops(0, 5) == 5 * 12 * cfg.num_attention_heads * cfg.head_dim  # one full-attention layer


def test_measured_figures_replace_the_config_s(tmp_path):
    cfg = load_config(write_config(tmp_path, train={"cost_per_position": 2.0, "cost_per_pair": 0.5}))
    assert CostModel.for_config(cfg).flops(10, 4) == 22.0
    data_only = load_config(write_config(tmp_path, model={"config": None, "path": None}))
    assert CostModel.for_config(data_only).flops(10, 4) == 10.0  # `plan` of data alone: positions are the cost


@pytest.mark.parametrize("config", ["configs/demo.yaml", "configs/qwen3.6-27b.yaml", "configs/qwen3.6-35b-a3b.yaml"])
def test_the_three_users_count_the_same_flops_for_the_same_unit(config):
    """The balance's pack cost, the savings' step FLOPs (no saving) and the bench's model FLOPs of one pack: the same
    number (the balance's without the head rows, which it leaves out of a pack's cost: packtrain/models/cost.py)."""
    from packtrain.bench.timing import model_flops
    from packtrain.data.planner import Pack, Plan
    from packtrain.memory.estimate import StepSavings, UnitShape
    from packtrain.memory.step_time import step_flops
    from packtrain.models.text_config import config_dict_of
    from packtrain.run.balance import pack_costs

    cfg = load_config(REPO / config)
    text = text_config(config_dict_of(cfg))
    prefix, lengths, targets = 1000, [40, 70, 25], [5, 9, 3]
    pairs = pack_pairs(prefix, lengths)
    plan = Plan([Pack(0, (0, 1, 2), prefix + sum(lengths), pairs)], [[1] * prefix], [], 2000, 3)
    shape = UnitShape(prefix, lengths, targets)
    none = StepSavings(activation_checkpointing=False, offload_layers=0, loss_rows=0, mlp_rows=0, norm_rows=0)
    cost = CostModel.of_text(text)
    expected = cost.flops(prefix + sum(lengths), pairs, sum(targets))
    assert step_flops(text, shape, none) == expected
    assert model_flops(text, prefix + sum(lengths), pairs, sum(targets)) == expected
    assert pack_costs(plan, [], CostModel.for_config(cfg)) == [cost.flops(prefix + sum(lengths), pairs)]
    assert expected > cost.flops(prefix + sum(lengths), pairs)  # the head counts where the rows are given


# FLOPs are counted in packtrain/models/cost.py only: anywhere else a name for FLOPs holds what the cost model
# returned (a call), never arithmetic of its own.
COST_HOME = "models/cost.py"


def _flop_name(node) -> str | None:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name if name and "flop" in name.lower() else None


def _has_call(node) -> bool:
    return any(isinstance(n, ast.Call) for n in ast.walk(node))


def _reads_a_count(node) -> bool:
    """The expression reads a FLOP count already made (a rate or a share of it: ``flops / seconds``)."""
    return any(_flop_name(n) or (isinstance(n, ast.Constant) and isinstance(n.value, str) and "flop" in n.value)
               for n in ast.walk(node))


def flop_formulas(tree: ast.AST) -> list[int]:
    """Lines where a FLOP count is computed rather than asked of the cost model: a function named for FLOPs that calls
    nothing, or a value given to a name for FLOPs that is arithmetic without a call."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and "flop" in node.name.lower() and not _has_call(node):
            found.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_flop_name(t) for t in targets) and isinstance(node.value, ast.BinOp) \
                    and not _has_call(node.value) and not _reads_a_count(node.value):
                found.append(node.lineno)
    return found


def _formulas_outside_the_cost_model(root: Path) -> list[str]:
    return [f"{path.relative_to(root)}:{line}" for path in sorted(root.rglob("*.py"))
            if str(path.relative_to(root)) != COST_HOME for line in flop_formulas(ast.parse(path.read_text()))]


def test_no_second_flop_formula():
    assert not _formulas_outside_the_cost_model(Path(packtrain.__file__).parent)


def test_the_formula_check_fails_on_a_planted_second_formula(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "cost.py").write_text("def flops(p):\n    return 6 * p\n")  # the home may
    (tmp_path / "bench.py").write_text("def model_flops(text, positions):\n    return 4 * positions * text['w']\n")
    (tmp_path / "balance.py").write_text("def pack_cost(p, q, cost, s):\n    flops = 6 * p + 12 * q\n"
                                         "    total_flops = cost.flops(p, q)\n    rate_flops = total_flops / s\n"
                                         "    return flops + rate_flops\n")
    assert _formulas_outside_the_cost_model(tmp_path) == ["balance.py:2", "bench.py:1"]
