"""The pack layout as literal tables."""

import torch

from packtrain.packed.layout import Continuation, build_pack_layout, build_standalone_layout, dense_mask


def test_pack_layout_table():
    # P = [10, 11, 12]; C1 = item [20] + target [21, 22]; C2 = no item + target [30]
    lay = build_pack_layout([10, 11, 12], [Continuation([20], [21, 22]), Continuation([], [30])])
    assert lay.input_ids.tolist() == [[10, 11, 12, 20, 21, 22, 30]]
    assert lay.segment_ids.tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert lay.position_ids[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 3]  # every continuation starts at |P|
    assert (lay.position_ids == lay.position_ids[:1]).all()  # text: the same value on every M-RoPE axis
    assert lay.position_ids.shape == (4, 1, 7)
    assert lay.cu_seqlens.tolist() == [0, 3, 4]
    assert lay.cu_seqlens_host == [0, 3, 4]
    # target 21 is predicted at buffer index 3 (token 20), 22 at 4; C2's first token from P's last token (2)
    assert lay.target_positions.tolist() == [3, 4, 2]
    assert lay.target_ids.tolist() == [21, 22, 30]
    assert lay.target_example.tolist() == [0, 0, 1]
    assert lay.target_counts.tolist() == [2, 1]
    assert lay.conv_tail_index(4).tolist() == [0, 1, 2]  # P's last 3 tokens
    assert lay.conv_tail_index(2).tolist() == [2]
    assert lay.conv_tail_index(6).tolist() == [-1, -1, 0, 1, 2]  # P shorter than W-1: zero history first


def test_dense_mask_table():
    lay = build_pack_layout([1, 2], [Continuation([3], [4]), Continuation([], [5])])
    expected = [
        # P0 P1 A0 A1 B0
        [1, 0, 0, 0, 0],  # P0
        [1, 1, 0, 0, 0],  # P1
        [1, 1, 1, 0, 0],  # A0
        [1, 1, 1, 1, 0],  # A1
        [1, 1, 0, 0, 1],  # B0: all of P, nothing of A
    ]
    assert dense_mask(lay)[0, 0].int().tolist() == expected


def test_standalone_layout_table():
    lay = build_standalone_layout([10, 11], Continuation([20, 21], [22]))
    assert lay.input_ids.tolist() == [[10, 11, 20, 21, 22]]
    assert lay.position_ids[0, 0].tolist() == [0, 1, 2, 3, 4]
    assert lay.target_positions.tolist() == [3]
    assert lay.target_counts.tolist() == [1]
    assert lay.cont_lens == [] and lay.segment_ids.tolist() == [0] * 5


def test_layout_rejects_empty_parts():
    import pytest

    with pytest.raises(ValueError, match="non-empty prefix"):
        build_pack_layout([], [Continuation([1], [2])])
    with pytest.raises(ValueError, match="empty target"):
        build_pack_layout([1], [Continuation([1], [])])


def test_layout_to_device_keeps_values():
    lay = build_pack_layout([1, 2, 3], [Continuation([4], [5])])
    moved = lay.to(torch.device("cpu"))
    assert torch.equal(moved.target_positions, lay.target_positions) and moved.cont_lens == lay.cont_lens
