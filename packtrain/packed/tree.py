"""A prefix tree of continuations in one buffer (``packing.mode: tree``): what continuations share beyond P is
computed once, and every example still trains exactly as if it were alone.

The continuations' tokens (item + target) form a radix tree (:func:`packtrain.data.prefix_tree.build_tree`): each example
is a path from P through nodes. The buffer is ``[P, node 0, node 1, ...]`` in depth-first order (a parent before
its children, every subtree contiguous). Segment ids are 0 on P and node + 1 on a node's tokens.

What makes each path compute its standalone ``concat(P, C)``:
- positions: a token's is the one it has alone (|P| + its depth on its path; M-RoPE coordinates of images from
  the example alone, :func:`packtrain.data.images.mrope_positions`);
- attention: a token reads P, its node's ancestors and its own node's earlier tokens (:func:`tree_attention`);
- Gated DeltaNet: a node's initial recurrent state is its parent's final state (P's for a child of P), and its
  conv history the last W-1 pre-conv inputs of its path (:func:`tree_gdn_forward`); autograd sums the gradients
  of every branch at every branch point (state, conv inputs, keys and values);
- targets: every example's loss tokens are read off its own path's rows, wherever they lie (an interior node's
  target is computed once and read by every example through it); each example keeps its own mean.

Only ``packing.context_grad: full``: kv_only and frozen cut at P's rows, which a tree does not single out.
Shape legend: T buffer, N nodes, S = T - |P| node tokens, H/G query/key heads, D head dim, HV/K/V GDN value heads
and key/value dims, C conv channels, W conv width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from packtrain.data.images import VisionSpec, mrope_positions
from packtrain.data.prefix_tree import Tree, build_tree
from packtrain.packed.attention import _padded, _sdpa, cheapest_runs
from packtrain.packed.gather import gather_rows
from packtrain.packed.gdn import (
    PREFIX_CHUNK,
    continuation_chunk,
    gdn_heads,
    gdn_output,
    gdn_projections,
)
from packtrain.packed.kernels import torch_ref
from packtrain.packed.layout import Continuation, PackLayout, _finish, _targets, check_pack, tree_allowed


@dataclass
class TreeLayout(PackLayout):
    """A :class:`~packtrain.packed.layout.PackLayout` whose segments are a prefix tree's nodes: ``segment_ids`` is
    0 on P and node + 1 on a node's rows, ``cont_lens``/``cu_seqlens`` are the nodes' lengths and buffer bounds
    (relative to the end of P), and the targets are those of every example (``num_examples`` = examples, not
    nodes)."""
    parents: list[int] = field(default_factory=list)  # per node: its parent node, -1 for a child of P
    depths: list[int] = field(default_factory=list)  # per node: how many nodes lie above it
    # [N + 1] per segment (0 = P): the last segment of its subtree (the predicate's ancestor test)
    last_segment: torch.Tensor | None = None
    paths: list[list[int]] = field(default_factory=list)  # per example (input order): the nodes it runs through
    image_sources: list[tuple[int, int]] = field(default_factory=list)  # per buffer image: (example, its k-th image)

    def span(self, node: int) -> tuple[int, int]:
        """The buffer rows [start, end) of ``node``."""
        cu = self.cu_seqlens_host
        return self.prefix_len + cu[node], self.prefix_len + cu[node + 1]

    def runs(self) -> list[tuple[int, int, int]]:
        """Chains of nodes that compute as one sequence: a node whose parent has no other child continues its
        parent's run (depth-first, it comes right after it in the buffer, and reads exactly its parent's final
        state and last rows, as the rest of one sequence does). A conversation's turns, one node each, are one run.
        Per run: (first node, last node, parent run; -1 under P)."""
        if "runs" not in self._cache:
            only_child = [0] * len(self.parents)
            for parent in self.parents:
                if parent >= 0:
                    only_child[parent] += 1
            runs: list[list[int]] = []
            run_of: list[int] = []
            for node, parent in enumerate(self.parents):
                if parent >= 0 and only_child[parent] == 1:
                    runs[run_of[parent]][1] = node
                    run_of.append(run_of[parent])
                else:
                    runs.append([node, node, run_of[parent] if parent >= 0 else -1])
                    run_of.append(len(runs) - 1)
            self._cache["runs"] = [tuple(r) for r in runs]
        return self._cache["runs"]

    def run_span(self, run: tuple[int, int, int]) -> tuple[int, int]:
        """The buffer rows [start, end) of a run (its nodes are contiguous)."""
        return self.span(run[0])[0], self.span(run[1])[1]

    def conv_histories(self, width: int) -> list[tuple[list[int], int, int]]:
        """P after W-1 zero rows; every node after the last W-1 rows of its path before it (P and its ancestors,
        which span several nodes where they are shorter than W-1; zero rows before the sequence start)."""
        h = width - 1
        out = [([-1] * h, 0, self.prefix_len)]
        before: list[list[int]] = []  # per node: the last h rows of its path up to its end
        for node, parent in enumerate(self.parents):
            start, end = self.span(node)
            history = before[parent] if parent >= 0 else [-1] * h + list(range(self.prefix_len))
            out.append((history[-h:] if h else [], start, end))
            before.append((history + list(range(start, end)))[-h:] if h else [])
        return out


def build_tree_layout(prefix_ids: Sequence[int], continuations: Sequence[Continuation],
                      vision: VisionSpec | None = None, image_keys: Sequence | None = None) -> TreeLayout:
    """The continuations' tokens as a prefix tree after P, laid out depth-first in one buffer.

    ``image_keys`` (per continuation, e.g. its ImageRefs): what its images are. Continuations share a node only
    where their tokens and image keys are equal; without keys a continuation with images shares nothing (equal
    image tokens are not equal pixels). The targets are every example's loss tokens (``Continuation.loss_spans``,
    in the input order), each read off the buffer row of the token before it on the example's own path: in the
    same node, its parent's last row, or P's last row for a path's first token."""
    check_pack(prefix_ids, continuations, vision)
    p = len(prefix_ids)
    tokens = [list(c.item_ids) + list(c.target_ids) for c in continuations]
    tree = build_tree(tokens, _salts(continuations, image_keys))
    lens = [len(n.tokens) for n in tree.nodes]
    starts = [p]
    for n in lens:
        starts.append(starts[-1] + n)
    # per example: the buffer row of each of its tokens, in path order
    rows = [[r for n in path for r in range(starts[n], starts[n + 1])] for path in tree.paths]
    positions = _positions(p, starts[-1], rows, tokens, continuations, vision)
    t_pos, t_ids, t_ex = [], [], []
    for j, c in enumerate(continuations):
        offsets, tok = _targets(0, c, -1)  # rows relative to the path: -1 is the token before the path
        t_pos.extend(rows[j][o] if o >= 0 else p - 1 for o in offsets)
        t_ids.extend(tok)
        t_ex.extend([j] * len(tok))
    sources = _image_sources(rows, tokens, continuations, vision)
    grids = [continuations[j].images[k] for j, k in sources]
    ids = list(prefix_ids) + [t for n in tree.nodes for t in n.tokens]
    segments = [0] * p + [i + 1 for i, n in enumerate(lens) for _ in range(n)]
    flat = _finish(p, lens, ids, positions, segments, t_pos, t_ids, t_ex, len(continuations), grids)
    return TreeLayout(**{f.name: getattr(flat, f.name) for f in dataclasses.fields(PackLayout)},
                      parents=[n.parent for n in tree.nodes], depths=_depths(tree),
                      last_segment=_last_segments(tree), paths=tree.paths, image_sources=sources)


def _salts(continuations: Sequence[Continuation], image_keys: Sequence | None) -> list:
    """build_tree's salts: continuations share only where their keys are equal (compared by their text form, which
    orders any keys: e.g. :func:`packtrain.data.prefix_tree.tree_salt`); without keys text-only ones share freely and one
    with images shares nothing."""
    if image_keys is not None:
        return [(1 if c.images else 0, str(key)) for c, key in zip(continuations, image_keys)]
    return [(2, str(i)) if c.images else (0, "") for i, c in enumerate(continuations)]


def _positions(p: int, length: int, rows, tokens, continuations, vision) -> list[list[int]]:
    """[3, T] M-RoPE coordinates (text: the position on all three axes): P's 0..|P|-1, and every node's from each
    example alone (:func:`~packtrain.data.images.mrope_positions` from |P|), written through its path's rows: any
    path through a node gives it the same coordinates (equal tokens and images before it)."""
    positions = [list(range(p)) + [0] * (length - p) for _ in range(3)]
    for path_rows, t, c in zip(rows, tokens, continuations):
        for axis, values in zip(positions, mrope_positions(t, c.images, vision, start=p)[0]):
            for r, v in zip(path_rows, values):
                axis[r] = v
    return positions


def _depths(tree: Tree) -> list[int]:
    depths: list[int] = []
    for n in tree.nodes:  # a parent comes before its children
        depths.append(depths[n.parent] + 1 if n.parent >= 0 else 0)
    return depths


def _last_segments(tree: Tree) -> torch.Tensor:
    """[N + 1]: per segment the last segment of its subtree (P's: the last node)."""
    last = list(range(len(tree.nodes) + 1))
    last[0] = len(tree.nodes)
    for i in reversed(range(len(tree.nodes))):  # children after parents: each child's subtree is final first
        parent = tree.nodes[i].parent
        if parent >= 0:
            last[parent + 1] = max(last[parent + 1], last[i + 1])
    return torch.tensor(last, dtype=torch.long)


def _image_sources(rows, tokens, continuations, vision) -> list[tuple[int, int]]:
    """The images in buffer order, each as (example, its k-th image): the order the vision encoder's batch and
    ``image_grid_thw`` take. An image block never straddles two nodes (paths that share part of it share it all:
    equal keys, equal grids), so each node's images are those whose first token it holds, from any path."""
    if vision is None:
        return []
    first: dict[int, tuple[int, int]] = {}  # buffer row of an image's first token -> its source
    for j, (path_rows, toks, c) in enumerate(zip(rows, tokens, continuations)):
        i, k = 0, 0
        while i < len(toks):
            if toks[i] == vision.image_token_id:
                first.setdefault(path_rows[i], (j, k))
                i += vision.tokens(c.images[k])
                k += 1
            else:
                i += 1
    return [first[r] for r in sorted(first)]


# -- attention ----------------------------------------------------------------------------------------------------
def tree_dense_mask(layout: TreeLayout) -> torch.Tensor:
    """[1, 1, T, T] boolean mask (True = attend) from :func:`~packtrain.packed.layout.tree_allowed`: the reference."""
    seg = layout.segment_ids
    idx = torch.arange(seg.numel(), device=seg.device)
    last = layout.last_segment.to(seg.device)
    return tree_allowed(seg[:, None], seg[None, :], idx[:, None], idx[None, :], last)[None, None]


@dataclass
class _Bucket:
    query: torch.Tensor  # [n, L] buffer row of each node's queries, T for padding
    keys: torch.Tensor  # [n, K] buffer rows a node's queries read (P, its ancestors, itself), T for padding
    mask: torch.Tensor  # [n, 1, L, K] causal within the node, everything before it on its path


def node_buckets(layout: TreeLayout) -> tuple[list[_Bucket], torch.Tensor]:
    """The tree's runs (:meth:`TreeLayout.runs`: chains of nodes) in padded batches of similar shape, and [S] the
    row of each node token in the buckets' concatenated outputs. A run's keys are its path: P, the runs above it,
    its own rows (gathered, so no [T, T] mask or score matrix exists). Grouped as the pack's buckets are:
    contiguous runs of them sorted by key count, minimising the padded work n x L x K (plus a call's overhead) per
    bucket."""
    if "node_buckets" in layout._cache:
        return layout._cache["node_buckets"]
    p, T = layout.prefix_len, layout.length
    runs = layout.runs()
    spans = [layout.run_span(run) for run in runs]
    keys: list[list[int]] = []  # per run: its path's rows up to its own end
    for (start, end), (_, _, parent) in zip(spans, runs):
        keys.append((keys[parent] if parent >= 0 else list(range(p))) + list(range(start, end)))
    lens = [end - start for start, end in spans]
    order = sorted(range(len(keys)), key=lambda i: -len(keys[i]))
    device = layout.input_ids.device
    buckets, unpad, row = [], [0] * (T - p), 0
    for group in cheapest_runs(order, [len(k) for k in keys], lens):
        L, K = max(lens[i] for i in group), len(keys[group[0]])
        query = torch.full((len(group), L), T, dtype=torch.long)
        key = torch.full((len(group), K), T, dtype=torch.long)
        mask = torch.zeros(len(group), 1, L, K, dtype=torch.bool)
        for r, i in enumerate(group):
            start, end = spans[i]
            query[r, :lens[i]] = torch.arange(start, end)
            key[r, :len(keys[i])] = torch.tensor(keys[i])
            unpad[start - p:end - p] = range(row + r * L, row + r * L + lens[i])
            # query t of run i is its path's key len(keys[i]) - lens[i] + t; padding queries see every real key
            q_at = torch.arange(L)[:, None] + len(keys[i]) - lens[i]
            k_at = torch.arange(K)[None, :]
            mask[r, 0] = (k_at <= q_at) & (k_at < len(keys[i]))
        row += len(group) * L
        buckets.append(_Bucket(query.to(device), key.to(device), mask.to(device)))
    layout._cache["node_buckets"] = buckets, torch.tensor(unpad, dtype=torch.long, device=device)
    return layout._cache["node_buckets"]


def attention_by_node(q_1HTD, k_1GTD, v_1GTD, layout: TreeLayout, scaling, dropout) -> torch.Tensor:
    """P causally once; the nodes in buckets (:func:`node_buckets`), each a padded batch of node queries against
    their paths' keys with a small mask. [1, H, T, D]."""
    p = layout.prefix_len
    out_P = _sdpa(q_1HTD[:, :, :p], k_1GTD[:, :, :p], v_1GTD[:, :, :p], None, scaling, dropout, is_causal=True)
    # [1, X, T, D] -> [T + 1, X, D]: the buffer's rows and a zero row at T, where every bucket's padding points
    q_T, k_T, v_T = (_padded(x[0].transpose(0, 1)) for x in (q_1HTD, k_1GTD, v_1GTD))
    buckets, unpad = node_buckets(layout)
    outs = []
    for b in buckets:
        # every run reads P's keys and its ancestors' rows: gathered so that their gradients add in a fixed order
        q_N = gather_rows(q_T, b.query).permute(0, 2, 1, 3)  # [n, H, L, D]
        k_N, v_N = (gather_rows(x, b.keys).permute(0, 2, 1, 3) for x in (k_T, v_T))  # [n, G, K, D]
        outs.append(_sdpa(q_N, k_N, v_N, b.mask, scaling, dropout).permute(0, 2, 1, 3).flatten(0, 1))
    out_S = torch.cat(outs).index_select(0, unpad)  # [S, H, D]
    return torch.cat([out_P[0].transpose(0, 1), out_S])[None].transpose(1, 2)


def tree_attention_dense(q_1HTD, k_1GTD, v_1GTD, layout: TreeLayout, scaling, dropout) -> torch.Tensor:
    """The [T, T] mask of the tree's predicate (the reference)."""
    return _sdpa(q_1HTD, k_1GTD, v_1GTD, tree_dense_mask(layout).to(q_1HTD.device), scaling, dropout)


def tree_attention_flex(q_1HTD, k_1GTD, v_1GTD, layout: TreeLayout, scaling, dropout) -> torch.Tensor:
    """FlexAttention with the predicate as a BlockMask (CUDA)."""
    from packtrain.packed.kernels import flex

    return flex.tree_flex_attention(q_1HTD, k_1GTD, v_1GTD, layout, scaling, dropout)


def tree_attention(module, q_1HTD, k_1GTD, v_1GTD, layout: TreeLayout, scaling, dropout) -> torch.Tensor:
    """A full-attention layer on a tree's buffer in the back end's kernel (``module.packtrain_kernels``, picked once:
    :func:`attention_by_node`, :func:`tree_attention_dense` or :func:`tree_attention_flex`). [1, H, T, D]."""
    return module.packtrain_kernels.tree_attention(q_1HTD, k_1GTD, v_1GTD, layout, scaling, dropout)


# -- Gated DeltaNet -----------------------------------------------------------------------------------------------
def tree_levels(layout: TreeLayout) -> tuple[list[tuple[torch.Tensor, list[int], torch.Tensor]], torch.Tensor]:
    """The tree's runs (:meth:`TreeLayout.runs`) by depth: per level (its runs' buffer rows [S_d] in order, their
    lengths, the row of each one's parent run among the previous level's final states: P's one state for level 0),
    and [S] the row of each node token in the levels' concatenated outputs (after P's)."""
    if "tree_levels" in layout._cache:
        return layout._cache["tree_levels"]
    p = layout.prefix_len
    runs = layout.runs()
    depth: list[int] = []
    for _, _, parent in runs:  # a parent run comes before its children
        depth.append(depth[parent] + 1 if parent >= 0 else 0)
    device = layout.input_ids.device
    levels, unpad, at, row_of = [], [0] * (layout.length - p), 0, {}
    for d in range(max(depth) + 1):
        level = [i for i in range(len(runs)) if depth[i] == d]
        spans = [layout.run_span(runs[i]) for i in level]
        rows = [r for start, end in spans for r in range(start, end)]
        for r in rows:
            unpad[r - p] = at
            at += 1
        parents = [row_of[runs[i][2]] if d else 0 for i in level]
        row_of.update((i, k) for k, i in enumerate(level))
        levels.append((torch.tensor(rows, dtype=torch.long, device=device), [end - start for start, end in spans],
                       torch.tensor(parents, dtype=torch.long, device=device)))
    layout._cache["tree_levels"] = levels, torch.tensor(unpad, dtype=torch.long, device=device)
    return layout._cache["tree_levels"]


def torch_rule(q, k, v, g, beta, initial_state, lengths, cache=None, key=None):
    """torch_ref's chunk rule on [1, S, ...]: from the zero state (P), or varlen from per-sequence initial states;
    (output, final states). ``cache`` and ``key`` are fla's (:func:`fla_backend.delta_rule`): the torch rule takes
    its bounds as a host list."""
    if lengths is None:
        return torch_ref.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, chunk_size=PREFIX_CHUNK)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch_ref.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                            cu_seqlens=cu, chunk_size=continuation_chunk(lengths))


def fla_rule(q, k, v, g, beta, initial_state, lengths, cache=None, key=None):
    """fla's chunk rule (:func:`packtrain.packed.kernels.fla_backend.delta_rule`), as :func:`torch_rule`."""
    from packtrain.packed.kernels import fla_backend

    return fla_backend.delta_rule(q, k, v, g, beta, initial_state, lengths, cache, key)


def tree_delta_rule(q_THK, k_THK, v_THV, g_TH, beta_TH, layout: TreeLayout, rule) -> torch.Tensor:
    """P from the zero state, then the tree level by level (:func:`tree_levels`): one varlen call per depth of
    runs, every run from its parent run's final state (gathered, so the gradients of all its children sum into
    it); ``rule``: the back end's (:func:`torch_rule`, :func:`fla_rule`). [T, HV, V]."""
    p = layout.prefix_len
    parts = [x[None, :p] for x in (q_THK, k_THK, v_THV, g_TH, beta_TH)]
    out_P, states = rule(*parts, None, None)
    levels, unpad = tree_levels(layout)
    outs = []
    for depth, (rows, lengths, parents) in enumerate(levels):
        parts = [x.index_select(0, rows)[None] for x in (q_THK, k_THK, v_THV, g_TH, beta_TH)]
        out, states = rule(*parts, gather_rows(states, parents), lengths, layout._cache, ("level", depth))
        outs.append(out[0])
    return torch.cat([out_P[0], torch.cat(outs).index_select(0, unpad)]).to(q_THK.dtype)


def tree_gdn_forward(module, hidden_states: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """``Qwen3_5GatedDeltaNet.forward`` / ``Qwen3NextGatedDeltaNet.forward`` (no cache, no padding mask) on a tree's
    buffer: every node's conv from its path's last W-1 inputs (``TreeLayout.conv_histories``), its delta rule from
    its parent's final state (:func:`tree_delta_rule`). [1, T, D]."""
    mixed_TC, z, b, a, weight_CW = gdn_projections(module, hidden_states)
    kernels = module.packtrain_kernels  # the back end's, picked once (packtrain.packed.patch.pick_kernels)
    conv_TC = kernels.conv(module, mixed_TC, weight_CW, layout)
    q, k, v, g, beta = gdn_heads(module, conv_TC, b, a)
    return gdn_output(module, tree_delta_rule(q, k, v, g, beta, layout, kernels.tree_rule), z)


# -- the pass and the call ----------------------------------------------------------------------------------------
@dataclass
class TreePass:
    """What the patched layers of a tree's forward read under the layout kwarg (the interface of
    :class:`~packtrain.packed.pack_pass.PackPass`). It travels in the decoder layers' keyword arguments, so a
    checkpointed layer's recompute rebuilds the same tree from the same object (and its cached indices)."""
    layout: TreeLayout

    def attention(self, module, query, key, value, scaling, dropout) -> torch.Tensor:
        return tree_attention(module, query, key, value, self.layout, scaling, dropout)

    def gated_deltanet(self, module, hidden_states: torch.Tensor) -> torch.Tensor:
        return tree_gdn_forward(module, hidden_states, self.layout)

    def grad_rows_from(self, layer_idx: int) -> int | None:
        return None  # every row may get gradient (context_grad full)
