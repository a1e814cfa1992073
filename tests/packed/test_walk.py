"""The walk (packing.on_overflow: walk; packtrain/packed/walk.py, packtrain/data/walk_calls.py), float64.

horizon all equals the model's own forward and backward on concat(P, C) (losses and every LoRA gradient); a finite
horizon H (0 included) equals an independent reference written on transformers' own cache path: per segment, the
positions more than H before its start run under no_grad into a DynamicCache and the rest of the window with grad
against it. Shapes: P shorter than the conv width, P of one token, chunk boundaries on and off the GDN kernel's
64-token chunks, one-token chunks (the token-by-token rule), a first target read off P's last row.

Tolerances (float64 with the model's float32 casts removed), measured over CASES: horizon all vs standalone,
losses 3.6e-16, gradients 1.6e-13; finite H vs the reference 1.8e-16 / 6.6e-14. Bounds 1e-12 and 1e-10 (summation order
differs: chunk boundaries, the loss summed per window); the leaks (a constant cache where a gradient is due) are
>= 1e-3.
"""

import pytest
import torch
import torch.nn.functional as F_
from parity import max_rel, rel, standalone_run, trainable_grads, transformers_mlp, without_float32_casts
from tiny_models import patched_lora_model, random_pack, with_lora_dropout

from packtrain.data.jsonl import Example
from packtrain.data.planner import plan_packs, plan_stats
from packtrain.data.walk_calls import WalkCalls, WalkSpec, chunk_bounds, walk_calls
from packtrain.packed import context as context_module
from packtrain.packed.kernels import Backend
from packtrain.packed.layout import build_standalone_layout
from packtrain.packed.lm import PackedLM
from packtrain.packed.patch import text_parts
from packtrain.packed.walk import train_walk
from packtrain.run.step import rank_units
from packtrain.run.units import Kinds, Unit, WalkKind

L, F = "linear_attention", "full_attention"
# (P, item, target, chunk, layer types)
CASES = [
    (1, 20, 30, 16, [L, F, L]),  # P of one token, shorter than the conv width
    (2, 0, 40, 7, [L, L, F]),  # P shorter than the conv width; first target read off P's last row
    (64, 10, 120, 64, [F, L, L]),  # chunk boundaries on the GDN kernel's 64-token chunks
    (5, 30, 40, 1, [L, F]),  # one-token chunks: transformers' token-by-token rule
    (9, 70, 60, 50, [L, F, L, F]),  # boundaries off the kernel chunk
]
IDS = [f"P{c[0]}-i{c[1]}-t{c[2]}-c{c[3]}" for c in CASES]


def _model(layer_types, seed):
    return patched_lora_model(layer_types, seed=seed,
                              backend=Backend(gdn="torch", attention="batched", mlp_rows=7, norm_rows=5))


def walk_run(model, prefix, cont, spec, context_grad="full", loss_chunk_rows=0):
    model.zero_grad(set_to_none=True)
    lm = PackedLM(model, context_grad, loss_chunk_rows)
    layout = build_standalone_layout(prefix, cont)
    sched = walk_calls(len(prefix), len(cont.item_ids), len(cont), spec, context_grad == "frozen")
    out = train_walk(lm, layout, spec, 1.0, sched)
    return out.loss, trainable_grads(model)


def truncated_reference(model, prefix, cont, chunk, horizon, frozen=False):
    """Independent of packtrain's walk: transformers' DynamicCache, one no_grad prefill per segment."""
    with transformers_mlp(model):
        model.zero_grad(set_to_none=True)
        body, head = text_parts(model)
        ids = torch.tensor([list(prefix) + list(cont.item_ids) + list(cont.target_ids)])
        p, n = len(prefix), len(cont.target_ids)
        read = torch.arange(n) + p + len(cont.item_ids) - 1  # position whose logit predicts each target
        targets = torch.tensor(list(cont.target_ids))
        lo = p if frozen else 0
        segments = [(0, p)] if not cont.item_ids and not frozen else []
        segments += chunk_bounds(p, ids.shape[1] - 1, chunk)
        total = 0.0
        for a, e in segments:
            w = max(lo, a - horizon)
            cache = None
            if w > 0:
                with torch.no_grad():
                    cache = body(input_ids=ids[:, :w], use_cache=True).cache
                context_module._differentiable(cache)
            hidden = body(input_ids=ids[:, w:e], cache=cache, use_cache=True,
                          position_ids=torch.arange(w, e)[None]).last_hidden_state[0]
            mine = (read >= a) & (read < e)
            loss = F_.cross_entropy(head(hidden[read[mine] - w]), targets[mine], reduction="sum") / n
            loss.backward()
            total += float(loss.detach())
        if frozen and not cont.item_ids:  # the target read off P's last row: counted, no gradient
            with torch.no_grad():
                hidden = body(input_ids=ids[:, :p]).last_hidden_state[0]
                total += float(F_.cross_entropy(head(hidden[p - 1:p]), targets[:1], reduction="sum")) / n
    return total, trainable_grads(model)


def _check(la, ga, lb, gb, loss_tol, grad_tol):
    assert ga.keys() == gb.keys() and ga
    for name, g in gb.items():
        assert g.abs().max() > 0, f"zero reference gradient for {name}"
    assert abs(la - lb) / abs(lb) < loss_tol, (la, lb)
    worst = max_rel(ga, gb)
    assert worst < grad_tol, worst


@pytest.mark.parametrize("p,item,target,chunk,layer_types", CASES, ids=IDS)
def test_horizon_all_equals_the_whole_example_standalone(p, item, target, chunk, layer_types, monkeypatch):
    with without_float32_casts(monkeypatch):
        model = _model(layer_types, seed=p)
        prefix, (cont,) = random_pack(p, [(item, target)], seed=p)
        la, ga = walk_run(model, prefix, cont, WalkSpec(chunk, None))
        (lb,), gb = standalone_run(model, prefix, [cont])
    _check(la, ga, lb, gb, 1e-12, 1e-10)


@pytest.mark.parametrize("horizon", [None, 5])
def test_windows_with_the_loss_in_chunks_of_5_rows(horizon, monkeypatch):
    """train.loss_chunk_rows 5: a window's targets in several chunks (and a window with none)."""
    p, item, target, chunk, layer_types = CASES[4]
    with without_float32_casts(monkeypatch):
        model = _model(layer_types, seed=p)
        prefix, (cont,) = random_pack(p, [(item, target)], seed=p)
        la, ga = walk_run(model, prefix, cont, WalkSpec(chunk, horizon), loss_chunk_rows=5)
        if horizon is None:
            (lb,), gb = standalone_run(model, prefix, [cont])
        else:
            lb, gb = truncated_reference(model, prefix, cont, chunk, horizon)
    _check(la, ga, lb, gb, 1e-12, 1e-10)


@pytest.mark.parametrize("horizon", [0, 5, 64, 100])
@pytest.mark.parametrize("p,item,target,chunk,layer_types", CASES[1:3] + CASES[4:], ids=IDS[1:3] + IDS[4:])
def test_finite_horizon_equals_a_reference_cut_h_tokens_back(p, item, target, chunk, layer_types, horizon,
                                                              monkeypatch):
    with without_float32_casts(monkeypatch):
        model = _model(layer_types, seed=p)
        prefix, (cont,) = random_pack(p, [(item, target)], seed=p)
        la, ga = walk_run(model, prefix, cont, WalkSpec(chunk, horizon))
        lb, gb = truncated_reference(model, prefix, cont, chunk, horizon)
    _check(la, ga, lb, gb, 1e-12, 1e-10)


def test_the_horizon_changes_the_gradient_not_the_loss(monkeypatch):
    """Horizon 0 and 16 are different gradients (so the references above can tell them apart); all reaches the
    standalone one, which a horizon short of the sequence does not."""
    with without_float32_casts(monkeypatch):
        model = _model([L, F, L], seed=3)
        prefix, (cont,) = random_pack(6, [(20, 40)], seed=3)
        runs = {h: walk_run(model, prefix, cont, WalkSpec(8, h)) for h in (0, 16, None)}
        (lb,), gb = standalone_run(model, prefix, [cont])
    for h, (la, ga) in runs.items():
        assert abs(la - lb) / lb < 1e-12, h
    leak = {h: max_rel(ga, gb) for h, (_, ga) in runs.items()}
    assert leak[None] < 1e-10 and leak[0] > 1e-3 and leak[16] > 1e-3, leak
    assert max(rel(runs[0][1][k], runs[16][1][k]) for k in gb) > 1e-3


@pytest.mark.parametrize("horizon", [None, 0, 12])
def test_frozen_context_walks_on_constants_of_p(horizon, monkeypatch):
    with without_float32_casts(monkeypatch):
        model = _model([L, F, L], seed=5)
        prefix, (cont,) = random_pack(10, [(0, 50)], seed=5)
        la, ga = walk_run(model, prefix, cont, WalkSpec(16, horizon), context_grad="frozen")
        if horizon is None:  # the frozen mode's own standalone reference (transformers' cache path after P)
            (lb,), gb = standalone_run(model, prefix, [cont], context_grad="frozen")
        else:
            lb, gb = truncated_reference(model, prefix, cont, 16, horizon, frozen=True)
    _check(la, ga, lb, gb, 1e-12, 1e-10)


def test_activation_checkpointing_changes_nothing(monkeypatch):
    from packtrain.models.wrap import checkpoint_decoder_layers

    with without_float32_casts(monkeypatch):
        model = _model([L, F, L], seed=7)
        prefix, (cont,) = random_pack(4, [(10, 30)], seed=7)
        la, ga = walk_run(model, prefix, cont, WalkSpec(9, None))
        checkpoint_decoder_layers(model)
        lb, gb = walk_run(model, prefix, cont, WalkSpec(9, None))
    assert la == lb
    assert all(torch.equal(ga[k.replace("._checkpoint_wrapped_module", "")], g) for k, g in gb.items())


def test_dropout_masks_are_replayed_in_the_reverse_pass(monkeypatch):
    """With LoRA dropout, horizon all is the gradient of the chunks as they ran forward: a recompute that drew new
    masks would differentiate other caches than the later chunks read. Reference: the same windows in one graph
    (caches never detached), from the same seed."""
    from packtrain.packed.prefix import PrefixState
    from packtrain.packed.walk import Window

    with without_float32_casts(monkeypatch):
        model = with_lora_dropout(_model([L, F, L], seed=8), 0.3)
        prefix, (cont,) = random_pack(5, [(12, 30)], seed=8)
        torch.manual_seed(1)
        la, ga = walk_run(model, prefix, cont, WalkSpec(10, None))
        model.zero_grad(set_to_none=True)
        lm, layout = PackedLM(model), build_standalone_layout(prefix, cont)
        torch.manual_seed(1)
        kv, gdn, total = {}, {}, 0.0
        for s, e in [(0, 5)] + chunk_bounds(5, layout.length - 1, 10):
            out = lm(Window(layout, s, e, s, PrefixState(kv, gdn), len(cont.target_ids)))
            kv = {i: (torch.cat([kv[i][0], k], -2), torch.cat([kv[i][1], v], -2)) if i in kv else (k, v)
                  for i, (k, v) in out.state.kv.items()}
            gdn, total = out.state.gdn, total + out.loss
        total.backward()
        gb = trainable_grads(model)
    _check(la, ga, float(total.detach()), gb, 1e-12, 1e-10)


# -- plan and units (no model) ----------------------------------------------------------------------------------
def ex(id, length, prefix=(1, 2, 3, 4), item=None):
    item = length - 1 if item is None else item
    return Example(id, prefix, (7,) * item, (9,) * (length - item), "", 0)


def test_plan_counts_walked_examples_and_their_chunks():
    examples = [ex("a", 3), ex("b", 30), ex("c", 5), ex("d", 17, item=0)]
    spec = WalkSpec(8, None)
    plan = plan_packs(examples, 12, 90, "walk", walk_spec=spec)
    walks = {examples[p.examples[0]].id: p.walk for p in plan.packs if p.walk is not None}
    # b: positions 4..32 (33 = 4 + 30 - 1), chunks of 8 -> 4; d: 4..19 -> 2
    assert walks == {"b": WalkCalls(4, 4, 4), "d": WalkCalls(2, 2, 2)}
    assert [[examples[i].id for i in p.examples] for p in plan.packs if p.walk is None] == [["c", "a"]]
    stats = plan_stats(plan, examples)
    assert (stats["examples"], stats["walked"], stats["walk_chunks"], stats["packs"]) == (4, 2, 6, 1)
    assert stats["positions_standalone"] == stats["positions_packed"] + 4  # P once for a and c


def test_finite_horizon_schedule_counts_pieces_and_windows():
    # P 4, continuation 21 -> positions 4..24, chunks [4,12) [12,20) [20,24); horizon 3: windows from 1, 9, 17
    assert walk_calls(4, 5, 21, WalkSpec(8, 3)) == WalkCalls(3, 7, 3)  # cuts 0 1 4 9 12 17 20 24
    assert walk_calls(4, 0, 21, WalkSpec(8, 3)) == WalkCalls(3, 7, 4)  # + P's own window (a target off its last row)
    assert walk_calls(4, 0, 21, WalkSpec(8, 3), frozen=True) == WalkCalls(3, 6, 3)  # cuts 0 4 9 12 17 20 24
    assert walk_calls(4, 5, 21, WalkSpec(8, None)) == WalkCalls(3, 3, 3)


def test_every_rank_gets_the_same_walk_slots():
    examples = [ex("a", 3), ex("b", 30), ex("c", 50), ex("d", 5), ex("e", 2)]
    plan = plan_packs(examples, 12, 1, "walk", walk_spec=WalkSpec(8, None))
    ids = list(range(len(plan.packs)))
    kinds = Kinds.named("shared_prefix", walk_spec=WalkSpec(8, None))
    units = [rank_units(plan, ids, kinds, r, 2) for r in range(2)]
    shape = [[(u.kind.name, u.walk) for u in mine] for mine in units]
    assert shape[0] == shape[1]  # same kinds in the same order, walks padded to the same schedule
    walked = [u for mine in units for u in mine if u.kind is kinds.walk and not u.dummy]
    assert sorted(examples[u.examples[0]].id for u in walked) == ["b", "c"]
    assert all(u.walk == WalkCalls(7, 7, 7) for mine in units for u in mine if u.kind is kinds.walk)  # c: 53 -> 7
    # one walk in the step: the other rank runs a dummy walk of the same schedule
    plan = plan_packs(examples[:2] + examples[3:4], 12, 1, "walk", walk_spec=WalkSpec(8, None))
    kinds = Kinds.named("standalone", walk_spec=WalkSpec(8, None))
    units = [rank_units(plan, [0, 1, 2], kinds, r, 2) for r in range(2)]
    assert [[(u.dummy, u.walk) for u in mine if u.kind is kinds.walk] for mine in units] == \
        [[(False, WalkCalls(4, 4, 4))], [(True, WalkCalls(4, 4, 4))]]


def test_a_dummy_walk_takes_its_slots_schedule_not_its_fillers():
    """Rank 0 walks a long then a short example, rank 1 one long one: rank 1's dummy in slot 1 (a copy of its long
    walk) once kept the long schedule while rank 0 ran the short one, and the ranks deadlocked."""
    walk = WalkKind(WalkSpec(8, None))
    a, b, c = Unit(walk, 0, (0,), walk=WalkCalls(4, 4, 4)), Unit(walk, 0, (1,), walk=WalkCalls(3, 3, 3)), \
        Unit(walk, 0, (2,), walk=WalkCalls(4, 4, 4))
    slots = [walk.pad([[a, b], [c]], r) for r in range(2)]
    assert [[u.walk for u in mine] for mine in slots] == [[WalkCalls(4, 4, 4), WalkCalls(3, 3, 3)]] * 2
    assert [u.dummy for u in slots[1]] == [False, True]


def test_walk_config_problems_are_reported_together():
    from packtrain.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError) as e:
        config_from_dict({"packing": {"on_overflow": "walk", "context_grad": "kv_only",
                                      "walk": {"chunk": 0, "horizon": "some"}}})
    text = str(e.value)
    assert "packing.walk.chunk: must be at least 1" in text and "packing.walk.horizon: expected int | 'all'" in text
    assert "walk needs packing.context_grad full or frozen" in text
    cfg = config_from_dict({"packing": {"on_overflow": "walk", "walk": {"chunk": 64, "horizon": 0}}})
    assert cfg.walk_spec() == WalkSpec(64, 0)
