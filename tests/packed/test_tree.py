"""Prefix trees (packtrain/packed/tree.py): every example of a tree pack trains exactly as if it were alone.

Per-example losses and every trainable gradient of one tree forward/backward (the update) equal those of the
examples run one by one through the model's own forward (``parity.standalone_run``), and the losses equal
transformers' own forward on each standalone sequence; on Qwen3.5 text, the vision-language model with images in
items, the MoE form and Qwen3-Next. The trees hold: nodes shorter than the conv width at several depths (a conv
history over three nodes), 1-token nodes, P shorter than the conv width, a node exactly one GDN chunk long and a
node ending exactly at transformers' chunk boundary, a target on an interior node (a path that is a prefix of
another's), duplicate examples, a path's first target read off P's last row, loss spans across node bounds.

Tolerances: float64 with the model's float32 casts removed (``without_float32_casts``), the bounds of
tests/test_parity.py: losses 1e-13, gradients 5e-7 (the GDN gate's ``a.float()`` stays, in both paths, at slightly
different inputs; the MoE router's float32 softmax likewise), losses vs transformers 1e-13 (its logits'
cross-entropy taken in float64). Measured worst cases over seeds 0-3 (text) and 0-2 (families, VLM) of these
fixtures: losses 4.9e-16 (text), 4.4e-16 (MoE, Qwen3-Next), 1.7e-15 (VLM); gradients 3.9e-8 (text, MoE), 4.3e-8
(Qwen3-Next), 2.3e-9 (VLM); vs transformers 6.2e-16 (text), 4.5e-16 (families), 1.9e-15 (VLM). A wrong parent
state, conv history, ancestor set, target row or position is orders of magnitude above (losses 4e-3 to 0.5,
gradients 0.1 to 5); the control below (as shipped), parent states detached, leaves the losses within float32
rounding (1.2e-7) and the gradients 0.67 off.
"""

import random

import pytest
import torch
from fla_interp import fla_cpu_backend, needs_interpreter
from mutations import long_memory_model
from parity import (
    max_rel,
    peft_lora_forward,
    rel,
    standalone_run,
    trainable_grads,
    transformers_mlp,
    without_float32_casts,
)
from tiny_models import patched_lora_model, tiny_family_model

from packtrain.models.wrap import checkpoint_decoder_layers
from packtrain.packed import tree as tree_module
from packtrain.packed.kernels import Backend
from packtrain.packed.layout import Continuation
from packtrain.packed.lm import PackedLM
from packtrain.packed.patch import patch_model, vision_spec
from packtrain.packed.lm import TreeCall
from packtrain.packed.tree import build_tree_layout

L, F = "linear_attention", "full_attention"
BACKEND = Backend(gdn="torch", attention="batched", mlp_rows=7, norm_rows=5)


def branches(seed=0, vocab=89):
    """P of 2 tokens and a tree of short nodes: s | [1] | [2] | {7.., 8..}, [9..] under [1], [4..] under s, and
    [s0] split off s by an example whose whole path is that one token."""
    rng = random.Random(seed)
    r = lambda n: [rng.randrange(10, vocab) for _ in range(n)]
    s, t0 = r(5), r(3)
    conts = [
        Continuation(s + [1, 2, 7], t0),
        Continuation(s + [1, 2, 8], r(2)),
        Continuation(s + [1, 9], r(4)),
        Continuation(s + [4], [5] + r(1)),
        Continuation(s + [1, 2, 7], t0),  # a duplicate of example 0
        Continuation(s + [1, 2, 7] + t0 + r(6), r(3)),  # example 0's path is a prefix of it: a target inside
        Continuation([], s[:1]),  # one token, read off P's last row
        Continuation([], [9] + r(2)),  # its first target off P's last row, its node after another subtree
        # loss spans on both sides of a branch point, inside example 3's path and after it
        Continuation(s + [4], [5] + r(6), spans=[(6, 8), (9, 12)]),
    ]
    return r(2), conts


def chunked(seed=0, vocab=89):
    """P of 40 and an item of 24 shared by all (its node ends at position 64, transformers' chunk boundary), then
    nodes exactly 16 tokens long (the tree's GDN chunk) and deeper ones under them."""
    rng = random.Random(seed)
    r = lambda n: [rng.randrange(10, vocab) for _ in range(n)]
    s, b1, b2 = r(24), [1] + r(15), [2] + r(15)
    return r(40), [Continuation(s + b1, [3] + r(4)), Continuation(s + b1, [4] + r(15)), Continuation(s + b2, r(3)),
                   Continuation(s + b2 + [5], r(20)), Continuation(s, [6] + r(2))]


def tree_run(model, prefix, conts, vision=None, pixels=None, image_keys=None, mode="full"):
    """One tree forward/backward: (per-example losses, trainable gradients, the layout)."""
    model.zero_grad(set_to_none=True)
    layout = build_tree_layout(prefix, conts, vision, image_keys)
    if layout.image_sources:
        layout.pixel_values = torch.cat([pixels[j][k] for j, k in layout.image_sources])
    out = PackedLM(model, mode, 0)(TreeCall(layout))
    out.loss_sum.backward()
    return out.per_example.tolist(), trainable_grads(model), layout


def check(model, prefix, conts, vision=None, pixels=None, image_keys=None):
    """(loss rel, gradient rel) of the tree against the examples alone; every gradient non-zero."""
    la, ga, _ = tree_run(model, prefix, conts, vision, pixels, image_keys)
    lb, gb = standalone_run(model, prefix, conts, vision, pixels)
    assert ga.keys() == gb.keys() and all(g.abs().max() > 0 for g in gb.values())
    return rel(torch.tensor(la, dtype=torch.float64), torch.tensor(lb, dtype=torch.float64)), max_rel(ga, gb), la


def hf_float64_losses(model, prefix, conts, pixels=None, image_token=None):
    """transformers' own forward (peft's LoRA forward, the MLPs whole) on each concat(P, C): the float64
    cross-entropy of its logits over the example's loss spans."""
    out = []
    with torch.no_grad(), peft_lora_forward(model), transformers_mlp(model):
        for j, c in enumerate(conts):
            ids = torch.tensor([list(prefix) + list(c.item_ids) + list(c.target_ids)])
            kw = {}
            if c.images:
                grids = torch.tensor([list(g) for g in c.images])
                kw = {"pixel_values": torch.cat(pixels[j]), "image_grid_thw": grids,
                      "mm_token_type_ids": (ids == image_token).int()}
            logits = model(input_ids=ids, **kw).logits[0]
            at = [len(prefix) + t for a, b in c.loss_spans() for t in range(a, b)]
            out.append(torch.nn.functional.cross_entropy(logits[[t - 1 for t in at]], ids[0, at]).item())
    return torch.tensor(out, dtype=torch.float64)


def test_layout_of_a_small_tree():
    """A literal table: P [50, 51]; examples [1, 2 | 3], [1, 2 | 4, 5], [1 | 6], [ | 8] (item | target)."""
    layout = build_tree_layout([50, 51], [Continuation([1, 2], [3]), Continuation([1, 2], [4, 5]),
                                          Continuation([1], [6]), Continuation([], [8])])
    assert layout.input_ids.tolist() == [[50, 51, 1, 2, 3, 4, 5, 6, 8]]
    assert layout.segment_ids.tolist() == [0, 0, 1, 2, 3, 4, 4, 5, 6]  # nodes [1] [2] [3] [4, 5] [6] [8]
    assert layout.parents == [-1, 0, 1, 1, 0, -1] and layout.depths == [0, 1, 2, 2, 1, 0]
    assert layout.last_segment.tolist() == [6, 5, 4, 3, 4, 5, 6]
    assert layout.paths == [[0, 1, 2], [0, 1, 3], [0, 4], [5]]
    assert layout.position_ids[:, 0].tolist() == [[0, 1, 2, 3, 4, 4, 5, 3, 2]] * 4
    # 3 <- [2]; 4 <- [2], 5 <- 4; 6 <- [1]; 8 <- P's last row
    assert layout.target_positions.tolist() == [3, 3, 5, 2, 1]
    assert layout.target_ids.tolist() == [3, 4, 5, 6, 8] and layout.target_example.tolist() == [0, 1, 1, 2, 3]
    assert layout.target_counts.tolist() == [1, 2, 1, 1] and layout.num_examples == 4
    # conv width 4: each node after its path's last 3 rows (-1: before the sequence)
    assert layout.conv_histories(4) == [([-1, -1, -1], 0, 2), ([-1, 0, 1], 2, 3), ([0, 1, 2], 3, 4),
                                        ([1, 2, 3], 4, 5), ([1, 2, 3], 5, 7), ([0, 1, 2], 7, 8), ([-1, 0, 1], 8, 9)]
    assert layout.runs() == [(0, 0, -1), (1, 1, 0), (2, 2, 1), (3, 3, 1), (4, 4, 0), (5, 5, -1)]  # no chains
    # a conversation: turn 1 [1 | 2], turn 2 [1, 2, 3 | 4] after it; its two nodes one run (one sequence)
    chain = build_tree_layout([50], [Continuation([1], [2]), Continuation([1, 2, 3], [4])])
    assert chain.parents == [-1, 0] and chain.runs() == [(0, 1, -1)] and chain.run_span(chain.runs()[0]) == (1, 5)
    moved = layout.to("cpu")  # a TreeLayout still, its tree with it
    assert moved.parents == layout.parents and torch.equal(moved.last_segment, layout.last_segment)
    assert moved.conv_histories(4) == layout.conv_histories(4)


@pytest.mark.parametrize("make,layer_types", [(branches, [L, F, L]), (chunked, [L, L, F])], ids=["branches", "chunked"])
def test_tree_equals_standalone_and_transformers(make, layer_types, monkeypatch):
    prefix, conts = make()
    with without_float32_casts(monkeypatch):
        model = patched_lora_model(layer_types, seed=1, backend=BACKEND)
        loss, grad, losses = check(model, prefix, conts)
        reference = hf_float64_losses(model, prefix, conts)
    assert loss < 1e-13 and grad < 5e-7, (loss, grad)
    assert rel(torch.tensor(losses, dtype=torch.float64), reference) < 1e-13


@pytest.mark.parametrize("model_type,layer_types", [("qwen3_5_moe_text", [L, F, L]), ("qwen3_next", [L, L, F])])
def test_tree_per_family(model_type, layer_types, monkeypatch):
    prefix, conts = branches(seed=2)
    with without_float32_casts(monkeypatch):
        model = patch_model(tiny_family_model(model_type, layer_types), BACKEND)
        loss, grad, losses = check(model, prefix, conts)
        reference = hf_float64_losses(model, prefix, conts)
    assert loss < 1e-13 and grad < 5e-7, (loss, grad)
    assert rel(torch.tensor(losses, dtype=torch.float64), reference) < 1e-13


def test_tree_with_images_in_items(monkeypatch):
    """Two examples with one image (equal keys) share its node and part at their targets; a third with another
    image of the same grid and the same tokens shares nothing with them; one without images shares P only."""
    from tiny_models import IMAGE, image_item, tiny_vlm

    gen = torch.Generator().manual_seed(0)
    rnd = lambda n: torch.randint(0, 89, (n,), generator=gen).tolist()
    prefix, before, after = rnd(9), rnd(3), rnd(2)
    item, px = image_item(before, [(1, 4, 6)], after, gen)
    _, other = image_item(before, [(1, 4, 6)], after, gen)
    item2, px2 = image_item(rnd(2), [(1, 4, 4), (1, 2, 4)], rnd(3), gen)
    conts = [Continuation(item, [1] + rnd(3), images=[(1, 4, 6)]), Continuation(item, [2] + rnd(4), images=[(1, 4, 6)]),
             Continuation(item, [1] + rnd(2), images=[(1, 4, 6)]), Continuation(rnd(4), rnd(3)),
             Continuation(item2, rnd(5), images=[(1, 4, 4), (1, 2, 4)])]
    pixels, keys = [px, px, other, [], px2], ["a", "a", "b", None, "c"]
    with without_float32_casts(monkeypatch):
        model = tiny_vlm(seed=0)
        spec = vision_spec(model)
        loss, grad, losses = check(model, prefix, conts, spec, pixels, keys)
        layout = build_tree_layout(prefix, conts, spec, keys)
        reference = hf_float64_losses(model, prefix, conts, pixels, IMAGE)
    assert layout.paths[0][0] == layout.paths[1][0] != layout.paths[2][0]  # the same image shares, another not
    assert sorted(layout.image_sources) == [(0, 0), (2, 0), (4, 0), (4, 1)]
    assert loss < 1e-13 and grad < 5e-7, (loss, grad)
    assert rel(torch.tensor(losses, dtype=torch.float64), reference) < 1e-13


def test_a_tree_cut_into_packs_trains_the_standalone_update(monkeypatch):
    """A tree cut into subtrees (the examples of one branch in one pack, the rest in another, as the planner cuts
    a tree over the token budget): the two packs' summed gradients and their losses are the examples' alone."""
    prefix, conts = branches(seed=6)
    cut = [0, 1, 4, 5]  # the subtree under s + [1, 2]
    with without_float32_casts(monkeypatch):
        model = patched_lora_model([L, F, L], seed=6, backend=BACKEND)
        parts = [[conts[i] for i in cut], [c for i, c in enumerate(conts) if i not in cut]]
        runs = [tree_run(model, prefix, part) for part in parts]
        lb, gb = standalone_run(model, prefix, [c for part in parts for c in part])
    la = [x for losses, _, _ in runs for x in losses]
    ga = {n: runs[0][1][n] + runs[1][1][n] for n in gb}
    assert rel(torch.tensor(la, dtype=torch.float64), torch.tensor(lb, dtype=torch.float64)) < 1e-13
    assert max_rel(ga, gb) < 5e-7


def test_checkpointed_layers_rebuild_the_same_tree(monkeypatch):
    """Activation checkpointing per decoder layer: the recompute reads the same TreePass, so losses and gradients
    are those without it, bit for bit, and those of the examples alone."""
    prefix, conts = branches(seed=3)
    with without_float32_casts(monkeypatch):
        model = patched_lora_model([L, F, L], seed=3, backend=BACKEND)
        la, ga, _ = tree_run(model, prefix, conts)
        checkpoint_decoder_layers(model)
        lb, gb, _ = tree_run(model, prefix, conts)
        loss, grad, _ = check(model, prefix, conts)
    gb = {n.replace("._checkpoint_wrapped_module", ""): g for n, g in gb.items()}  # the wrapper's name
    assert la == lb and ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)
    assert loss < 1e-13 and grad < 5e-7, (loss, grad)


def test_dense_reference_equals_the_cpu_path(monkeypatch):
    """The [T, T] mask built straight from the predicate and the nodes in buckets compute the same thing."""
    prefix, conts = branches(seed=4)
    results = []
    with without_float32_casts(monkeypatch):
        for attention in ("dense", "batched"):
            model = patched_lora_model([F, L, F], seed=4, backend=Backend(gdn="torch", attention=attention))
            results.append(tree_run(model, prefix, conts)[:2])
    (la, ga), (lb, gb) = results
    assert torch.allclose(torch.tensor(la, dtype=torch.float64), torch.tensor(lb, dtype=torch.float64), rtol=1e-13,
                          atol=0)
    for n in ga:
        assert torch.allclose(ga[n], gb[n], rtol=1e-10, atol=1e-14), n


def test_without_the_gradient_through_parent_states_the_update_differs(monkeypatch):
    """The control: each level's initial states detached from their parents' final states leave every loss as it
    was and the gradients wrong, which only the gradient check sees."""
    prefix, conts = branches(seed=5)
    from packtrain.packed import patch as patch_module

    conv, delta_rule, rule = patch_module.GDN_KERNELS["torch"]  # the kernels the patch picks for the torch back end
    monkeypatch.setitem(patch_module.GDN_KERNELS, "torch", (conv, delta_rule, lambda q, k, v, g, beta, state, lengths,
                                                            *cache: rule(q, k, v, g, beta, None if state is None
                                                                         else state.detach(), lengths)))
    model = patched_lora_model([L, F, L], seed=5, backend=BACKEND)
    loss, grad, _ = check(model, prefix, conts)
    assert loss < 1e-6 and grad > 1e-3, (loss, grad)


@pytest.mark.parametrize("mode", ["kv_only", "frozen"])
def test_context_grad_modes_other_than_full_are_refused(mode):
    """The support table refuses them before a run starts; the tree's forward asserts what the table says."""
    from packtrain.config import support

    assert support.refusals(support.Combination("tree", mode, False, 1, "sft")) == [
        f"packing.mode tree: packing.context_grad {mode} is not built (full only)"]
    prefix, conts = branches()
    model = patched_lora_model([L, F], seed=0, backend=BACKEND)
    with pytest.raises(AssertionError, match=f"packing.context_grad {mode} is not built for prefix trees"):
        PackedLM(model, mode)(TreeCall(build_tree_layout(prefix, conts)))


@needs_interpreter
def test_fla_tree_equals_the_torch_tree_and_standalone():
    """The fla back end on a tree (its varlen conv over the node histories, its chunk rule level by level from the
    parents' states) under Triton's interpreter, float32, within tests/packed/kernels/test_fla_interpreter_model.py's bounds
    (measured: losses 1.3e-7, gradients 1.4e-6 vs standalone, 1.2e-6 vs the torch tree)."""
    from fla_interp import GRAD_BOUND, LOSS_BOUND, SMALL_GDN

    prefix, conts = branches(seed=0)
    model = long_memory_model([L, F], dtype=torch.float32, seed=3, **SMALL_GDN)
    fla = tree_run(patch_model(model, fla_cpu_backend()), prefix, conts)[:2]
    references = (standalone_run(model, prefix, conts),
                  tree_run(patch_model(model, Backend("torch", "batched")), prefix, conts)[:2])
    for (lb, gb), name in zip(references, ("standalone", "torch tree")):
        loss = rel(torch.tensor(fla[0], dtype=torch.float64), torch.tensor(lb, dtype=torch.float64))
        grad = max_rel(fla[1], gb)
        assert loss < LOSS_BOUND and grad < GRAD_BOUND, (name, loss, grad)


def test_tree_block_mask_forward_on_cpu():
    """The tree's BlockMask (padding rows a segment of their own) through FlexAttention's eager forward on CPU, which
    has no backward there: == the nodes in buckets, float32 (measured 1.9e-7), over more than two 128-token
    blocks. The backward runs in the CUDA test below."""
    from torch.nn.attention.flex_attention import flex_attention

    from packtrain.packed.kernels import flex

    prefix, conts = chunked(seed=6)
    layout = build_tree_layout(prefix * 4, conts * 2)
    T = layout.length
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, T, 16, generator=gen) for h in (4, 2, 2))
    pad = (0, 0, 0, flex.padded_length(T) - T)
    with torch.no_grad():
        out = flex_attention(*(torch.nn.functional.pad(x, pad) for x in (q, k, v)),
                             block_mask=flex.tree_block_mask(layout, "cpu"), scale=0.25, enable_gqa=True)
        assert rel(out[:, :, :T], tree_module.attention_by_node(q, k, v, layout, 0.25, 0.0)) < 2e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_ancestor_mask_equals_the_cpu_path_on_cuda():
    """FlexAttention with the tree's BlockMask (float32, TF32 off) == the nodes in buckets, forward and backward,
    at a length over two 128-token blocks."""
    from packtrain.packed.kernels import flex

    torch.backends.cuda.matmul.allow_tf32 = False
    prefix, conts = chunked(seed=6)
    layout = build_tree_layout(prefix * 4, conts * 2).to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, layout.length, 16, device="cuda", generator=gen, requires_grad=True)
               for h in (4, 2, 2))
    grads = []
    for fn in (flex.tree_flex_attention, tree_module.attention_by_node):
        out = fn(q, k, v, layout, 0.25, 0.0)
        grads.append((out.detach(), *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for a, b in zip(*grads):
        assert rel(a, b) < 1e-5
