"""packing.context_grad (packtrain/packed/context.py): full | kv_only | frozen.

Each mode packed equals the same mode standalone (per-example losses, every LoRA gradient); frozen equals
transformers' own cache path (losses, logits and, with torch's mutation-on-saved-tensors mode, gradients); kv_only
equals an independent cut written with plain hooks on transformers' model; kv_only's forward is full's, bitwise;
the three modes learn different things; checkpointing and offload change nothing; each mode has a leak its check
catches.

Tolerances (float64 with the model's float32 casts removed, `without_float32_casts`), measured over CASES and the
VLM fixture: packed vs standalone losses <= 9e-16 in every mode; gradients 5.6e-8 (full), 1.7e-9 (kv_only),
1.1e-14 (frozen); frozen vs transformers' cache path: losses and logits 1e-15, gradients 1e-14; kv_only vs the
hook reference: gradients 1.7e-9 (full's GDN gate `a.float()` rounding). Bounds: losses 1e-13, gradients 5e-7
(full's bound in tests/packed/test_parity.py); leaks are >= 1e-3.
"""

import copy

import pytest
import torch
import torch.nn.functional as F_
from parity import (
    compare,
    max_rel,
    packed_run,
    rel,
    standalone_run,
    trainable_grads,
    transformers_mlp,
    without_float32_casts,
)
from tiny_models import patched_lora_model, random_pack, tiny_lora_model

from packtrain.models.offload import ChunkPool
from packtrain.models.wrap import checkpoint_decoder_layers, offload_decoder_layers
from packtrain.packed import context as context_module
from packtrain.packed.kernels import Backend
from packtrain.packed.layout import build_pack_layout
from packtrain.packed.lm import PackCall, PackedLM
from packtrain.packed.patch import text_parts, unwrap

L, F = "linear_attention", "full_attention"
MODES = ["full", "kv_only", "frozen"]
# (prefix length, [(item length, target length), ...], layer types): P shorter than the conv tail, P = W-1, P on a
# GDN chunk boundary; continuations of one token, with no item (the first target is read off P's last row), across
# chunk boundaries, many and uneven.
CASES = [
    (1, [(0, 1), (5, 3), (70, 4)], [F, L, L, F]),
    (3, [(0, 2), (2, 1), (130, 70)], [L, L, F, L]),
    (64, [(63, 2), (65, 6), (3, 1)], [L, F, L, F]),
    (65, [(0, 1), (3, 1), (70, 5), (130, 20), (10, 1)], [L, F, L, L, F]),
]
IDS = [f"P{c[0]}-n{len(c[1])}" for c in CASES]


def _model(layer_types, seed=0, attention="batched", mlp_rows=None):
    return patched_lora_model(layer_types, seed=seed,
                              backend=Backend(gdn="torch", attention=attention, mlp_rows=mlp_rows,
                                              norm_rows=mlp_rows and 5))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefix_len,specs,layer_types", CASES, ids=IDS)
def test_each_mode_packed_equals_the_same_mode_standalone(mode, prefix_len, specs, layer_types, monkeypatch):
    with without_float32_casts(monkeypatch):
        model = _model(layer_types, seed=prefix_len)
        prefix, conts = random_pack(prefix_len, specs, seed=prefix_len)
        d = compare(model, prefix, conts, context_grad=mode)
    assert d.loss < 1e-13, d
    assert d.grad < 5e-7, d


@pytest.mark.parametrize("mode", ["kv_only", "frozen"])
def test_each_mode_with_the_loss_in_chunks_of_5_rows(mode, monkeypatch):
    """train.loss_chunk_rows 5; frozen's constant rows (targets read off P's last row) inside the chunks."""
    prefix_len, specs, layer_types = CASES[3]
    with without_float32_casts(monkeypatch):
        model = _model(layer_types, seed=prefix_len)
        prefix, conts = random_pack(prefix_len, specs, seed=prefix_len)
        d = compare(model, prefix, conts, context_grad=mode, loss_chunk_rows=5)
    assert d.loss < 1e-13 and d.grad < 5e-7, d


@pytest.mark.parametrize("attention", ["dense", "batched"])
def test_kv_only_and_frozen_with_the_dense_reference_attention(attention, monkeypatch):
    with without_float32_casts(monkeypatch):
        model = _model([F, L, F], seed=4, attention=attention)
        prefix, conts = random_pack(20, [(0, 2), (9, 3), (1, 1)], seed=4)
        for mode in ("kv_only", "frozen"):
            d = compare(model, prefix, conts, context_grad=mode)
            assert d.loss < 1e-13 and d.grad < 5e-7, (mode, d)


def _targets_from(ids_logits, item_len, target_ids):
    """Cross-entropy of the targets from logits whose row j predicts token j of [item ; target] (row 0: P's last)."""
    rows = ids_logits[item_len:item_len + len(target_ids)]
    return F_.cross_entropy(rows, torch.tensor(target_ids))


def _hf_frozen(model, prefix, conts, with_grad=False):
    """seed 000 with transformers' own cache path: P under no_grad with use_cache, then each continuation against a
    copy of the cache. With ``with_grad`` the continuation's loss is backpropagated: torch's
    ``allow_mutation_on_saved_tensors`` lets transformers update its cache in place (FACTS.md) while autograd keeps
    what it saved. Returns (per-example losses, per-continuation logits, summed gradients or None)."""
    model.zero_grad(set_to_none=True)
    with torch.no_grad(), transformers_mlp(model):
        first = model(input_ids=torch.tensor([prefix]), use_cache=True)
    losses, logits = [], []
    for c in conts:
        cache = copy.deepcopy(first.cache)
        ids = torch.tensor([list(c.item_ids) + list(c.target_ids)])
        with torch.autograd.graph.allow_mutation_on_saved_tensors() if with_grad else torch.no_grad(), \
                transformers_mlp(model):
            out = model(input_ids=ids, cache=cache, use_cache=True)
            rows = torch.cat([first.logits[0, -1:], out.logits[0]])  # row j predicts token j of the continuation
            loss = _targets_from(rows, len(c.item_ids), list(c.target_ids))
            if with_grad:
                loss.backward()
        losses.append(loss.item())
        logits.append(out.logits[0].detach())
    return losses, logits, trainable_grads(model) if with_grad else None


@pytest.mark.parametrize("prefix_len,specs,layer_types", CASES[:2] + CASES[3:], ids=IDS[:2] + IDS[3:])
def test_frozen_equals_transformers_cache_path(prefix_len, specs, layer_types, monkeypatch):
    with without_float32_casts(monkeypatch):
        model = _model(layer_types, seed=prefix_len)
        prefix, conts = random_pack(prefix_len, specs, seed=prefix_len)
        ref_losses, ref_logits, ref_grads = _hf_frozen(model, prefix, conts, with_grad=True)
        losses, grads = packed_run(model, prefix, conts, context_grad="frozen")
        # the forward: every continuation position's logits from the pack
        lm = PackedLM(model, "frozen")
        with torch.no_grad():
            hidden, _, _ = lm.context.hidden_states(lm, build_pack_layout(prefix, conts))
            packed_logits = text_parts(model)[1](hidden[0, 1:]).split([len(c) for c in conts])
    assert rel(torch.tensor(losses), torch.tensor(ref_losses)) < 1e-13
    for a, b in zip(packed_logits, ref_logits):
        assert rel(a, b) < 1e-13
    assert max_rel(grads, ref_grads) < 5e-7


def _hook_cut_reference(model, prefix, conts):
    """kv_only written independently: transformers' own forward on concat(P, C) (the loss from its logits in their
    dtype: ``labels`` would compute it in float32), and a pre-hook on every decoder layer that detaches P's rows of
    its input."""
    model.zero_grad(set_to_none=True)
    p = len(prefix)

    def detach_prefix(module, args):
        h = args[0]
        return (torch.cat([h[:, :p].detach(), h[:, p:]], dim=1),) + tuple(args[1:])

    layers = text_parts(model)[0].layers
    handles = [layer.register_forward_pre_hook(detach_prefix) for layer in layers]
    try:
        losses = []
        with transformers_mlp(model):
            for c in conts:
                ids = torch.tensor([list(prefix) + list(c.item_ids) + list(c.target_ids)])
                logits = model(input_ids=ids).logits[0, p - 1:]  # row j predicts token j of the continuation
                loss = _targets_from(logits, len(c.item_ids), list(c.target_ids))
                loss.backward()
                losses.append(loss.item())
    finally:
        for h in handles:
            h.remove()
    return losses, trainable_grads(model)


@pytest.mark.parametrize("prefix_len,specs,layer_types", CASES, ids=IDS)
def test_kv_only_equals_an_independent_hook_cut(prefix_len, specs, layer_types, monkeypatch):
    with without_float32_casts(monkeypatch):
        model = _model(layer_types, seed=prefix_len)
        prefix, conts = random_pack(prefix_len, specs, seed=prefix_len)
        ref_losses, ref_grads = _hook_cut_reference(model, prefix, conts)
        losses, grads = packed_run(model, prefix, conts, context_grad="kv_only")
    assert rel(torch.tensor(losses), torch.tensor(ref_losses)) < 1e-13
    assert max_rel(grads, ref_grads) < 5e-7


@pytest.mark.parametrize("mlp_rows", [7, 16, 64])
def test_kv_only_with_the_dense_mlp_in_blocks_equals_the_hook_cut(mlp_rows, monkeypatch):
    """CPU runs a pack's dense MLP in blocks of rows: blocks wholly in P, across P's end and after it (P 40 here;
    the CPU default is 512 rows, and P over 512 or a buffer over 512 once met the same boundaries)."""
    with without_float32_casts(monkeypatch):
        model = patched_lora_model([L, F, L], seed=2,
                                   backend=Backend(gdn="torch", attention="batched", mlp_rows=mlp_rows))
        prefix, conts = random_pack(40, [(0, 3), (20, 9), (33, 12)], seed=2)
        ref_losses, ref_grads = _hook_cut_reference(model, prefix, conts)
        losses, grads = packed_run(model, prefix, conts, context_grad="kv_only")
    assert rel(torch.tensor(losses), torch.tensor(ref_losses)) < 1e-13
    assert max_rel(grads, ref_grads) < 5e-7


@pytest.mark.parametrize("run", [packed_run, standalone_run], ids=["packed", "standalone"])
def test_kv_only_forward_is_full_bitwise_and_the_modes_learn_differently(run):
    model = _model([L, F, L, F], seed=5)
    prefix, conts = random_pack(65, [(0, 2), (70, 4), (10, 3)], seed=5)
    lf, gf = run(model, prefix, conts, context_grad="full")
    lk, gk = run(model, prefix, conts, context_grad="kv_only")
    _, gz = run(model, prefix, conts, context_grad="frozen")
    assert lk == lf  # bitwise
    assert max_rel(gk, gf) > 1e-2 and max_rel(gk, gz) > 1e-2 and max_rel(gz, gf) > 1e-2
    layout = build_pack_layout(prefix, conts)
    hidden = {}
    for mode in ("full", "kv_only"):
        lm = PackedLM(model, mode)
        hidden[mode] = lm.context.hidden_states(lm, layout)[0]
    assert torch.equal(hidden["full"], hidden["kv_only"])


def _prefix_embedding_grad(model, prefix, conts, mode):
    """|gradient| on P's rows of the embedding output (decoder layer 0's input) of one packed backward."""
    seen = []
    embed = text_parts(model)[0].embed_tokens

    def keep(module, args, out):
        out.retain_grad()
        seen.append(out)

    handle = embed.register_forward_hook(keep)
    try:
        packed_run(model, prefix, conts, context_grad=mode)
    finally:
        handle.remove()
    return float(seen[0].grad[0, :len(prefix)].abs().max())


def test_kv_only_cuts_the_embedding_rows_of_p():
    model = _model([L, F], seed=6)
    prefix, conts = random_pack(20, [(5, 2), (9, 3)], seed=6)
    assert _prefix_embedding_grad(model, prefix, conts, "full") > 1e-6
    assert _prefix_embedding_grad(model, prefix, conts, "kv_only") == 0.0


@pytest.mark.parametrize("mlp_rows", [None, 7], ids=["mlp-whole", "mlp-tiles-7"])
@pytest.mark.parametrize("mode", ["kv_only", "frozen"])
@pytest.mark.parametrize("wrap", ["checkpoint", "offload", "offload 2 of 3"])
def test_checkpointing_and_offload_change_nothing(mode, wrap, mlp_rows):
    """Bit for bit, whole and partial offload; with MLP and norm tiles, each tile's recompute runs inside the
    layer's."""
    prefix, conts = random_pack(65, [(0, 1), (70, 5), (10, 2)], seed=7)
    plain = _model([L, F, L], seed=3, mlp_rows=mlp_rows)
    wrapped = _model([L, F, L], seed=3, mlp_rows=mlp_rows)
    if wrap == "checkpoint":
        checkpoint_decoder_layers(wrapped)
    else:
        offload_decoder_layers(wrapped, ChunkPool(4096), 2 if wrap == "offload 2 of 3" else None)
    la, ga = packed_run(plain, prefix, conts, context_grad=mode)
    lb, gb = packed_run(wrapped, prefix, conts, context_grad=mode)
    assert la == lb
    gb = {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in gb.items()}
    assert ga.keys() == gb.keys()
    for n in ga:
        assert torch.equal(ga[n], gb[n]), n


def _saved_rows(model, prefix, conts, mode):
    """The sizes of every tensor autograd saves in one packed forward."""
    sizes = []

    def pack(t):
        sizes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        PackedLM(model, mode)(PackCall(build_pack_layout(prefix, conts)))
    return sizes


def test_frozen_keeps_nothing_of_p_for_backward():
    """With P = 130 and continuations of 3 + 4 tokens, a saved tensor with a dimension >= 130 holds P's rows: full
    saves many (the check can fail), frozen saves only the constant K/V the continuations attend to."""
    model = _model([L, F], seed=8)
    prefix, conts = random_pack(130, [(1, 2), (2, 2)], seed=8)
    full = [s for s in _saved_rows(model, prefix, conts, "full") if max(s, default=0) >= 130]
    frozen = [s for s in _saved_rows(model, prefix, conts, "frozen") if max(s, default=0) >= 130]
    assert len(full) > 20
    # the one attention layer's constant keys and values of P as rows [P, G, D], once (attention.py's split attention
    # reads them in place; the padded-bucket path it replaced saved [N, H, P + L, D] copies)
    assert frozen == [(130, 2, 16), (130, 2, 16)], frozen


# -- leaks: each mode's packed-vs-standalone check fails on a broken variant ---------------------------------------
def _diff(monkeypatch, mode, specs=((0, 2), (70, 4), (10, 3)), attention="batched"):
    with without_float32_casts(monkeypatch):
        model = _model([L, F, L], seed=2, attention=attention)
        prefix, conts = random_pack(65, list(specs), seed=5)
        return compare(model, prefix, conts, context_grad=mode)


def test_clean_modes_pass(monkeypatch):
    for mode in ("kv_only", "frozen"):
        d = _diff(monkeypatch, mode)
        assert d.loss < 1e-13 and d.grad < 5e-7, (mode, d)


def test_kv_only_skipping_the_last_rows_of_p_is_caught(monkeypatch):
    # row-sparse backward from P in every layer, although a continuation without an item reads P's last row
    monkeypatch.setattr(context_module, "keep_from", lambda layout, n: (layout.prefix_len,) * n)
    d = _diff(monkeypatch, "kv_only")
    assert d.loss < 1e-13, "the forward is unchanged"
    assert d.grad > 1e-3, d


def test_kv_only_dropping_continuation_rows_is_caught(monkeypatch):
    # row-sparse backward that starts one row late: the first continuation's first row loses its gradient
    monkeypatch.setattr(context_module, "keep_from", lambda layout, n: (layout.prefix_len + 1,) * n)
    d = _diff(monkeypatch, "kv_only", specs=((3, 2), (70, 4), (10, 3)))
    assert d.loss < 1e-13 and d.grad > 1e-3, d


def test_frozen_state_not_carried_is_caught(monkeypatch):
    # the continuations start from a zero GDN state instead of P's
    from packtrain.packed.prefix import PrefixState

    original = PrefixState.conv_and_state

    def zero_state(self, layer_idx, width):
        tail, state = original(self, layer_idx, width)
        return tail, torch.zeros_like(state)

    monkeypatch.setattr(PrefixState, "conv_and_state", zero_state)
    d = _diff(monkeypatch, "frozen")
    assert d.loss > 1e-6 and d.grad > 1e-3, d


def test_frozen_continuations_seeing_each_other_is_caught(monkeypatch):
    from packtrain.packed import attention

    monkeypatch.setattr(attention, "shared_prefix_allowed", lambda sq, skv, q, kv: kv <= q)
    d = _diff(monkeypatch, "frozen", attention="dense")
    assert d.loss > 1e-6 and d.grad > 1e-3, d


# -- VLM ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["kv_only", "frozen"])
def test_vlm_each_mode_packed_equals_standalone(mode, monkeypatch):
    from tiny_models import tiny_vlm, vlm_pack

    from packtrain.packed.patch import vision_spec

    with without_float32_casts(monkeypatch):
        model = tiny_vlm(1)
        prefix, conts, pixels = vlm_pack(1)
        d = compare(model, prefix, conts, vision_spec(model), pixels, context_grad=mode)
    assert d.loss < 1e-13 and d.grad < 1e-9, d  # tests/packed/test_vlm.py's exact bounds
    assert unwrap(model).config.image_token_id in [t for c in conts for t in c.item_ids]


def test_unknown_mode_is_a_clear_error():
    from packtrain.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="packing.context_grad"):
        config_from_dict({"packing": {"context_grad": "partial"}})
    with pytest.raises(ValueError, match="context_grad"):
        PackedLM(tiny_lora_model([L]), "partial")


def test_frozen_pack_with_nothing_to_learn_still_runs_its_backward():
    """Every target read off P's last row: under frozen no gradient reaches anything, yet the loss can be
    backpropagated (FSDP needs every rank's backward) and gives zero gradients; the loss is full's."""
    model = _model([L, F], seed=9)
    prefix, conts = random_pack(20, [(0, 1), (0, 1)], seed=9)
    losses, grads = packed_run(model, prefix, conts, context_grad="frozen")
    full_losses, _ = packed_run(model, prefix, conts, context_grad="full")
    assert rel(torch.tensor(losses), torch.tensor(full_losses)) < 1e-6  # float32 casts in transformers' P pass
    assert all(g.abs().max() == 0 for g in grads.values())


def test_each_mode_answers_what_the_estimates_ask():
    """The three strategies: whether P gets gradient, the rows a unit's graph keeps and a layer's recompute holds
    (P 10 and 30 continuation rows; in groups the largest group 12), the estimate's note; an unknown name refused."""
    from packtrain.packed.context import context_grad

    full, kv_only, frozen = (context_grad(m) for m in MODES)
    assert (full.prefix_in_graph, kv_only.prefix_in_graph, frozen.prefix_in_graph) == (True, True, False)
    for mode in (full, kv_only):
        assert mode.graph_rows(40, 10, None) == (40, 40) and mode.graph_rows(40, 10, 12) == (22, 12)
    assert frozen.graph_rows(40, 10, None) == (30, 30) and frozen.graph_rows(40, 10, 12) == (12, 12)
    assert [m.estimate_note() for m in (full, kv_only, frozen)] == ["", "; context_grad kv_only",
                                                                   "; context_grad frozen"]
    assert (full.walks, kv_only.walks, frozen.walks) == (True, False, True)
    # the support table refuses the walk under kv_only before a run starts (tests/config/test_support.py); the
    # runtime check is an assertion of it
    with pytest.raises(AssertionError, match="walk under packing.context_grad kv_only"):
        kv_only.check_walk()
    with pytest.raises(ValueError, match="unknown value 'none'"):
        context_grad("none")
