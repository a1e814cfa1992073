"""The context modes as strategies (packtrain/packed/context.py): one class per packing.context_grad, built from its
name once; what each answers without running a model (kv_only's kept rows, the rows a graph keeps, the context P
alone runs in). The gradients each mode computes are tests/packed/test_context_grad.py's, against the standalone
references."""

import pytest
import torch

from packtrain.packed.context import MODES, Frozen, Full, KvOnly, context_grad, keep_from


def test_each_mode_is_built_from_its_name_and_an_unknown_name_is_refused():
    assert MODES == ("full", "kv_only", "frozen")
    assert [type(context_grad(m)) for m in MODES] == [Full, KvOnly, Frozen]
    assert all(context_grad(m).name == m for m in MODES)
    with pytest.raises(ValueError, match=r"packing.context_grad: unknown value 'kv' \(full \| kv_only \| frozen\)"):
        context_grad("kv")


class _Layout:  # what keep_from reads of a PackLayout
    def __init__(self, prefix_len, target_positions):
        self.prefix_len, self.target_positions = prefix_len, torch.tensor(target_positions)


def test_kv_only_keeps_the_continuation_rows_and_p_last_row_in_the_last_layer_only_when_a_target_is_read_there():
    assert keep_from(_Layout(10, [12, 15, 20]), 4) == (10, 10, 10, 10)
    # a continuation without an item reads its first target off P's last row (9): the last layer keeps it
    assert keep_from(_Layout(10, [9, 15, 20]), 4) == (10, 10, 10, 9)


def test_the_rows_a_units_graph_keeps_under_each_mode():
    # 1,000 positions of which P is 600; groups: the largest group's 150 continuation rows
    assert Full().graph_rows(1000, 600, None) == (1000, 1000)
    assert KvOnly().graph_rows(1000, 600, None) == (1000, 1000)
    assert Frozen().graph_rows(1000, 600, None) == (400, 400)  # P under no_grad: only the continuations
    assert Full().graph_rows(1000, 600, 150) == (750, 600)
    assert Frozen().graph_rows(1000, 600, 150) == (150, 150)


def test_p_alone_runs_with_its_graph_cut_or_without_one():
    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    x = torch.randn(1, 3, 2, requires_grad=True)
    with Full().prefix_pass(layers, 3):
        assert layers[0](x).requires_grad
    with Frozen().prefix_pass(layers, 3):
        assert not layers[0](x).requires_grad
    assert Full().prefix_in_graph and KvOnly().prefix_in_graph and not Frozen().prefix_in_graph


def test_a_mode_the_support_table_refuses_is_an_assertion_here():
    with pytest.raises(AssertionError, match="not built for prefix trees"):
        KvOnly().tree_hidden_states(None, None, None)
    no_walk = [m for m in MODES if not context_grad(m).walks]
    assert no_walk  # a mode that does not walk exists (else the loop below checks nothing)
    for mode in no_walk:
        with pytest.raises(AssertionError, match="the support table refuses it"):
            context_grad(mode).check_walk()
    Full().check_walk()
