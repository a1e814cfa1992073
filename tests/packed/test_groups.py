"""packing.continuation_groups (packtrain/packed/groups.py): a pack's continuations in groups against one P graph train
exactly what the whole pack trains, under every packing.context_grad mode and on every family, and hold less of
the continuations' graph at once.

Tolerances, float64 with the float32 casts removed (`without_float32_casts`), measured over the cases here
(the loops of the tests below): groups vs the standalone examples (full, the independent
reference) losses 3.0e-16, gradients 3.8e-8 (the GDN gate's float32 cast stays); groups vs the one-forward pack of
the same mode (kv_only, frozen, and every family under full) gradients 4.1e-14. Bounds: parity's 1e-13 and 5e-7,
and 1e-12 for the same-path comparisons. The control, P without its backward (the groups' summed gradients
dropped): 0.83 off.
"""

import pytest
import torch
from parity import max_rel, rel, standalone_run, trainable_grads, without_float32_casts
from tiny_models import patched_lora_model, random_pack, tiny_family_model

from packtrain.packed import groups as groups_module
from packtrain.packed.groups import Groups, split, train_groups
from packtrain.packed.kernels import Backend
from packtrain.packed.layout import build_pack_layout
from packtrain.packed.lm import PackCall, PackedLM
from packtrain.packed.patch import patch_model

L, F = "linear_attention", "full_attention"
BACKEND = Backend(gdn="torch", attention="batched")
# (P, [(item, target), ...], layer types): a first target read off P's last row (item 0), P shorter than the conv
# width, continuations over the 32-token continuation chunk
CASES = [
    (40, [(0, 9), (5, 30), (12, 7), (3, 70), (20, 4)], [L, F, L]),
    (2, [(0, 3), (40, 1), (1, 1), (66, 5)], [F, L, L, F]),
    (70, [(i % 7, 1 + i % 5) for i in range(9)], [L, L, F]),
]
IDS = [f"P{c[0]}-n{len(c[1])}" for c in CASES]


def grouped(prefix, conts, n_groups):
    runs = split([len(c) for c in conts], n_groups)
    return Groups([build_pack_layout(prefix, [conts[i] for i in run or [0]]) for run in runs],
                  [1.0 if run else 0.0 for run in runs])


def groups_run(model, prefix, conts, n_groups, mode="full", loss_chunk_rows=0):
    model.zero_grad(set_to_none=True)
    total, _ = train_groups(PackedLM(model, mode, loss_chunk_rows), grouped(prefix, conts, n_groups), 1.0)
    return total, trainable_grads(model)


def pack_run(model, prefix, conts, mode):
    model.zero_grad(set_to_none=True)
    out = PackedLM(model, mode)(PackCall(build_pack_layout(prefix, conts)))
    out.loss_sum.backward()
    return float(out.per_example.sum()), trainable_grads(model)


@pytest.mark.parametrize("n_groups", [2, 3, 12])
@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_groups_equal_the_standalone_examples(case, n_groups, monkeypatch):
    prefix_len, specs, layer_types = CASES[case]
    prefix, conts = random_pack(prefix_len, specs, seed=case)
    with without_float32_casts(monkeypatch):
        model = patched_lora_model(layer_types, seed=case, backend=BACKEND)
        total, ga = groups_run(model, prefix, conts, n_groups)
        losses, gb = standalone_run(model, prefix, conts)
    assert abs(total - sum(losses)) < 1e-13 * abs(sum(losses))
    assert max_rel(ga, gb) < 5e-7


@pytest.mark.parametrize("mode", ["full", "frozen"])
def test_groups_with_the_loss_in_chunks_of_5_rows(mode, monkeypatch):
    prefix_len, specs, layer_types = CASES[0]
    prefix, conts = random_pack(prefix_len, specs, seed=0)
    with without_float32_casts(monkeypatch):
        model = patched_lora_model(layer_types, seed=0, backend=BACKEND)
        total, ga = groups_run(model, prefix, conts, 2, mode, loss_chunk_rows=5)
        losses, gb = standalone_run(model, prefix, conts, context_grad=mode)
    assert abs(total - sum(losses)) < 1e-13 * abs(sum(losses))
    assert max_rel(ga, gb) < 5e-7


@pytest.mark.parametrize("mode", ["kv_only", "frozen"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_groups_equal_the_pack_under_each_context_mode(case, mode, monkeypatch):
    prefix_len, specs, layer_types = CASES[case]
    prefix, conts = random_pack(prefix_len, specs, seed=case)
    with without_float32_casts(monkeypatch):
        model = patched_lora_model(layer_types, seed=case, backend=BACKEND)
        la, ga = pack_run(model, prefix, conts, mode)
        lb, gb = groups_run(model, prefix, conts, 3, mode)
        _, g_full = pack_run(model, prefix, conts, "full")
    assert abs(la - lb) < 1e-13 * abs(la)
    assert max_rel(gb, ga) < 1e-12
    assert max(rel(ga[n], g_full[n]) for n in ga) > 1e-3  # the mode trains something else: the check can tell


@pytest.mark.parametrize("model_type,layer_types", [("qwen3_5_moe_text", [F, L, L, F]), ("qwen3_next", [L, L, F, L]),
                                                    ("qwen3", [F, F])])
def test_groups_per_family(model_type, layer_types, monkeypatch):
    """1-D RoPE families take row 0 of the positions in P's call; MoE blocks run per group."""
    prefix, conts = random_pack(65, [(0, 2), (63, 1), (3, 6), (10, 1), (30, 3)], seed=4)
    with without_float32_casts(monkeypatch):
        model = patch_model(tiny_family_model(model_type, layer_types), BACKEND)
        la, ga = pack_run(model, prefix, conts, "full")
        lb, gb = groups_run(model, prefix, conts, 2)
    assert abs(la - lb) < 1e-13 * abs(la)
    assert max_rel(gb, ga) < 1e-12


def test_without_the_backward_through_p_the_gradient_differs(monkeypatch):
    """The control: drop the groups' summed gradients on P's outputs (no step 3) and the comparison fails."""
    prefix_len, specs, layer_types = CASES[0]
    prefix, conts = random_pack(prefix_len, specs, seed=0)
    model = patched_lora_model(layer_types, seed=0, backend=BACKEND)
    _, ga = pack_run(model, prefix, conts, "full")
    monkeypatch.setattr(groups_module, "backward_through", lambda lm, outputs, grads, losses=(): None)
    _, gb = groups_run(model, prefix, conts, 2)
    assert max_rel(gb, ga) > 1e-3


def test_split_keeps_order_and_balances_positions():
    lengths = [10, 10, 10, 10, 100, 5, 5, 5, 5]
    for n in range(1, 12):
        runs = split(lengths, n)
        assert len(runs) == n
        assert [i for run in runs for i in run] == list(range(len(lengths)))  # every index once, in order
        assert sum(bool(run) for run in runs) == min(n, len(lengths))  # no empty run while indices remain
    assert split(lengths, 3) == [[0, 1, 2, 3], [4], [5, 6, 7, 8]]
    assert split([7], 3) == [[0], [], []]


def _peak_saved_bytes(fn) -> int:
    """The largest total size of tensors autograd holds for backward at any moment during ``fn()``."""
    live, peak = [0], [0]

    class Held:
        def __init__(self, t):
            self.t, self.n = t, t.numel() * t.element_size()
            live[0] += self.n
            peak[0] = max(peak[0], live[0])

        def __del__(self):
            live[0] -= self.n

    with torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.t):
        fn()
    return peak[0]


def test_groups_hold_less_of_the_continuations_graph():
    """P of 16 tokens and 12 continuations of 40: the one-forward pack holds every continuation's graph, four groups
    about a quarter of it (saved tensors at their peak, of the one-forward pack's: 2 groups 0.56, 4 groups 0.33,
    12 groups 0.18, P's own share being the floor)."""
    prefix, conts = random_pack(16, [(20, 20)] * 12, seed=5)
    model = patched_lora_model([L, F, L], dtype=torch.float32, seed=5, backend=BACKEND)
    lm = PackedLM(model, "full")
    whole = _peak_saved_bytes(lambda: lm(PackCall(build_pack_layout(prefix, conts))).loss_sum.backward())
    four = _peak_saved_bytes(lambda: train_groups(lm, grouped(prefix, conts, 4), 1.0))
    assert four < 0.4 * whole, (four, whole)


def test_one_update_in_groups_is_the_one_forward_update(monkeypatch):
    """`packtrain smoke`'s update (run.harness.one_update: the trainer's step on a one-pack plan) on a pack in groups
    == on the pack in one forward, with SGD."""
    from tiny_models import examples_of, plan_of

    from packtrain.distributed import DistInfo
    from packtrain.run.harness import one_update
    from packtrain.run.step import Step
    from packtrain.run.units import GroupsKind, Kinds, PackKind

    prefix_len, specs, layer_types = CASES[0]
    prefix, conts = random_pack(prefix_len, specs, seed=0)
    examples = examples_of(prefix, conts)
    plan = plan_of([prefix], [(0, range(len(conts)))], examples)
    with without_float32_casts(monkeypatch):
        after = []
        for kind, n_groups in ((PackKind, 1), (GroupsKind, 3)):
            kinds = Kinds.named("shared_prefix", n_groups)
            assert [type(u.kind) for u in kinds.units(plan.packs[0])] == [kind]
            model = patched_lora_model(layer_types, seed=0, backend=BACKEND)
            params = [p for p in model.parameters() if p.requires_grad]
            sgd = torch.optim.SGD(params, lr=0.5)
            step = Step(PackedLM(model, "full"), kinds, plan, examples, DistInfo(0, 1, 0, torch.device("cpu")),
                        params, sgd, torch.optim.lr_scheduler.LambdaLR(sgd, lambda _: 1.0))
            one_update(step)
            after.append(trainable_values(model))
    assert max_rel(after[1], after[0]) < 1e-12


def trainable_values(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
