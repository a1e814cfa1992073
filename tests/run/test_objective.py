"""train.objective (packtrain.run.objective): the pair losses from the formula, what the step's mean is over, and a
unit's terms."""

import copy
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from parity import max_rel, without_float32_casts

from packtrain.packed.kernels import Backend
from packtrain.run.objective import Dpo, Sft, Terms, Weighted


def _ex(id_, pair="", side="", weight=1.0):
    return SimpleNamespace(id=id_, pair=pair, side=side, weight=weight)


def test_the_pair_losses_are_the_formulas():
    # two pairs laid out (rejected, chosen, chosen, rejected): the terms find each side
    examples = [_ex("a:r", "a", "rejected"), _ex("a:c", "a", "chosen", 2.0), _ex("b:c", "b", "chosen"),
                _ex("b:r", "b", "rejected")]
    policy = torch.tensor([-3.0, -1.5, -7.25, -2.0], dtype=torch.float64)
    reference = torch.tensor([-2.5, -2.0, -6.0, -4.5], dtype=torch.float64)
    counts = torch.tensor([3, 2, 5, 4])
    terms = Dpo().terms(examples)
    assert terms.pairs == ((1, 0), (2, 3)) and terms.weights == (2.0, 1.0)
    for beta in (0.1, 0.5):
        got = Dpo(beta).pair_losses(policy, reference, counts, terms).tolist()
        want = []
        for (c, r), w in zip(terms.pairs, (2.0, 1.0)):
            margin = (policy[c] - reference[c]) - (policy[r] - reference[r])
            want.append(w * math.log1p(math.exp(-beta * float(margin))))  # -log sigmoid(x) = log(1 + e^-x)
        assert got == pytest.approx(want, rel=1e-14)
        ipo = Dpo(beta, "ipo").pair_losses(policy, reference, counts, terms).tolist()
        want = []
        for (c, r), w in zip(terms.pairs, (2.0, 1.0)):
            margin = (policy[c] - reference[c]) / counts[c] - (policy[r] - reference[r]) / counts[r]
            want.append(w * (float(margin) - 1 / (2 * beta)) ** 2)
        assert ipo == pytest.approx(want, rel=1e-14)


def test_the_step_mean_is_over_pairs_under_dpo_and_examples_else():
    ten = [_ex(f"e{i}") for i in range(10)]
    assert Dpo().measure(ten) == 5
    assert Sft().measure(ten) == Weighted().measure(ten) == 10


def test_a_unit_with_half_a_pair_is_refused_and_a_table_gives_its_reference():
    with pytest.raises(RuntimeError, match="one answer of a preference pair"):
        Dpo().terms([_ex("a:c", "a", "chosen"), _ex("b:r", "b", "rejected")])
    pair = [_ex("a:c", "a", "chosen"), _ex("a:r", "a", "rejected")]
    table = {"a:c": -1.25, "a:r": -3.5}
    assert Dpo().with_table(table).terms(pair).reference == (-1.25, -3.5)
    with pytest.raises(RuntimeError, match="no entry for example 'a:r'"):
        Dpo().with_table({"a:c": -1.0}).terms(pair)
    assert Weighted().terms([_ex("x", weight=-0.5), _ex("y")]) == Terms((-0.5, 1.0))
    with pytest.raises(RuntimeError, match="both its answers in one graph"):
        Dpo().terms(pair).subset([0])


# -- exactness: the packed step against a standalone DPO / weighted loss written here ---------------------------
#
# Each pair's two sequences concat(P, item, answer) run alone through transformers' own forward with peft's LoRA
# forward (tests/parity.py's peft_lora_forward and transformers_mlp: no packtrain code on the path), the answer's
# log-probabilities summed from log_softmax of its logits in float64; the reference the same under peft's
# disable_adapter(); the loss written below from the formula; its autograd gradient against the packed step's SGD
# update. float64 with the model's float32 casts removed (without_float32_casts), as in tests/run/test_step.py.

L, F = "linear_attention", "full_attention"
BETA = 0.7  # not the default 0.1: a beta the step ignores shows
LR = 0.5
# the parity tests' bounds (tests/run/test_step.py, tests/packed/test_parity.py): the step's loss to 1e-12 relative,
# every trainable gradient to 5e-7 (max |g - g_ref| / max |g_ref| per tensor). Measured here (print the two in
# _check): losses 2.0e-15 at most; gradients 1.2e-14 (standalone pairs), 7.5e-9 (shared_prefix), 4.0e-8 (tree),
# 8.8e-8 (ipo), VLM 3.4e-9, Qwen3-Next 1.8e-8, MoE 9.2e-8 (the GDN gate's float32 `a` and the router's float32
# softmax stay). Each of these planted in the product fails every case it touches: the reference with the adapter on
# (per_step or the table), beta ignored, the mean over examples, a pair's sides swapped, the weights ignored or their
# signs dropped, ipo's per-token means as sums (ipo's loss 7.2 for 0.74).
LOSS, GRAD = 1e-12, 5e-7


def _tokens(rng, n):
    return tuple(rng.randrange(1, 89) for _ in range(n))  # text tokens below the VLM's image tokens (90-93)


def _pair_examples(prompts, seed=0, images=None):
    """Preference pairs as the data layer gives them (packtrain.data.preference: ids ``ID:chosen`` / ``ID:rejected``,
    ``pair``, ``side``). ``prompts``: per P, (its length, its pairs as (item length, chosen length, rejected length,
    tokens the two answers share at their start)). ``images``: pair index -> (item, pixels per image) in place of
    the random item (tiny_models.image_item)."""
    import random

    from packtrain.data.example import Example
    from packtrain.data.images import ImageRef

    rng, out, pixels, k = random.Random(seed), [], {}, 0
    for prefix_len, pairs in prompts:
        prefix = _tokens(rng, prefix_len)
        for item_len, chosen_len, rejected_len, shared in pairs:
            item, refs = _tokens(rng, item_len), ()
            if images is not None and k in images:
                item, grids, px = images[k]
                refs = tuple(ImageRef(f"p{k}-{j}.png", g) for j, g in enumerate(grids))
                pixels.update({r.path: p for r, p in zip(refs, px)})
            start = _tokens(rng, shared)
            chosen = start + _tokens(rng, chosen_len - shared)
            rejected = start + _tokens(rng, rejected_len - shared)
            for side, answer in (("chosen", chosen), ("rejected", rejected)):
                out.append(Example(f"p{k}:{side}", prefix, tuple(item), answer, images=refs, pair=f"p{k}",
                                   side=side))
            k += 1
    return out, pixels


# two prompts, five pairs: answers that share their first tokens (the tree computes them once), a pair with no item
# whose answers start apart (nothing in common past P), items of 0 to 5 tokens
PROMPTS = ((20, [(4, 5, 3, 0), (3, 6, 5, 2), (0, 4, 6, 0)]), (12, [(5, 3, 4, 1), (2, 7, 2, 0)]))


class _Pixels:
    """The images' loader (packtrain.data.images.ImageLoader's interface) over pixels held in memory by path."""

    def __init__(self, spec, pixels):
        self.spec, self.pixels = spec, pixels

    def load(self, refs):
        return torch.cat([self.pixels[r.path] for r in refs]), torch.tensor([list(r.grid_thw) for r in refs])


def _token_log_probs(model, examples, pixels=None):
    """transformers' own forward (peft's LoRA forward, the MLPs whole) on each example's concat(P, item, answer)
    alone: per example its answer tokens' log-probabilities [n], from log_softmax of the logits in float64 (with the
    graph)."""
    from parity import peft_lora_forward, transformers_mlp
    from tiny_models import IMAGE

    out = []
    with peft_lora_forward(model), transformers_mlp(model):
        for ex in examples:
            ids = torch.tensor([list(ex.prefix_ids + ex.item_ids + ex.target_ids)])
            kw = {}
            if ex.images:
                kw = {"pixel_values": torch.cat([pixels[r.path] for r in ex.images]),
                      "image_grid_thw": torch.tensor([list(r.grid_thw) for r in ex.images]),
                      "mm_token_type_ids": (ids == IMAGE).int()}
            logits = model(input_ids=ids, **kw).logits[0].to(torch.float64)
            start = len(ex.prefix_ids) + len(ex.item_ids)
            out.append(torch.log_softmax(logits[start - 1:-1], dim=-1).gather(1, ids[0, start:, None])[:, 0])
    return out


def _answer_log_probs(model, examples, pixels):
    """Each example's answer's summed token log-probability, alone (:func:`_token_log_probs`)."""
    return torch.stack([t.sum() for t in _token_log_probs(model, examples, pixels)])


def _standalone_loss(forwards, objective, examples):
    """The step's loss written from the formulas on the examples alone, from ``forwards`` = (the policy's summed
    answer log-probabilities with the graph, the reference's: the adapter disabled). dpo: per pair, with l the
    policy's and r the reference's, -log sigmoid(beta * ((lc - rc) - (lr - rr))) (ipo: (m - 1 / (2 beta))^2, m the
    same margin of per-token means), plus rpo_alpha times the chosen answer's mean target cross-entropy, times the
    pair's weight, the mean over the pairs; weighted: the sum of weight * mean target
    cross-entropy over the examples / the examples."""
    policy, reference = forwards
    counts = torch.tensor([len(ex.target_ids) for ex in examples], dtype=torch.float64)
    if objective.name == "weighted":
        weights = torch.tensor([ex.weight for ex in examples], dtype=torch.float64)
        return (weights * (-policy / counts)).sum() / len(examples)
    at = {ex.id: k for k, ex in enumerate(examples)}
    ratio = policy - reference
    losses = []
    for ex in examples:
        if ex.side != "chosen":
            continue
        c, r = at[ex.id], at[f"{ex.pair}:rejected"]
        if objective.loss_type == "ipo":
            margin = ratio[c] / counts[c] - ratio[r] / counts[r]
            losses.append((margin - 1 / (2 * objective.beta)) ** 2)
        else:
            margin = ratio[c] - ratio[r]
            losses.append(-torch.log(torch.sigmoid(objective.beta * margin)))
        # the pair's weight (on both its sides) times its DPO loss and its RPO term alike
        losses[-1] = (losses[-1] + objective.rpo_alpha * (-policy[c] / counts[c])) * ex.weight
    return torch.stack(losses).sum() / len(losses)


def _plan(mode, examples, token_budget=10_000, max_continuations=64):
    """The planner's packs of ``examples`` (packtrain.run.units.Kinds.plan, as a run plans them)."""
    from packtrain.config import config_from_dict
    from packtrain.run.units import Kinds

    cfg = config_from_dict({"packing": {"mode": mode, "token_budget": token_budget,
                                        "max_continuations": max_continuations}})
    return Kinds.named(mode).plan(cfg, examples)


def _packed_step(model, mode, examples, plan, objective, pixels=None, world=1, monkeypatch=None, seen=None):
    """One optimizer step of all the plan's packs (packtrain.run.step.Step, SGD at LR) on ``world`` ranks (threads
    with tests/run/test_step.py's collectives, installed by ``monkeypatch``; each rank a copy of ``model``): (the
    step's loss on each rank, the gradient it applied: the parameters' change / LR, summed over the ranks as FSDP
    sums them; each rank's StepResult appended to ``seen``). ``model`` is left as it was. Under precompute the
    reference table comes first (packtrain.run.reference.compute, as the trainer runs it)."""
    from test_step import Ranks

    from packtrain.distributed import DistInfo
    from packtrain.packed.lm import PackedLM
    from packtrain.packed.patch import vision_spec
    from packtrain.run import reference
    from packtrain.run.step import Step
    from packtrain.run.units import Kinds

    cpu = torch.device("cpu")
    images = _Pixels(vision_spec(model), pixels) if pixels else None
    kinds = Kinds.named(mode, images=images, objective=objective)
    if objective.paired and objective.reference == "precompute":
        table = reference.compute(PackedLM(model, "full"), plan, examples, kinds, DistInfo(0, 1, 0, cpu))
        kinds = dataclasses.replace(kinds, objective=objective.with_table(table))
    models = [copy.deepcopy(model) for _ in range(world)]
    steps = []
    for rank, m in enumerate(models):
        params = [p for p in m.parameters() if p.requires_grad]
        sgd = torch.optim.SGD(params, lr=LR)
        schedule = torch.optim.lr_scheduler.LambdaLR(sgd, lambda _: 1.0)
        steps.append(Step(PackedLM(m, "full"), kinds, plan, examples, DistInfo(rank, world, rank, cpu), params, sgd,
                          schedule))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    pack_ids = list(range(len(plan.packs)))
    if world == 1:
        results = [steps[0].run(pack_ids, 0)]
    else:
        ranks = Ranks(world)
        ranks.install(monkeypatch)
        results = ranks.run(lambda rank: steps[rank].run(pack_ids, 0))
        for r in results:
            if isinstance(r, Exception):
                raise r
    change = {n: sum((before[n] - dict(m.named_parameters())[n].detach()) / LR for m in models) for n in before}
    if seen is not None:
        seen.extend(results)
    return [r.loss for r in results], change


def _check(step_losses, change, loss, grad, what):
    """The step's loss and every trainable gradient against the standalone reference's."""
    worst = max_rel(change, grad)
    for got in step_losses:
        assert abs(got - loss) / abs(loss) < LOSS, (what, got, loss)
    assert worst < GRAD, (what, worst)
    for name, g in grad.items():  # a zero reference gradient would make the comparison vacuous
        assert g.abs().max() > 0, (what, name)
    return worst


# the dense MLPs in 7-row tiles and the norms in 5-row tiles (tests/packed/test_families.py)
BACKEND = Backend(gdn="torch", attention="batched", mlp_rows=7, norm_rows=5)


@pytest.fixture(scope="module")
def models():
    """The tiny float64 models with random LoRA (tests/tiny_models.py), each built once for the module: the text
    hybrid, the VLM (Qwen3_5ForConditionalGeneration), the MoE (qwen3_5_moe_text) and Qwen3-Next."""
    from tiny_models import patched_lora_model, tiny_family_model, tiny_vlm

    from packtrain.packed.patch import patch_model

    built = {}

    def get(name):
        if name not in built:
            if name == "text":
                built[name] = patched_lora_model([L, F, L], seed=0, backend=BACKEND)
            elif name == "vlm":
                built[name] = tiny_vlm(0)
            else:
                layers = [L, F] if name == "qwen3_next" else [L, F, L]  # Qwen3-Next: a dense layer, an MoE one
                built[name] = patch_model(tiny_family_model(name, layers), BACKEND)
        return built[name]

    return get


@pytest.fixture(scope="module")
def references():
    """The standalone forwards by model and examples' tokens, run once for the module (the graph kept: each
    objective's loss is differentiated from it)."""
    return {}


def _reference(references, model, name, examples, objective, pixels=None):
    """(the standalone loss of ``objective`` on ``examples``, its gradient of every trainable parameter by name)."""
    key = (name, tuple((ex.prefix_ids, ex.item_ids, ex.target_ids) for ex in examples))
    if key not in references:
        policy = _answer_log_probs(model, examples, pixels)
        with torch.no_grad(), model.disable_adapter():
            references[key] = policy, _answer_log_probs(model, examples, pixels)
    loss = _standalone_loss(references[key], objective, examples)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in trainable], retain_graph=True)
    return float(loss.detach()), {n: g for (n, _), g in zip(trainable, grads)}


# precompute under shared_prefix: the VLM's and Qwen3-Next's cases below
@pytest.mark.parametrize("mode,reference", [("tree", "per_step"), ("tree", "precompute"), ("shared_prefix", "per_step"),
                                            ("standalone", "per_step")])
def test_the_dpo_step_equals_the_pairs_alone(models, references, mode, reference, monkeypatch):
    """The packed dpo step (a pair's two answers in one pack, the pairs of a P sharing it) == the standalone DPO
    loss written from the formula, its gradient == autograd of it, on the text hybrid."""
    examples, _ = _pair_examples(PROMPTS)
    objective = Dpo(BETA, "sigmoid", reference)
    model = models("text")
    with without_float32_casts(monkeypatch):
        loss, grad = _reference(references, model, "text", examples, objective)
        losses, change = _packed_step(model, mode, examples, _plan(mode, examples), objective)
    _check(losses, change, loss, grad, mode)


def test_ipo_equals_its_formula_on_the_pairs_alone(models, references, monkeypatch):
    examples, _ = _pair_examples(PROMPTS)
    objective = Dpo(BETA, "ipo", "per_step")
    model = models("text")
    with without_float32_casts(monkeypatch):
        loss, grad = _reference(references, model, "text", examples, objective)
        losses, change = _packed_step(model, "tree", examples, _plan("tree", examples), objective)
    _check(losses, change, loss, grad, "ipo")


@pytest.mark.parametrize("loss_type,reference", [("sigmoid", "precompute"), ("ipo", "per_step")])
def test_rpo_alpha_adds_the_chosen_answers_cross_entropy(models, references, loss_type, reference, monkeypatch):
    """rpo_alpha: each pair's loss plus rpo_alpha times its chosen answer's mean target cross-entropy (TRL's RPO),
    the packed tree step == that written on the pairs alone; and it is not the DPO step (the term does something)."""
    examples, _ = _pair_examples(PROMPTS)
    objective = Dpo(BETA, loss_type, reference, rpo_alpha=0.75)
    model = models("text")
    with without_float32_casts(monkeypatch):
        loss, grad = _reference(references, model, "text", examples, objective)
        dpo_loss, _ = _reference(references, model, "text", examples, dataclasses.replace(objective, rpo_alpha=0.0))
        losses, change = _packed_step(model, "tree", examples, _plan("tree", examples), objective)
    _check(losses, change, loss, grad, f"rpo {loss_type}")
    assert loss - dpo_loss > 0.75 * 1.0  # the chosen answers' mean cross-entropy, of random tokens, is well above 1


def test_a_pairs_weight_weighs_its_dpo_loss_and_its_rpo_term(models, references, monkeypatch):
    """Pairs of weights other than 1 (one negative) under dpo with rpo_alpha: the packed tree step == each pair's
    (DPO loss + RPO term) x its weight on the pairs alone (the RPO term without the weight went unseen with weights
    of 1)."""
    examples, _ = _pair_examples(PROMPTS)
    pairs = sorted({ex.pair for ex in examples})
    weight = {p: (2.5, -0.5, 0.25, 1.75, 3.0)[k % 5] for k, p in enumerate(pairs)}
    examples = [dataclasses.replace(ex, weight=weight[ex.pair]) for ex in examples]
    objective = Dpo(BETA, "sigmoid", "per_step", rpo_alpha=0.75)
    model = models("text")
    with without_float32_casts(monkeypatch):
        loss, grad = _reference(references, model, "text", examples, objective)
        losses, change = _packed_step(model, "tree", examples, _plan("tree", examples), objective)
    _check(losses, change, loss, grad, "weighted rpo")


def _weighted(examples, weights):
    return [dataclasses.replace(ex, weight=w) for ex, w in zip(examples, weights)]


# weights of the pairs' ten answers as examples of their own (an advantage may be negative)
WEIGHTS = (1.5, -0.75, 0.25, 2.0, -1.0, 0.5, 1.0, -2.5, 0.125, 3.0)


def _plain(examples):
    """The pairs' answers as plain examples (no pair, no side), ids kept."""
    return [dataclasses.replace(ex, pair="", side="") for ex in examples]


def test_the_weighted_step_equals_the_examples_alone(models, references, monkeypatch):
    """weighted: the sum of weight * mean target cross-entropy over the step's examples / examples, negative weights
    among them (a tree here; shared_prefix: the MoE's case below)."""
    mode = "tree"
    examples = _weighted(_plain(_pair_examples(PROMPTS)[0]), WEIGHTS)
    objective = Weighted()
    model = models("text")
    with without_float32_casts(monkeypatch):
        loss, grad = _reference(references, model, "text", examples, objective)
        losses, change = _packed_step(model, mode, examples, _plan(mode, examples), objective)
    _check(losses, change, loss, grad, mode)


def _vlm_examples():
    """Three pairs on one P for the tiny VLM: an item with an image, one with two of other grids, one of text."""
    from tiny_models import image_item

    gen = torch.Generator().manual_seed(5)
    grids = {0: [(1, 4, 6)], 1: [(1, 4, 4), (1, 6, 2)]}
    items = {0: image_item([3, 4], grids[0], [5, 6, 7], gen), 1: image_item([8], grids[1], [9, 10], gen)}
    images = {k: (ids, grids[k], pixels) for k, (ids, pixels) in items.items()}
    return _pair_examples(((14, [(0, 4, 3, 1), (0, 3, 5, 0), (4, 5, 2, 2)]),), seed=3, images=images)


FAMILY_CASES = [("vlm", "tree", "per_step"), ("vlm", "shared_prefix", "precompute"),
                ("qwen3_5_moe_text", "tree", "precompute"), ("qwen3_5_moe_text", "shared_prefix", "per_step"),
                ("qwen3_next", "tree", "per_step"), ("qwen3_next", "shared_prefix", "precompute")]


@pytest.mark.parametrize("name,mode,reference", FAMILY_CASES, ids=["-".join(c) for c in FAMILY_CASES])
def test_the_dpo_step_equals_the_pairs_alone_per_family(models, references, name, mode, reference, monkeypatch):
    """The VLM (images in the items: the tree computes a pair's item and its images once), the MoE (routed experts
    with LoRA) and Qwen3-Next (fused GDN projections, a dense and an MoE layer)."""
    examples, pixels = _vlm_examples() if name == "vlm" else _pair_examples(PROMPTS, seed=1)
    objective = Dpo(BETA, "sigmoid", reference)
    model = models(name)
    with without_float32_casts(monkeypatch):
        loss, grad = _reference(references, model, name, examples, objective, pixels)
        losses, change = _packed_step(model, mode, examples, _plan(mode, examples), objective, pixels)
    _check(losses, change, loss, grad, name)


@pytest.mark.parametrize("name,mode", [("vlm", "tree"), ("qwen3_5_moe_text", "shared_prefix"),
                                       ("qwen3_next", "tree")])
def test_the_weighted_step_equals_the_examples_alone_per_family(models, references, name, mode, monkeypatch):
    examples, pixels = _vlm_examples() if name == "vlm" else _pair_examples(PROMPTS, seed=1)
    examples = _weighted(_plain(examples), WEIGHTS)
    objective = Weighted()
    model = models(name)
    with without_float32_casts(monkeypatch):
        loss, grad = _reference(references, model, name, examples, objective, pixels)
        losses, change = _packed_step(model, mode, examples, _plan(mode, examples), objective, pixels)
    _check(losses, change, loss, grad, name)


# one P, four pairs: one pack holds them all at the default budget; at 40 positions they take a pack each (but
# one, in a tree)
ONE_PROMPT = ((18, [(4, 5, 3, 0), (3, 6, 5, 2), (0, 4, 6, 0), (5, 3, 4, 1)]),)


@pytest.mark.parametrize("mode", ["shared_prefix", "tree"])
def test_the_mean_is_over_the_steps_pairs_on_any_split(models, references, mode, monkeypatch):
    """The step over several packs (and so units) on two ranks == the step of the one pack == the pairs alone: a
    unit's loss is its pairs' sum and the step divides by the pairs of the whole step, all ranks."""
    examples, _ = _pair_examples(ONE_PROMPT, seed=2)
    objective = Dpo(BETA, "sigmoid", "per_step")
    one, split = _plan(mode, examples), _plan(mode, examples, token_budget=40)
    assert len(one.packs) == 1 and len(split.packs) >= 3
    model = models("text")
    with without_float32_casts(monkeypatch):
        loss, grad = _reference(references, model, "text", examples, objective)
        one_loss, one_change = _packed_step(model, mode, examples, one, objective)
        split_loss, split_change = _packed_step(model, mode, examples, split, objective, world=2,
                                                monkeypatch=monkeypatch)
    _check(one_loss, one_change, loss, grad, "one pack")
    _check(split_loss, split_change, loss, grad, "three packs on two ranks")
    assert max_rel(split_change, one_change) < GRAD


@pytest.mark.parametrize("mode", ["tree", "shared_prefix"])
def test_weight_1_everywhere_is_exactly_sft(models, mode, monkeypatch):
    """weighted with every weight 1 gives the sft step bit for bit (its loss and every gradient)."""
    examples = _plain(_pair_examples(PROMPTS)[0])
    assert {ex.weight for ex in examples} == {1.0}
    plan, model = _plan(mode, examples), models("text")
    sft_loss, sft = _packed_step(model, mode, examples, plan, Sft())
    weighted_loss, weighted = _packed_step(model, mode, examples, plan, Weighted())
    assert weighted_loss == sft_loss
    assert sft.keys() == weighted.keys() and sft
    for name in sft:
        assert torch.equal(weighted[name], sft[name]), name
