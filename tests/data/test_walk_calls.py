"""The walk's calls from the plan alone (packtrain/data/walk_calls.py) as literal tables worked by hand: the chunks
over a continuation, each finite-horizon window and the no-grad pieces between the cuts, and the padding every rank
applies. The walk those calls run: tests/packed/test_walk.py."""

import pytest

from packtrain.data.walk_calls import WalkCalls, WalkSpec, chunk_bounds, cuts, walk_calls, windows


@pytest.mark.parametrize("p, end, chunk, expected", [
    (4, 24, 8, [(4, 12), (12, 20), (20, 24)]),
    (4, 20, 8, [(4, 12), (12, 20)]),  # the last chunk full
    (3, 4, 8, [(3, 4)]),
    (5, 5, 8, []),
])
def test_chunks_cover_the_continuation(p, end, chunk, expected):
    assert chunk_bounds(p, end, chunk) == expected


# P of 4, a continuation of 21 tokens: positions 4..24 read targets (the last token is read by none), chunks of 8
# [4, 12) [12, 20) [20, 24); horizon 3 reaches back to 1, 9 and 17
@pytest.mark.parametrize("item_len, horizon, frozen, expected_windows, expected_cuts", [
    (5, 3, False, [(1, 4, 12), (9, 12, 20), (17, 20, 24)], [0, 1, 4, 9, 12, 17, 20, 24]),
    # no item: P's last row reads the first target, so P is a window of its own
    (0, 3, False, [(0, 0, 4), (1, 4, 12), (9, 12, 20), (17, 20, 24)], [0, 1, 4, 9, 12, 17, 20, 24]),
    # frozen: P is a constant, windows start at |P| at the earliest, and P has no window
    (0, 3, True, [(4, 4, 12), (9, 12, 20), (17, 20, 24)], [0, 4, 9, 12, 17, 20, 24]),
    (5, 0, False, [(4, 4, 12), (12, 12, 20), (20, 20, 24)], [0, 4, 12, 20, 24]),  # the draft walk
    (5, 50, False, [(0, 4, 12), (0, 12, 20), (0, 20, 24)], [0, 4, 12, 20, 24]),  # a horizon past P's start
])
def test_windows_and_cuts_by_hand(item_len, horizon, frozen, expected_windows, expected_cuts):
    spec = WalkSpec(8, horizon)
    assert windows(4, item_len, 21, spec, frozen) == expected_windows
    assert cuts(4, item_len, 21, spec, frozen) == expected_cuts
    # one no-grad forward per piece between cuts, one backward per window
    assert walk_calls(4, item_len, 21, spec, frozen) == WalkCalls(3, len(expected_cuts) - 1, len(expected_windows))


def test_horizon_all_is_one_forward_and_one_backward_per_chunk():
    assert walk_calls(4, 0, 21, WalkSpec(8, None)) == WalkCalls(3, 3, 3)
    assert walk_calls(10, 2, 41, WalkSpec(8, None), frozen=True) == WalkCalls(5, 5, 5)  # 10..50: 5 chunks


def test_ranks_pad_each_field_to_the_largest():
    assert WalkCalls(3, 7, 3).pad(WalkCalls(4, 4, 5)) == WalkCalls(4, 7, 5)
