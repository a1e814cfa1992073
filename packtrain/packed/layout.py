"""The layout of one pack in one buffer: ``[P, C1, ..., Cn]`` (batch 1).

Every continuation Ci keeps the positions it has in its standalone example ``concat(P, Ci)``: P takes
0..|P|-1 and every Ci starts again at |P|. Positions are carried in the M-RoPE form the model takes
(``[4, 1, T]``: row 0 the text position, rows 1-3 temporal/height/width; text tokens have the same value on
every axis) so image tokens can later get their own coordinates without changing the layout.

Shape legend: T buffer length, N continuations, M target tokens (the loss tokens: each continuation's whole target,
or its loss spans), W conv kernel.

A standalone layout is the same structure for one example alone: the whole sequence is one causal segment and the
model runs unmodified on it (:class:`packtrain.packed.lm.StandaloneCall`; a pack runs in a
:class:`~packtrain.packed.lm.PackCall`). The layout does not say which: the call does.

A layout describes the buffer only. How a packed forward's kernels run on it (P's state read from outside,
kv_only's kept rows, a generation's record) is the :class:`~packtrain.packed.pack_pass.PackPass` that carries it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from packtrain.data.images import VisionSpec, mrope_positions


@dataclass
class Continuation:
    item_ids: Sequence[int]
    target_ids: Sequence[int]
    images: Sequence[Sequence[int]] = ()  # (T, H, W) patch grid of each image in the continuation, in order
    # the loss spans [a, b) over item + target, in order, none in the item; (): the whole target (one span)
    spans: Sequence[tuple[int, int]] = ()

    def __len__(self) -> int:
        return len(self.item_ids) + len(self.target_ids)

    def loss_spans(self) -> list[tuple[int, int]]:
        if not self.spans:
            return [(len(self.item_ids), len(self))] if self.target_ids else []
        spans = [(int(a), int(b)) for a, b in self.spans]
        ends = [len(self.item_ids)] + [x for span in spans for x in span] + [len(self)]
        if any(x > y for x, y in itertools.pairwise(ends)) or any(a == b for a, b in spans):
            raise ValueError(f"loss spans {spans} are not ordered, non-empty and inside the target "
                             f"[{len(self.item_ids)}, {len(self)})")
        return spans


@dataclass
class PackLayout:
    prefix_len: int  # |P|, in a pack and in a standalone layout alike
    cont_lens: list[int]  # host copy of continuation lengths (empty for standalone)
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [4, 1, T]
    segment_ids: torch.Tensor  # [T]: 0 on P, i (1-based) on continuation i
    cu_seqlens: torch.Tensor  # [N+1] int32, continuation boundaries relative to the end of P
    target_positions: torch.Tensor  # [M] buffer index of the token *before* each target token
    target_ids: torch.Tensor  # [M]
    target_example: torch.Tensor  # [M] which example (0-based) each target token belongs to
    target_counts: torch.Tensor  # [N_examples] target tokens per example
    image_grid_thw: torch.Tensor | None = None  # [images, 3] in buffer order, None for text-only
    pixel_values: torch.Tensor | None = None  # [patches, dim], filled in by the image loader
    _cache: dict = field(default_factory=dict, repr=False)  # per-pack objects built once (e.g. a BlockMask)

    @property
    def num_examples(self) -> int:
        return int(self.target_counts.numel())

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def cu_seqlens_host(self) -> list[int]:
        out = [0]
        for n in self.cont_lens:
            out.append(out[-1] + n)
        return out

    def conv_tail_index(self, width: int) -> torch.Tensor:
        """[W-1] buffer indices of P's last W-1 tokens, the conv history every continuation starts from; -1 where
        P is shorter than W-1 (a zero row: the zero history P itself starts from)."""
        key = ("conv_tail", width)
        if key not in self._cache:
            p = self.prefix_len
            idx = [max(i, -1) for i in range(p - (width - 1), p)]
            self._cache[key] = torch.tensor(idx, dtype=torch.long, device=self.input_ids.device)
        return self._cache[key]

    def conv_histories(self, width: int) -> list[tuple[list[int], int, int]]:
        """Per segment, in buffer order: (the buffer rows its conv reads before it, -1 for a zero row; its first and
        end row). P starts from W-1 zero rows; every continuation from P's last W-1 rows (its standalone history)."""
        tail = self.conv_tail_index(width).tolist()
        p = self.prefix_len
        return [([-1] * (width - 1), 0, p)] + [(tail, p + a, p + b) for a, b in
                                               zip(self.cu_seqlens_host, self.cu_seqlens_host[1:])]

    def to(self, device: torch.device | str) -> "PackLayout":
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()
                 if k != "_cache"}
        return type(self)(**moved)


def _targets(offset: int, c: Continuation, prefix_last: int) -> tuple[list[int], list[int]]:
    """The buffer rows the loss tokens are read off, and the loss tokens, of a continuation at ``offset``."""
    # The hidden state at position j predicts token j+1: a target token at buffer index t is read off t-1.
    # A continuation's first token is predicted from P's last token, which in a pack is not the buffer slot
    # before it (that is the previous continuation's last token).
    ids = list(c.item_ids) + list(c.target_ids)
    rows, tokens = [], []
    for a, b in c.loss_spans():
        rows.extend(range(offset + a - 1, offset + b - 1))
        tokens.extend(ids[a:b])
    if rows and rows[0] == offset - 1:
        rows[0] = prefix_last
    return rows, tokens


def check_pack(prefix_ids: Sequence[int], continuations: Sequence[Continuation], vision: VisionSpec | None,
               targets: bool = True) -> None:
    """What every pack needs (a flat one or a prefix tree): a non-empty, text-only P, and continuations that are
    not empty, with a target unless ``targets`` is False."""
    if len(prefix_ids) == 0:
        raise ValueError("a pack needs a non-empty prefix P")
    if not continuations:
        raise ValueError("a pack needs at least one continuation")
    if vision is not None and vision.image_token_id in prefix_ids:
        raise ValueError("P must be text-only: image tokens in the shared prefix are not supported")
    for i, c in enumerate(continuations):
        if targets and len(c.target_ids) == 0:
            raise ValueError(f"continuation {i} has an empty target")
        if len(c) == 0:
            raise ValueError(f"continuation {i} is empty")


def build_pack_layout(prefix_ids: Sequence[int], continuations: Sequence[Continuation],
                      vision: VisionSpec | None = None, targets: bool = True) -> PackLayout:
    """Lay out P once followed by every continuation, each keeping its standalone positions. ``targets=False``:
    continuations that are items alone (a generation's prompt), none of them empty."""
    check_pack(prefix_ids, continuations, vision, targets)
    p = len(prefix_ids)
    ids = list(prefix_ids)
    positions = [list(range(p)) for _ in range(3)]
    segments = [0] * p
    t_pos: list[int] = []
    t_ids: list[int] = []
    t_ex: list[int] = []
    lens = []
    for i, c in enumerate(continuations):
        offset = len(ids)
        n = len(c)
        lens.append(n)
        ids.extend(c.item_ids)
        ids.extend(c.target_ids)
        # local origin at zero, then |P| on all three axes = the coordinates of concat(P, Ci)
        coords, _ = mrope_positions(list(c.item_ids) + list(c.target_ids), c.images, vision, start=p)
        for axis, values in zip(positions, coords):
            axis.extend(values)
        segments.extend([i + 1] * n)
        pos, tokens = _targets(offset, c, p - 1)
        t_pos.extend(pos)
        t_ids.extend(tokens)
        t_ex.extend([i] * len(tokens))
    grids = [g for c in continuations for g in c.images]
    layout = _finish(p, lens, ids, positions, segments, t_pos, t_ids, t_ex, len(continuations), grids)
    return layout


def build_standalone_layout(prefix_ids: Sequence[int], continuation: Continuation,
                            vision: VisionSpec | None = None) -> PackLayout:
    """One example alone: ``concat(P, C)`` as a single causal sequence from position 0."""
    ids = list(prefix_ids) + list(continuation.item_ids) + list(continuation.target_ids)
    t_pos, t_ids = _targets(len(prefix_ids), continuation, len(prefix_ids) - 1)
    n = len(ids)
    positions, _ = mrope_positions(ids, continuation.images, vision)
    return _finish(len(prefix_ids), [], ids, positions, [0] * n, t_pos, t_ids, [0] * len(t_ids), 1,
                   list(continuation.images))


def _finish(p, lens, ids, positions, segments, t_pos, t_ids, t_ex, n_examples, grids=()) -> PackLayout:
    thw = torch.tensor(positions, dtype=torch.long)  # [3, T]: temporal, height, width
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    # each example's target rows together, in example order: the loss sums them per example in sequence
    assert all(a <= b for a, b in zip(t_ex, t_ex[1:])), "target rows out of example order"
    ex = torch.tensor(t_ex, dtype=torch.long)
    return PackLayout(
        prefix_len=p,
        cont_lens=list(lens),
        input_ids=torch.tensor([ids], dtype=torch.long),
        # row 0 is the "text position" transformers' mask builder would read (it never sees a pack); 1-3 M-RoPE
        position_ids=torch.cat([thw[:1], thw])[:, None, :].clone(),
        segment_ids=torch.tensor(segments, dtype=torch.long),
        cu_seqlens=cu,
        target_positions=torch.tensor(t_pos, dtype=torch.long),
        target_ids=torch.tensor(t_ids, dtype=torch.long),
        target_example=ex,
        target_counts=torch.bincount(ex, minlength=n_examples),
        image_grid_thw=torch.tensor([list(g) for g in grids], dtype=torch.long) if grids else None,
    )


def shared_prefix_allowed(seg_q: torch.Tensor, seg_kv: torch.Tensor, q_idx: torch.Tensor,
                          kv_idx: torch.Tensor) -> torch.Tensor:
    """The shared-prefix predicate: causal, and a key is visible if it is in P or in the query's own segment."""
    return (kv_idx <= q_idx) & ((seg_kv == 0) | (seg_kv == seg_q))


def tree_allowed(seg_q: torch.Tensor, seg_kv: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor,
                 last: torch.Tensor) -> torch.Tensor:
    """The prefix-tree predicate (:mod:`packtrain.packed.tree`): causal, and a key is visible if its segment is the
    query's own or an ancestor of it (P, segment 0, is everyone's). Segments are numbered depth-first with every
    subtree contiguous, so ``a`` is ``b``'s ancestor-or-self exactly when ``a <= b <= last[a]``, ``last[a]`` the
    last segment of ``a``'s subtree: one lookup per pair, no [segments, segments] table."""
    return (kv_idx <= q_idx) & (seg_kv <= seg_q) & (seg_q <= last[seg_kv])


def dense_mask(layout: PackLayout) -> torch.Tensor:
    """[1, 1, T, T] boolean mask (True = attend) built from :func:`shared_prefix_allowed`."""
    seg = layout.segment_ids
    idx = torch.arange(seg.numel(), device=seg.device)
    allowed = shared_prefix_allowed(seg[:, None], seg[None, :], idx[:, None], idx[None, :])
    return allowed[None, None]
