"""FlexAttention for packs (CUDA): one BlockMask per pack from the shared-prefix predicate (a prefix tree's from its
ancestor predicate), and one compilation of
``flex_attention`` for every pack length. Forward-only on CPU (no backward there), which is how the compilation
count is tested on CPU (tests/packed/kernels/test_flex_compile.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask
from torch.nn.attention.flex_attention import flex_attention as _flex_attention

from packtrain.packed.layout import PackLayout, shared_prefix_allowed, tree_allowed

FLEX_BLOCK = 128  # FlexAttention's block size (create_block_mask's default)
_compiled_flex = torch.compile(_flex_attention, dynamic=True)


def padded_length(T: int) -> int:
    """The length FlexAttention runs at: a whole number of its 128-token blocks, at least two. Compiled with
    ``dynamic=True``, a first pack of one block would be specialised to that one block (and recompiled at the next
    size), and lengths off the block grid add guards on ``T % 128``: on the grid, one compilation serves every pack."""
    return max(2, -(-T // FLEX_BLOCK)) * FLEX_BLOCK


def _mark_block_dims_dynamic(bm) -> None:
    """dynamic=True leaves the BlockMask's block-count dimensions static: the first compilation is specialised to
    the first pack's number of blocks and the next size recompiles ("block_mask.q_indices size mismatch"). Marked
    dynamic from the start (valid: padded_length gives at least two blocks), one compilation serves every pack."""
    for t in (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
              bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices):
        if t is not None:
            for dim in range(2, t.dim()):
                torch._dynamo.mark_dynamic(t, dim)


def _create(mask_mod, Tp: int, device):
    bm = create_block_mask(mask_mod, 1, None, Tp, Tp, device=device, BLOCK_SIZE=FLEX_BLOCK, _compile=Tp > 8192)
    _mark_block_dims_dynamic(bm)
    return bm


def block_mask(layout: PackLayout, device):
    if "block_mask" not in layout._cache:
        T = layout.length
        Tp = padded_length(T)
        # Padding rows get segment -1: real queries never see them (they lie after every real query, and the
        # predicate is causal); padding queries see P and each other, so no row is empty, and are dropped.
        seg = F.pad(layout.segment_ids.to(device), (0, Tp - T), value=-1)

        def mask_mod(b, h, q_idx, kv_idx):
            return shared_prefix_allowed(seg[q_idx], seg[kv_idx], q_idx, kv_idx)

        layout._cache["block_mask"] = _create(mask_mod, Tp, device)
    return layout._cache["block_mask"]


def tree_block_mask(layout, device):
    """A prefix tree's BlockMask (a :class:`~packtrain.packed.tree.TreeLayout`): the ancestor predicate
    :func:`~packtrain.packed.layout.tree_allowed`, reading each row's node (segment) and the last segment of each
    subtree. Padding rows form one more segment N + 1 after every node, a subtree of its own: real queries never
    see it (no node lies under it), its queries see only each other (causal: none is empty), and are dropped."""
    if "tree_block_mask" not in layout._cache:
        T = layout.length
        Tp = padded_length(T)
        n = int(layout.last_segment.numel())  # segments: P and the nodes
        seg = F.pad(layout.segment_ids.to(device), (0, Tp - T), value=n)
        last = torch.cat([layout.last_segment.to(device), torch.tensor([n], device=device)])

        def mask_mod(b, h, q_idx, kv_idx):
            return tree_allowed(seg[q_idx], seg[kv_idx], q_idx, kv_idx, last)

        layout._cache["tree_block_mask"] = _create(mask_mod, Tp, device)
    return layout._cache["tree_block_mask"]


def _run(q_1HTD, k_1GTD, v_1GTD, bm, scaling, dropout):
    if dropout:
        raise ValueError("FlexAttention path: attention dropout is not supported (Qwen3.5 uses none)")
    T = q_1HTD.shape[2]
    pad = (0, 0, 0, padded_length(T) - T)
    q, k, v = (F.pad(x, pad) for x in (q_1HTD, k_1GTD, v_1GTD))
    out = _compiled_flex(q, k, v, block_mask=bm, scale=scaling, enable_gqa=k_1GTD.shape[1] != q_1HTD.shape[1])
    return out[:, :, :T]


def flex_attention(q_1HTD, k_1GTD, v_1GTD, layout: PackLayout, scaling, dropout):
    return _run(q_1HTD, k_1GTD, v_1GTD, block_mask(layout, q_1HTD.device), scaling, dropout)


def tree_flex_attention(q_1HTD, k_1GTD, v_1GTD, layout, scaling, dropout):
    """A prefix tree's attention (CUDA), one BlockMask per tree pack (:func:`tree_block_mask`)."""
    return _run(q_1HTD, k_1GTD, v_1GTD, tree_block_mask(layout, q_1HTD.device), scaling, dropout)
