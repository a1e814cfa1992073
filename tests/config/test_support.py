"""The support table (packtrain/config/support.py): what packtrain builds of packing mode, context mode, the walk,
continuation groups, objective and images, as literal rows; the config refuses at load what the table refuses, and
the data's images at the session's start."""

import itertools

import pytest
from cli_helpers import run_in_process, write_config

from packtrain.config import ConfigError, load_config
from packtrain.config.support import Combination, built_context_grads, refusals, supported

MODES = ("shared_prefix", "standalone", "tree")
CONTEXTS = ("full", "kv_only", "frozen")
OBJECTIVES = ("sft", "weighted", "dpo", "grpo")


def test_what_is_built_row_by_row():
    """Every combination of the axes (images aside): the built ones listed here, by hand."""
    built = {(mode, context, walk, groups, objective)
             for mode, context, walk, groups, objective in itertools.product(MODES, CONTEXTS, (False, True), (1, 2),
                                                                             OBJECTIVES)
             if supported(Combination(mode, context, walk, groups, objective))}
    expected = set()
    for objective in OBJECTIVES:
        contexts = CONTEXTS if objective == "sft" else ("full",)
        walks = (False, True) if objective == "sft" else (False,)
        for context, walk in itertools.product(contexts, walks):
            if walk and context == "kv_only":
                continue
            expected.add(("standalone", context, walk, 1, objective))
            for groups in (1, 2) if objective not in ("dpo", "grpo") else (1,):
                expected.add(("shared_prefix", context, walk, groups, objective))
        expected.add(("tree", "full", False, 1, objective))
    assert built == expected


@pytest.mark.parametrize("combination,reasons", [
    (Combination("tree", "kv_only", True, 2, "sft"),
     ["packing.on_overflow: walk needs packing.context_grad full or frozen, not kv_only",
      "packing.mode tree: packing.context_grad kv_only is not built (full only)",
      "packing.mode tree: packing.on_overflow walk is not built (error or skip)",
      "packing.continuation_groups: groups a pack's continuations, so it needs packing.mode shared_prefix, got mode "
      "'tree' with 2 groups"]),
    (Combination("shared_prefix", "frozen", False, 3, "dpo", max_continuations=1),
     ["train.objective dpo: packing.context_grad frozen is not built for it (full only)",
      "train.objective dpo: packing.continuation_groups 3 is not built for it (a pair's loss needs both answers in "
      "one graph; set 1)",
      "train.objective dpo: packing.max_continuations must be at least 2 (a pair's two answers are in one pack), "
      "got 1"]),
    (Combination("shared_prefix", "full", False, 2, "sft", images=True),
     ["has images, and packing.continuation_groups > 1 takes text-only data (set packing.continuation_groups: 1)"]),
])
def test_each_refusal_says_why(combination, reasons):
    assert refusals(combination) == reasons


def test_built_context_grads_by_mode():
    assert built_context_grads("shared_prefix") == ("full", "kv_only", "frozen")
    assert built_context_grads("tree") == ("full",)


def test_the_config_refuses_what_the_table_refuses(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write_config(tmp_path, packing={"mode": "tree", "context_grad": "frozen"}))
    assert "packing.mode tree: packing.context_grad frozen is not built (full only)" in e.value.problems


def test_images_with_groups_are_refused_at_start_naming_the_file(tmp_path):
    from cli_helpers import REPO

    proc = run_in_process("plan", str(REPO / "configs" / "vlm_demo.yaml"), "--set", "packing.continuation_groups=2",
                          check=False)
    assert proc.returncode == 2
    assert "vlm_demo/train.jsonl: has images, and packing.continuation_groups > 1 takes text-only data" in proc.stderr
