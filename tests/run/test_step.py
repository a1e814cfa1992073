"""What one optimizer step decides (packtrain.run.step.Step.run, the trainer's, the bench's and the harness's), each
against an expectation of its own:

- the scale: the update is the gradient of the mean of per-example losses, those of transformers' own forward on
  each example alone, whatever the split into packs and ranks; the reported loss is that mean;
- the padding: a rank with fewer packs runs a dummy, which issues the calls and adds nothing;
- the skip agreement: a unit over ``train.max_positions``, or whose build raises a ``train.skippable_errors`` class,
  is skipped in its slot on every rank, and its slot's examples leave the step's count; another error stops every
  rank;
- a non-finite step on any rank makes no update on any rank, and is reported.

Ranks are threads of this process (:class:`Ranks`): the step's collectives meet at a barrier; each rank holds its
own copy of the model, and the update is their summed gradients, as FSDP sums them.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from parity import hf_loss_tensors, max_rel, without_float32_casts
from tiny_models import examples_of, patched_lora_model, plan_of, random_pack

from packtrain import faults
from packtrain.distributed import DistInfo
from packtrain.packed.kernels import Backend
from packtrain.packed.lm import PackedLM
from packtrain.run import step as step_module
from packtrain.run.step import Step
from packtrain.run.units import Kinds

L, F = "linear_attention", "full_attention"
BACKEND = Backend(gdn="torch", attention="batched")
LR = 0.5
CPU = torch.device("cpu")
# the parity tests' bound against transformers' own gradient in float64 (measured here: 8e-9, the GDN gates'
# in_proj_a through the chunked delta rule; a wrong scale, a counted skip or a dummy's gradient is 1e-1 or more)
GRAD = 5e-7


def _data():
    """Two prompts and three packs: A (P0, 3 examples), B (P1, 2), C (P0, 2)."""
    p0, c0 = random_pack(20, [(3, 5), (0, 7), (6, 4), (2, 3), (4, 6)], seed=1)
    p1, c1 = random_pack(12, [(5, 6), (1, 9)], seed=2)
    examples = examples_of(p0, c0) + examples_of(p1, c1, first=5)
    plan = plan_of([p0, p1], [(0, [0, 1, 2]), (1, [5, 6]), (0, [3, 4])], examples)
    return examples, plan


def _step(examples, plan, info, **kw):
    model = patched_lora_model([L, F, L], seed=0, backend=BACKEND)
    params = [p for p in model.parameters() if p.requires_grad]
    sgd = torch.optim.SGD(params, lr=LR)
    schedule = torch.optim.lr_scheduler.LambdaLR(sgd, lambda _: 1.0)
    return model, Step(PackedLM(model, "full"), Kinds.named("shared_prefix"), plan, examples, info, params, sgd,
                       schedule, **kw)


def _trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _change(before, model):
    """(before - now) / LR per trainable parameter: the gradient SGD applied."""
    now = _trainable(model)
    return {n: (before[n] - now[n]) / LR for n in before}


def _reference(examples, ids):
    """(the mean of transformers' own losses of ``ids`` alone, the gradient of that mean), from a fresh model."""
    model = patched_lora_model([L, F, L], seed=0, backend=BACKEND)
    losses = [hf_loss_tensors(model, examples[e].prefix_ids, [examples[e]])[0] for e in ids]
    mean = torch.stack(losses).mean()
    mean.backward()
    return mean.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class Ranks:
    """``world`` ranks as threads: the step's collectives (its all-reduces of sums and of maxima) meet at a
    barrier, each rank contributing its tensor."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=120)  # a rank that never comes breaks it: no hang
        self.values = [None] * world

    def _reduce(self, rank, t, op):
        self.values[rank] = t.detach().clone()
        self.barrier.wait()
        out = op(torch.stack(self.values))
        self.barrier.wait()
        return out

    def install(self, monkeypatch):
        def all_reduce_sum(t, info):
            t.copy_(self._reduce(info.rank, t, lambda s: s.sum(0)))
            return t

        def agree(values, info):
            t = torch.tensor(list(values) or [0], dtype=torch.int64)
            return self._reduce(info.rank, t, lambda s: s.max(0).values).tolist()[:len(values)]

        monkeypatch.setattr(step_module, "all_reduce_sum", all_reduce_sum)
        monkeypatch.setattr(step_module, "agree", agree)

    def run(self, fn):
        """``fn(rank)`` on every rank at once; each rank's result, or the exception it raised."""
        def guarded(rank):
            try:
                return fn(rank)
            except Exception as e:  # noqa: BLE001 - returned for the test to read
                return e

        with ThreadPoolExecutor(self.world) as pool:
            return list(pool.map(guarded, range(self.world)))


def _two_ranks(monkeypatch, examples, plan, pack_ids, signals_of=(None, None), **kw):
    """Step 0 on ``pack_ids`` at two ranks (``signals_of``: each rank's stop signals): (each rank's result, each
    rank's parameter change / LR, calls)."""
    ranks = Ranks(2)
    ranks.install(monkeypatch)
    made = [_step(examples, plan, DistInfo(r, 2, r, CPU), signals=signals_of[r], **kw) for r in range(2)]
    before = [_trainable(m) for m, _ in made]

    def one(rank):
        model, step = made[rank]
        calls = step.lm.calls
        result = step.run(pack_ids, 0)
        return result, step.lm.calls - calls

    out = ranks.run(one)
    if any(isinstance(o, Exception) for o in out):
        return out, None, None
    change = [_change(b, m) for b, (m, _) in zip(before, made)]
    summed = {n: change[0][n] + change[1][n] for n in change[0]}
    return [r for r, _ in out], summed, [c for _, c in out]


def test_the_update_is_the_mean_of_the_examples_alone_over_packs_and_ranks(monkeypatch):
    examples, plan = _data()
    with without_float32_casts(monkeypatch):
        loss, grad = _reference(examples, [0, 1, 2, 3, 4, 5, 6])
        results, update, calls = _two_ranks(monkeypatch, examples, plan, [0, 1, 2])
    positions = sum(p.positions for p in plan.packs)
    for r in results:
        assert (r.examples, r.positions, r.skipped, r.skipped_examples, r.nonfinite) == (7, positions, 0, 0, False)
        assert abs(r.loss - loss) / loss < 1e-12
    assert calls == [2, 2]  # rank 0: A, C; rank 1: B and a dummy, whose call every rank makes
    assert max_rel(update, grad) < GRAD


def test_one_rank_is_the_same_update(monkeypatch):
    examples, plan = _data()
    with without_float32_casts(monkeypatch):
        loss, grad = _reference(examples, [0, 1, 2, 5, 6])
        model, step = _step(examples, plan, DistInfo(0, 1, 0, CPU))
        before = _trainable(model)
        r = step.run([0, 1], 0)
    update = _change(before, model)
    assert r.examples == 5 and abs(r.loss - loss) / loss < 1e-12
    assert max_rel(update, grad) < GRAD


def test_a_unit_over_max_positions_is_skipped_in_its_slot_on_every_rank(monkeypatch):
    """A (slot 0 of rank 0) is over the cap, B (slot 0 of rank 1) under it: both skip slot 0; C alone trains."""
    examples, plan = _data()
    a, b, c = (p.positions for p in plan.packs)
    assert a > b and a > c
    with without_float32_casts(monkeypatch):
        loss, grad = _reference(examples, [3, 4])
        results, update, _ = _two_ranks(monkeypatch, examples, plan, [0, 1, 2], max_positions=a - 1)
    for r in results:
        assert (r.skipped, r.skipped_examples, r.examples, r.positions) == (1, 5, 2, c)
        assert abs(r.loss - loss) / loss < 1e-12
    assert max_rel(update, grad) < GRAD


class BadPack(Exception):
    pass


def _failing_build(monkeypatch, prompt: int):
    build = step_module.build

    def failing(unit, plan, examples, kinds):
        if unit.prompt == prompt and not unit.dummy:
            raise BadPack(f"pack of prompt {prompt}")
        return build(unit, plan, examples, kinds)

    monkeypatch.setattr(step_module, "build", failing)


def test_a_skippable_error_skips_the_slot_on_every_rank(monkeypatch):
    examples, plan = _data()
    _failing_build(monkeypatch, prompt=1)  # B, rank 1's slot 0
    with without_float32_casts(monkeypatch):
        loss, grad = _reference(examples, [3, 4])
        results, update, _ = _two_ranks(monkeypatch, examples, plan, [0, 1, 2], skippable=(BadPack,))
    for r in results:
        assert (r.skipped, r.skipped_examples, r.examples) == (1, 5, 2)
    assert max_rel(update, grad) < GRAD


def test_another_error_stops_every_rank(monkeypatch):
    examples, plan = _data()
    _failing_build(monkeypatch, prompt=1)
    results, _, _ = _two_ranks(monkeypatch, examples, plan, [0, 1, 2])
    assert isinstance(results[1], BadPack)
    assert isinstance(results[0], RuntimeError) and "another rank failed" in str(results[0])


def test_every_unit_skipped_makes_no_update(monkeypatch):
    examples, plan = _data()
    model, step = _step(examples, plan, DistInfo(0, 1, 0, CPU), max_positions=1)
    before = _trainable(model)
    r = step.run([0, 1], 0)
    assert (r.loss, r.examples, r.skipped, r.skipped_examples, r.nonfinite) == (None, 0, 2, 5, False)
    after = _trainable(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_a_non_finite_gradient_on_one_rank_makes_no_update_on_any(monkeypatch):
    """rank 1's loss scaled by NaN (faults.NAN_AT): its gradient is NaN, its loss and rank 0's gradient finite; the
    agreed verdict is non-finite on both, which return it with the figures they had, and make no update."""
    examples, plan = _data()
    monkeypatch.setenv(faults.NAN_AT, "1:1")
    results, update, _ = _two_ranks(monkeypatch, examples, plan, [0, 1, 2])
    assert all(r.nonfinite and not r.updated and not r.stop for r in results)
    assert sorted(torch.isfinite(torch.tensor(r.grad_norm)).item() for r in results) == [False, True]
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in results)  # the losses were finite: the gradient was not
    assert all(float(g.abs().max()) == 0 for g in update.values())


class _Signalled:
    requested = True


def test_a_signal_on_one_rank_stops_every_rank_after_the_update(monkeypatch):
    """Rank 0 was signalled (SIGTERM): the step's one agreement tells both ranks to stop after it, and both still
    make this step's update (the checkpoint then holds it)."""
    examples, plan = _data()
    signals = [_Signalled(), None]
    results, update, _ = _two_ranks(monkeypatch, examples, plan, [0, 1, 2], signals_of=signals)
    assert all(r.stop and r.updated and not r.nonfinite for r in results)
    assert any(float(g.abs().max()) > 0 for g in update.values())
    quiet, _, _ = _two_ranks(monkeypatch, examples, plan, [0, 1, 2])
    assert not any(r.stop for r in quiet)
