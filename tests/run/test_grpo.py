"""train.objective grpo (packtrain.run.objective.Grpo) in float64: the packed step on scored groups (a group's K
completions a subtree P -> item -> K answers) against the GRPO loss written from TRL's formulas on each completion
computed alone.

Each completion's sequence concat(P, item, completion) runs alone through transformers' own forward with peft's LoRA
forward (tests/parity.py: no packtrain code on the path); its tokens' log-probabilities come from log_softmax of the
logits in float64, the reference's the same under peft's disable_adapter(); the loss is tests/run/test_rl.py's
``_trl_loss`` (TRL's padded [B, L] layout, the whole step at once); its autograd gradient is compared with the packed
step's SGD update, at test_objective.py's bounds."""

import dataclasses
import random

import pytest
import test_objective
import torch
from parity import max_rel, without_float32_casts
from test_objective import GRAD, LOSS, _packed_step, _plan, _token_log_probs, _tokens
from test_rl import _trl_loss

from packtrain.data.example import Example
from packtrain.run.objective import Grpo, RlSpec
from packtrain.run.rl import group_advantages

MAX_LEN = 9  # rl.max_completion_length: dr_grpo's divisor
models = test_objective.models  # the module's tiny float64 models (the fixture), built once here too


def _groups(prompts, seed=0, images=None):
    """Scored groups as the data layer gives them (ids ``ID:k``, ``group``, ``reward``, ``group_rewards``), and the
    images' pixels by path. ``prompts``: per P, (its length, its groups as (item length, completion lengths, tokens
    the completions share at their start, rewards)). ``images``: group index -> (item, grids, pixels per image) in
    place of the random item (tiny_models.image_item)."""
    from packtrain.data.images import ImageRef

    rng, out, pixels, k = random.Random(seed), [], {}, 0
    for prefix_len, groups in prompts:
        prefix = _tokens(rng, prefix_len)
        for item_len, lengths, shared, rewards in groups:
            item, start, refs = _tokens(rng, item_len), _tokens(rng, shared), ()
            if images is not None and k in images:
                item, grids, px = images[k]
                refs = tuple(ImageRef(f"g{k}-{j}.png", g) for j, g in enumerate(grids))
                pixels.update({r.path: p for r, p in zip(refs, px)})
            rewards = tuple(float(r) for r in rewards)
            for j, n in enumerate(lengths):
                out.append(Example(f"g{k}:{j}", prefix, tuple(item), start + _tokens(rng, n - shared), images=refs,
                                   group=f"g{k}", reward=rewards[j], group_rewards=rewards))
            k += 1
    return out, pixels


# two prompts, four groups: completions that share their first tokens (the tree computes them once), a group with
# no item whose completions start apart, a group whose rewards are all equal (advantage 0: only the KL moves it),
# one with a reward repeated
GROUPS = ((16, [(3, (4, 6, 3), 2, (1.0, 0.0, 0.5)), (0, (5, 3), 0, (0.0, 1.0))]),
          (11, [(4, (3, 5, 4, 2), 1, (0.25, 1.0, 0.25, 0.0)), (2, (4, 2), 0, (0.5, 0.5))]))


def _sampled(forwards, model, name, examples, pixels=None, seed=0):
    """``examples`` with the sampler's log-probabilities: the policy's own, moved by up to +-0.5 (capped at 0), so
    that ratios leave the clip range both ways."""
    g = torch.Generator().manual_seed(seed)
    _reference(forwards, model, name, examples, RlSpec(), pixels)
    rows = [r.detach() for r in forwards[(name, tuple((ex.prefix_ids, ex.item_ids, ex.target_ids)
                                                       for ex in examples))][0]]
    return [dataclasses.replace(ex, logprobs=tuple(torch.clamp(r + torch.rand(len(r), generator=g,
                                                                              dtype=torch.float64) - 0.5,
                                                               max=0.0).tolist()))
            for ex, r in zip(examples, rows)]


@pytest.fixture(scope="module")
def forwards():
    """The completions' forwards alone by model and tokens, run once for the module (the graph kept: each case's
    loss is differentiated from it)."""
    return {}


def _reference(forwards, model, name, examples, spec, pixels=None):
    """(the GRPO loss of the step written from TRL's formulas on each completion alone, its gradient of every
    trainable parameter by name)."""
    key = (name, tuple((ex.prefix_ids, ex.item_ids, ex.target_ids) for ex in examples))
    if key not in forwards:
        logp = _token_log_probs(model, examples, pixels)
        with torch.no_grad(), model.disable_adapter():
            forwards[key] = logp, _token_log_probs(model, examples, pixels)
    logp, ref = forwards[key]
    old = [r.detach() if ex.logprobs is None else torch.tensor(ex.logprobs, dtype=torch.float64)
           for ex, r in zip(examples, logp)]
    advantages = torch.stack([group_advantages(ex.group_rewards, spec.scale_rewards)[ex.group_rewards.index(ex.reward)]
                              for ex in examples])
    loss = _trl_loss(logp, old, ref, advantages, spec, MAX_LEN)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in trainable], retain_graph=True)
    return float(loss.detach()), {n: g for (n, _), g in zip(trainable, grads)}


def _check(step_losses, change, loss, grad, what):
    """The step's loss and every trainable gradient against the reference's (test_objective.py's bounds). The loss
    to 1e-12 of itself or absolutely below 1: on-policy without a KL term it is 0 analytically (each ratio 1 with
    its gradient, and a group's advantages sum to 0), the gradient not."""
    for got in step_losses:
        assert abs(got - loss) <= LOSS * max(1.0, abs(loss)), (what, got, loss)
    worst = max_rel(change, grad)
    assert worst < GRAD, (what, worst)
    for name, g in grad.items():  # a zero reference gradient would make the comparison vacuous
        assert g.abs().max() > 0, (what, name)


# every loss type, each importance level, with and without the sampler's log-probabilities, beta 0 and > 0, and each
# mode: every pair of values meets in some case
CASES = [("grpo", "token", False, 0.0, "tree"), ("grpo", "sequence", True, 0.04, "shared_prefix"),
         ("dr_grpo", "token", True, 0.04, "standalone"), ("dr_grpo", "sequence", False, 0.0, "tree"),
         ("dapo", "token", True, 0.0, "shared_prefix"), ("dapo", "sequence", False, 0.04, "tree"),
         ("cispo", "token", False, 0.04, "tree"), ("cispo", "sequence", True, 0.0, "standalone")]


@pytest.mark.parametrize("loss_type,level,sampled,beta,mode", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_the_grpo_step_equals_the_completions_alone(models, forwards, loss_type, level, sampled, beta, mode,
                                                   monkeypatch):
    # cispo's epsilon_high is the ratio's ceiling itself: 1.3 caps some sampled tokens' ratios (in [0.6, 1.65]), not all
    spec = RlSpec(loss_type, level, "group", 0.2, 1.3 if loss_type == "cispo" else 0.28, beta, MAX_LEN)
    model = models("text")
    examples, _ = _groups(GROUPS)
    with without_float32_casts(monkeypatch):
        if sampled:
            examples = _sampled(forwards, model, "text", examples)
        loss, grad = _reference(forwards, model, "text", examples, spec)
        losses, change = _packed_step(model, mode, examples, _plan(mode, examples), Grpo(spec))
    _check(losses, change, loss, grad, f"{loss_type} {level} {mode}")


def _vlm_groups():
    """Two groups on one P for the tiny VLM, their items with images of other grids, and a group of text."""
    from tiny_models import image_item

    gen = torch.Generator().manual_seed(5)
    grids = {0: [(1, 4, 6)], 1: [(1, 4, 4), (1, 6, 2)]}
    items = {0: image_item([3, 4], grids[0], [5, 6, 7], gen), 1: image_item([8], grids[1], [9, 10], gen)}
    images = {k: (ids, grids[k], pixels) for k, (ids, pixels) in items.items()}
    return _groups(((14, [(0, (4, 3, 5), 1, (1.0, 0.0, 0.25)), (0, (3, 5), 0, (0.0, 1.0)),
                          (4, (2, 4, 3), 0, (0.5, 1.0, 0.0))]),), seed=3, images=images)


FAMILY_CASES = [("vlm", "tree", "dapo", "token"), ("qwen3_5_moe_text", "shared_prefix", "grpo", "sequence"),
                ("qwen3_next", "tree", "cispo", "token")]


@pytest.mark.parametrize("name,mode,loss_type,level", FAMILY_CASES, ids=["-".join(c) for c in FAMILY_CASES])
def test_the_grpo_step_equals_the_completions_alone_per_family(models, forwards, name, mode, loss_type, level,
                                                              monkeypatch):
    """The VLM (images in the items: the tree computes a group's item and its images once), the MoE (routed experts
    with LoRA) and Qwen3-Next (fused GDN projections, a dense and an MoE layer), off-policy with a KL term."""
    from test_objective import _Pixels  # noqa: F401 - the images' loader _packed_step builds

    spec = RlSpec(loss_type, level, "group", 0.2, 1.3 if loss_type == "cispo" else 0.28, 0.04, MAX_LEN)
    model = models(name)
    examples, pixels = _vlm_groups() if name == "vlm" else _groups(GROUPS, seed=1)
    with without_float32_casts(monkeypatch):
        examples = _sampled(forwards, model, name, examples, pixels)
        loss, grad = _reference(forwards, model, name, examples, spec, pixels)
        losses, change = _packed_step(model, mode, examples, _plan(mode, examples), Grpo(spec), pixels)
    _check(losses, change, loss, grad, f"{name} {loss_type} {level} {mode}")


def _sibling_leak(monkeypatch):
    """Plant a leak: each tree run that follows a sibling (another child of the same parent) starts its Gated
    DeltaNet recurrence from that sibling's final state instead of their parent's."""
    from packtrain.packed import tree

    original = tree.tree_levels

    def leaky(layout):
        runs = layout.runs()
        bad = [r if k == 0 or runs[k - 1][2] != r[2] else (r[0], r[1], k - 1) for k, r in enumerate(runs)]
        assert bad != runs  # the case has siblings to leak from
        copy = dataclasses.replace(layout)
        copy._cache = {"runs": bad}
        return original(copy)

    monkeypatch.setattr(tree, "tree_levels", leaky)


def test_a_gdn_state_leaking_from_a_sibling_answer_is_caught(models, forwards, monkeypatch):
    spec = RlSpec("dapo", "token", "group", 0.2, 0.28, 0.0, MAX_LEN)
    model = models("text")
    examples, _ = _groups(GROUPS)
    with without_float32_casts(monkeypatch):
        _, grad = _reference(forwards, model, "text", examples, spec)
        _sibling_leak(monkeypatch)
        _, change = _packed_step(model, "tree", examples, _plan("tree", examples), Grpo(spec))
    # (on-policy each ratio is 1 whatever the state: the loss is the same number, its gradient is not)
    assert max_rel(change, grad) > 100 * GRAD


@pytest.mark.parametrize("mode", ["shared_prefix", "tree"])
def test_the_mean_is_over_the_steps_completions_or_tokens_on_any_split(models, forwards, mode, monkeypatch):
    """A step's groups over several packs on two ranks == the one-pack step == the completions alone: a unit's
    loss is its completions' weighted sum and the step divides by the completions (grpo) or tokens (dapo) of the
    whole step, all ranks."""
    model = models("text")
    examples, _ = _groups(GROUPS)
    # each group a pack of its own: the largest group needs 41 positions flat, 28 as a tree
    one, split = _plan(mode, examples), _plan(mode, examples, token_budget=41 if mode == "shared_prefix" else 30)
    assert len(one.packs) == 2 and len(split.packs) == 4
    with without_float32_casts(monkeypatch):
        examples = _sampled(forwards, model, "text", examples, seed=1)  # a case where both levels clip some tokens
    for spec in (RlSpec("grpo", "token", "group", 0.2, 0.28, 0.04, MAX_LEN), RlSpec("dapo", "sequence", "none", 0.05)):
        seen = []
        with without_float32_casts(monkeypatch):
            loss, grad = _reference(forwards, model, "text", examples, spec)
            split_loss, split_change = _packed_step(model, mode, examples, split, Grpo(spec), world=2,
                                                    monkeypatch=monkeypatch, seen=seen)
        _check(split_loss, split_change, loss, grad, f"{spec.loss_type} over {len(split.packs)} packs on two ranks")
        clipped, kl = _figures(forwards, examples, spec)
        for r in seen:  # every rank's figures are the whole step's
            assert r.figures["clip_fraction"] == pytest.approx(clipped, rel=1e-12) and clipped > 0, spec
            assert ("kl" in r.figures) == bool(spec.beta)
            if spec.beta:
                assert r.figures["kl"] == pytest.approx(kl, rel=1e-9) and kl > 0


def _figures(forwards, examples, spec):
    """(the fraction of the step's tokens whose clip took their gradient, the mean k3 KL estimate per token),
    written from TRL's definitions on the completions alone: a token is clipped where its ratio is out of
    [1 - epsilon, 1 + epsilon_high] on the side its advantage points to."""
    logp, ref = forwards[("text", tuple((ex.prefix_ids, ex.item_ids, ex.target_ids) for ex in examples))]
    clipped = tokens = kl = 0.0
    for ex, lp, rf in zip(examples, logp, ref):
        lp = lp.detach()
        a = float(group_advantages(ex.group_rewards, spec.scale_rewards)[ex.group_rewards.index(ex.reward)])
        log_ratio = lp - torch.tensor(ex.logprobs, dtype=torch.float64)
        if spec.importance_sampling_level == "sequence":
            log_ratio = log_ratio.mean().expand_as(lp)
        ratio = torch.exp(log_ratio)
        clipped += float((((ratio < 1 - spec.epsilon) & (a < 0)) | ((ratio > 1 + spec.high) & (a > 0))).sum())
        kl += float((torch.exp(rf - lp) - (rf - lp) - 1).sum())
        tokens += len(lp)
    return clipped / tokens, kl / tokens


def test_the_data_figures_are_the_steps_rewards_groups_and_lengths():
    examples, _ = _groups(GROUPS)
    figures = Grpo().data_figures(examples)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.25, 1.0, 0.25, 0.0, 0.5, 0.5], dtype=torch.float64)
    assert figures["reward_mean"] == pytest.approx(float(rewards.mean()))
    assert figures["reward_std"] == pytest.approx(float(rewards.std(unbiased=False)))
    assert figures["equal_reward_groups"] == 0.25  # the last group's two 0.5s
    assert figures["completion_length"] == pytest.approx((4 + 6 + 3 + 5 + 3 + 3 + 5 + 4 + 2 + 4 + 2) / 11)


def _planted(kind):
    """rl.token_terms with one fault: the advantage's sign flipped, the clip dropped, or the k3 KL estimated on the
    wrong side (exp(log p - ref) - (log p - ref) - 1: the KL of the reference to the policy)."""
    from packtrain.run import rl

    original = rl.token_terms

    def terms(logp, lengths, advantages, spec, old=None, ref=None):
        if kind == "sign":
            return original(logp, lengths, -advantages, spec, old, ref)
        if kind == "clip":
            return original(logp, lengths, advantages, dataclasses.replace(spec, epsilon=0.999, epsilon_high=1e9), old,
                            ref)
        t = original(logp, lengths, advantages, dataclasses.replace(spec, beta=0.0), old, ref)
        delta = logp - ref.to(logp.dtype)
        k3 = torch.exp(delta) - delta - 1
        return dataclasses.replace(t, loss=t.loss + spec.beta * k3, kl=k3.detach())

    return terms


@pytest.mark.parametrize("kind", ["sign", "clip", "kl"])
def test_a_flipped_advantage_a_dropped_clip_and_a_kl_on_the_wrong_side_are_each_caught(models, forwards, kind,
                                                                                       monkeypatch):
    from packtrain.run import rl

    spec = RlSpec("grpo", "token", "group", 0.2, 0.28, 0.04, MAX_LEN)
    model = models("text")
    examples, _ = _groups(GROUPS)
    with without_float32_casts(monkeypatch):
        examples = _sampled(forwards, model, "text", examples, seed=1)  # some ratios outside [0.8, 1.28]
        loss, grad = _reference(forwards, model, "text", examples, spec)
        losses, change = _packed_step(model, "tree", examples, _plan("tree", examples), Grpo(spec))
        _check(losses, change, loss, grad, "the step as built")
        monkeypatch.setattr(rl, "token_terms", _planted(kind))
        losses, change = _packed_step(model, "tree", examples, _plan("tree", examples), Grpo(spec))
    with pytest.raises(AssertionError):
        _check(losses, change, loss, grad, f"planted: {kind}")


@pytest.mark.parametrize("mode", ["tree", "standalone"])
def test_a_precomputed_per_token_reference_gives_the_per_step_update(models, forwards, mode, monkeypatch):
    """train.dpo_reference precompute under grpo: each completion's reference token log-probabilities from a table
    (here transformers + peft's with the adapter disabled, each completion alone) in place of the per-step forward:
    the same loss and gradients as the formulas, with no reference forward in the step; a table entry of another
    length is refused."""
    spec = RlSpec("dapo", "token", "group", 0.2, 0.28, 0.04, MAX_LEN)
    model = models("text")
    examples, _ = _groups(GROUPS)
    with without_float32_casts(monkeypatch):
        examples = _sampled(forwards, model, "text", examples, seed=1)
        loss, grad = _reference(forwards, model, "text", examples, spec)
        ref = forwards[("text", tuple((ex.prefix_ids, ex.item_ids, ex.target_ids) for ex in examples))][1]
        table = {ex.id: tuple(r.tolist()) for ex, r in zip(examples, ref)}
        objective = Grpo(spec, reference="precompute").with_table(table)
        assert objective.precomputes and not objective.per_step
        forwarded, original = [], Grpo.reference_log_probs

        def counted(self, lm, forward):
            out = original(self, lm, forward)
            forwarded.append(out is not None)
            return out

        monkeypatch.setattr(Grpo, "reference_log_probs", counted)
        losses, change = _packed_step(model, mode, examples, _plan(mode, examples), objective)
    assert forwarded and not any(forwarded)  # the table, not a forward
    _check(losses, change, loss, grad, f"precomputed reference, {mode}")
    short = {**table, examples[0].id: table[examples[0].id][:-1]}
    with pytest.raises(RuntimeError, match="no entry of 4 token log-probabilities for completion 'g0:0'"):
        Grpo(spec, reference="precompute").with_table(short).terms(examples)
