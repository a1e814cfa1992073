"""packtrain/packed/kernels/flex.py on CPU: the padded length as a table; each BlockMask (shared-prefix and prefix
tree) against a dense mask built here by hand from the pack's lengths or the tree's parents, padding rows included,
element by element and block by block; the mask made once per layout, its block dimensions marked dynamic; and
the attention through FlexAttention's eager forward (no compilation) against softmax attention under that mask. The
compiled path and its backward need CUDA (the last test). The compilation count: tests/packed/kernels/
test_flex_compile.py."""

import math
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from packtrain.packed.kernels import flex
from packtrain.packed.layout import Continuation, build_pack_layout
from packtrain.packed.tree import build_tree_layout

B = flex.FLEX_BLOCK

# (pack length T, the length FlexAttention runs at): whole 128-token blocks, at least two
PADDED = [(0, 2 * B), (1, 2 * B), (127, 2 * B), (128, 2 * B), (129, 2 * B), (256, 2 * B), (257, 3 * B), (384, 3 * B),
          (385, 4 * B), (8192, 8192), (8193, 8192 + B)]


@pytest.mark.parametrize("T, Tp", PADDED)
def test_padded_length(T, Tp):
    assert flex.padded_length(T) == Tp


# --- references built here ------------------------------------------------------------------------------------------


def _allowed(segments: list[int], visible) -> torch.Tensor:
    """[Tp, Tp] bool: causal, and ``visible[a][b]``: a query of segment a may read a key of segment b."""
    s = torch.tensor(segments)
    vis = torch.tensor(visible, dtype=torch.bool)
    return vis[s[:, None], s[None, :]] & torch.ones(len(s), len(s), dtype=torch.bool).tril()


def flat_reference(prefix_len: int, cont_lens: list[int]) -> torch.Tensor:
    """Segments 0 (P), 1..N (the continuations in order), N + 1 (padding up to padded_length): every query reads P
    and its own segment; padding reads P and padding, and no real query reads padding."""
    n, T = len(cont_lens), prefix_len + sum(cont_lens)
    segments = [0] * prefix_len + [i + 1 for i, c in enumerate(cont_lens) for _ in range(c)]
    segments += [n + 1] * (flex.padded_length(T) - T)
    visible = [[b == 0 or a == b for b in range(n + 2)] for a in range(n + 2)]
    return _allowed(segments, visible)


def tree_reference(layout, parents: list[int]) -> torch.Tensor:
    """Segments 0 (P), node + 1, N + 1 (padding): a query reads P, its node and the node's ancestors (walked up
    ``parents``); padding reads only padding, and no real query reads padding."""
    n, T = len(parents), layout.length

    def ancestors_or_self(node):
        while node >= 0:
            yield node
            node = parents[node]

    visible = [[False] * (n + 2) for _ in range(n + 2)]
    for a in range(n + 1):
        visible[a][0] = True
        for node in ancestors_or_self(a - 1):
            visible[a][node + 1] = True
    visible[n + 1][n + 1] = True
    segments = layout.segment_ids.tolist() + [n + 1] * (flex.padded_length(T) - T)
    return _allowed(segments, visible)


def blocks_of(allowed: torch.Tensor) -> torch.Tensor:
    """[nb, nb]: which 128 x 128 blocks hold any allowed pair."""
    nb = allowed.shape[0] // B
    return allowed.view(nb, B, nb, B).any(dim=3).any(dim=1)


def dense_of(bm) -> torch.Tensor:
    Tp = bm.seq_lengths[0]
    return create_mask(bm.mask_mod, 1, 1, Tp, Tp, device="cpu")[0, 0]


# --- packs ----------------------------------------------------------------------------------------------------------


def _tokens(n, first):
    return [first + i % 50 for i in range(n)]


# (P, continuations as (item, target) lengths): short, on the block edge, over several blocks with empty blocks below
# the diagonal (a late continuation never reads an early one's block), and one continuation
FLAT_PACKS = [(5, [(2, 3), (1, 1)]), (100, [(14, 14)]), (3, [(1, 124)]), (5, [(150, 150), (100, 100)]),
              (60, [(0, 1)] * 7 + [(40, 41)])]


def _flat(prefix_len, specs):
    conts = [Continuation(_tokens(i, 1), _tokens(t, 60)) for i, t in specs]
    return build_pack_layout(_tokens(prefix_len, 200), conts), [i + t for i, t in specs]


@pytest.mark.parametrize("prefix_len, specs", FLAT_PACKS)
def test_the_shared_prefix_mask_equals_the_hand_built_one(prefix_len, specs):
    layout, lens = _flat(prefix_len, specs)
    bm = flex.block_mask(layout, "cpu")
    Tp = flex.padded_length(layout.length)
    ref = flat_reference(prefix_len, lens)
    assert bm.seq_lengths == (Tp, Tp) and bm.BLOCK_SIZE == (B, B)
    assert torch.equal(dense_of(bm), ref)
    assert torch.equal(bm.to_dense()[0, 0].bool(), blocks_of(ref))  # no block that holds a pair skipped


def test_a_long_pack_skips_the_blocks_no_query_reads():
    layout, _ = _flat(5, [(150, 150), (100, 100)])  # P 5, A rows 5-304, B rows 305-504, padding 505-511
    blocks = flex.block_mask(layout, "cpu").to_dense()[0, 0].bool()
    assert blocks.shape == (4, 4) and not blocks[3, 1]  # B (and padding) never read A's rows 128-255
    assert blocks.tril().sum() == 9


# continuations of a prefix tree after P: nodes 0 (1, 2) -> {1 (3,) -> {2 (4, 5), 3 (6,)}, 4 (7, 8, 9)}; 5 (9, 9)
TREE = [Continuation([1, 2, 3], [4, 5]), Continuation([1, 2, 3], [6]), Continuation([1, 2], [7, 8, 9]),
        Continuation([9], [9])]
TREE_PARENTS = [-1, 0, 1, 1, 0, -1]


def _long_tree():
    """Three blocks and more: a long shared item, then two long answers and a long unrelated continuation."""
    item = _tokens(120, 1)
    return [Continuation(item, _tokens(90, 60)), Continuation(item, _tokens(60, 61)), Continuation([7] * 100, [8])]


@pytest.mark.parametrize("prefix_len, conts, parents", [(4, TREE, TREE_PARENTS), (3, TREE * 2, TREE_PARENTS),
                                                        (30, _long_tree(), [-1, 0, 0, -1])],
                         ids=["one block", "duplicates", "several blocks"])
def test_the_tree_mask_equals_the_hand_built_one(prefix_len, conts, parents):
    layout = build_tree_layout(_tokens(prefix_len, 200), conts)
    assert layout.parents == parents
    bm = flex.tree_block_mask(layout, "cpu")
    ref = tree_reference(layout, parents)
    assert bm.seq_lengths == (flex.padded_length(layout.length),) * 2
    assert torch.equal(dense_of(bm), ref)
    assert torch.equal(bm.to_dense()[0, 0].bool(), blocks_of(ref))


def test_each_mask_is_made_once_per_layout_at_the_padded_length(monkeypatch):
    made = []
    create = flex._create
    monkeypatch.setattr(flex, "_create", lambda mask_mod, Tp, device: made.append(Tp) or create(mask_mod, Tp, device))
    flat, _ = _flat(5, [(150, 150)])
    assert flex.block_mask(flat, "cpu") is flex.block_mask(flat, "cpu")
    tree = build_tree_layout([1, 2, 3], TREE)
    assert flex.tree_block_mask(tree, "cpu") is flex.tree_block_mask(tree, "cpu")
    assert made == [3 * B, 2 * B]


def test_the_block_dimensions_are_marked_dynamic():
    layout, _ = _flat(5, [(150, 150), (100, 100)])
    bm = flex.block_mask(layout, "cpu")
    tensors = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices, bm.q_num_blocks,
               bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]
    assert all(t is not None for t in tensors)
    for t in tensors:  # batch and head stay static
        assert getattr(t, "_dynamo_dynamic_indices", set()) == set(range(2, t.dim())), t.shape


def test_the_mask_is_compiled_only_for_long_packs(monkeypatch):
    """create_block_mask runs eagerly up to 8192 padded rows (compiling it costs more there) and compiled past it,
    always one batch row, every head alike, 128-token blocks."""
    calls = []

    def recording(mask_mod, batch, heads, q_len, kv_len, device, BLOCK_SIZE, _compile):
        calls.append((batch, heads, q_len, kv_len, BLOCK_SIZE, _compile))
        return type("NoBlocks", (), dict.fromkeys(["kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                                   "full_kv_indices", "q_num_blocks", "q_indices",
                                                   "full_q_num_blocks", "full_q_indices"]))()

    monkeypatch.setattr(flex, "create_block_mask", recording)
    for prefix_len in (10, 8192 - 3, 8192 + 10):
        flex.block_mask(_flat(prefix_len, [(1, 2)])[0], "cpu")
    assert calls == [(1, None, 256, 256, B, False), (1, None, 8192, 8192, B, False),
                     (1, None, 8192 + B, 8192 + B, B, True)]


# --- the attention (eager FlexAttention on CPU) ---------------------------------------------------------------------


def reference_attention(q, k, v, allowed, scale):
    """Softmax attention over the rows ``allowed`` [T, T] permits; k and v repeated for grouped heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, -math.inf)
    return scores.softmax(-1) @ v


def _qkv(T, heads, kv_heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, h, T, 16, generator=g) for h in (heads, kv_heads, kv_heads))


@pytest.fixture
def eager_flex(monkeypatch):
    """FlexAttention's unfused forward in place of the compiled one: the padding, masks and slicing around it are
    flex.py's; inductor's kernel is the GPU test's."""
    monkeypatch.setattr(flex, "_compiled_flex", flex._flex_attention)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


# (pack, query heads, key/value heads): grouped heads, as many, one key/value head for all
ATTENTION = [(FLAT_PACKS[3], 4, 2), (FLAT_PACKS[0], 2, 2), (FLAT_PACKS[0], 4, 1)]


@pytest.mark.parametrize("pack, heads, kv_heads", ATTENTION, ids=["several blocks", "no groups", "one kv head"])
def test_shared_prefix_attention_equals_the_masked_softmax(eager_flex, pack, heads, kv_heads):
    prefix_len, specs = pack
    layout, lens = _flat(prefix_len, specs)
    T = layout.length
    q, k, v = _qkv(T, heads, kv_heads)
    with torch.no_grad():
        got = flex.flex_attention(q, k, v, layout, 0.3, 0.0)  # not 1/sqrt(16): the scale given is the one used
    assert got.shape == (1, heads, T, 16)
    ref = reference_attention(q, k, v, flat_reference(prefix_len, lens)[:T, :T], 0.3)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_tree_attention_equals_the_masked_softmax(eager_flex):
    layout = build_tree_layout(_tokens(30, 200), _long_tree())
    T = layout.length
    q, k, v = _qkv(T, 4, 2, seed=1)
    with torch.no_grad():
        got = flex.tree_flex_attention(q, k, v, layout, 0.3, 0.0)
    ref = reference_attention(q, k, v, tree_reference(layout, layout.parents)[:T, :T], 0.3)
    assert got.shape == (1, 4, T, 16)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", [flex.flex_attention, flex.tree_flex_attention])
def test_attention_dropout_is_refused(eager_flex, attention):
    layout = build_tree_layout([1, 2, 3], TREE)
    q, k, v = _qkv(layout.length, 2, 2)
    with pytest.raises(ValueError, match="FlexAttention path: attention dropout is not supported"):
        attention(q, k, v, layout, 0.25, 0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: FlexAttention compiles and runs backward there")
def test_compiled_forward_and_backward_equal_the_masked_softmax_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    layout = _flat(5, [(150, 150), (100, 100)])[0].to("cuda")
    T = layout.length
    q, k, v = (x.cuda().requires_grad_() for x in _qkv(T, 4, 2))
    allowed = flat_reference(5, [300, 200])[:T, :T].cuda()
    results = []
    for fn in (lambda: flex.flex_attention(q, k, v, layout, 0.3, 0.0),
               lambda: reference_attention(q, k, v, allowed, 0.3)):
        out = fn()
        results.append((out.detach(), *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for got, ref in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
