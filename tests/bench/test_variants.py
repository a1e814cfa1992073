"""The bench's variants (packtrain/bench/variants.py) in their parts: each variant's config overrides, a whole
example and its labels for transformers' loss, the plain loop's gradient accumulation (each loss over the examples in
its step), and the one initial adapter every run starts from. Every variant trained end to end:
tests/commands/test_bench.py."""

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from packtrain.bench.variants import (
    DEFAULT_VARIANTS,
    VARIANTS,
    Trainable,
    plain_epoch,
    trainable_by_name,
    whole_example,
)
from packtrain.config import config_from_dict
from packtrain.data.example import Example


def test_each_variant_is_the_config_under_its_packing_overrides():
    cfg = config_from_dict({"packing": {"mode": "shared_prefix", "continuation_groups": 2, "token_budget": 333}})
    tree = VARIANTS["tree"].config(cfg).packing
    assert (tree.mode, tree.context_grad, tree.continuation_groups, tree.token_budget) == ("tree", "full", 1, 333)
    assert VARIANTS["kv_only"].config(cfg).packing.context_grad == "kv_only"
    assert VARIANTS["plain"].config(cfg) is cfg and cfg.packing.mode == "shared_prefix"  # the config itself unchanged
    assert DEFAULT_VARIANTS == ("shared_prefix", "kv_only", "frozen", "standalone", "plain")


def test_a_whole_example_is_labelled_on_its_target_only():
    input_ids, labels = whole_example(Example("a", (1, 2), (3,), (4, 5)), torch.device("cpu"))
    assert input_ids.tolist() == [[1, 2, 3, 4, 5]] and labels.tolist() == [[-100, -100, -100, 4, 5]]


def test_the_plain_loop_accumulates_each_loss_over_the_examples_in_its_step():
    """A model whose loss is w x the example's length: step 1 holds packs 0 and 1 (examples of 5, 6 and 9 tokens),
    so at w = 2 its losses are 10, 12, 18 (mean 40/3) and w's gradient (5 + 6 + 9) / 3."""
    w = torch.nn.Parameter(torch.tensor(2.0))
    grads = []

    def update(optimizer, scheduler):
        grads.append(w.grad.item())
        w.grad = None

    def plain(input_ids, labels, use_cache):
        return SimpleNamespace(loss=w * input_ids.shape[1])

    examples = [Example(str(n), (1,), (2,) * (n - 2), (3,)) for n in (5, 6, 9, 4)]
    plan = SimpleNamespace(packs=[SimpleNamespace(examples=(0, 1)), SimpleNamespace(examples=(2,)),
                                  SimpleNamespace(examples=(3,))])
    work = SimpleNamespace(steps=[[0, 1], [2]], plan=plan, examples=examples, device=torch.device("cpu"))
    models = SimpleNamespace(plain=plain, plain_state=SimpleNamespace(reset=lambda: (None, None), update=update))
    assert plain_epoch(models, work) == [pytest.approx(40 / 3), 8.0]
    assert grads == [pytest.approx(20 / 3), 4.0]
    assert plain_epoch(models, work, max_steps=1) == [pytest.approx(40 / 3)]


def test_every_run_starts_from_one_initial_adapter():
    wrapped = checkpoint_wrapper(torch.nn.Linear(2, 3))
    params = trainable_by_name(torch.nn.Sequential(wrapped))  # named as in the plain copy, which is not wrapped
    assert sorted(params) == ["0.bias", "0.weight"]
    initial = {"0.weight": torch.full((3, 2), 0.5), "0.bias": torch.zeros(3)}
    cfg = config_from_dict({"optim": {"lr": 0.1, "warmup_steps": 0, "max_grad_norm": 1.0}})
    state = Trainable(params, initial, cfg, n_steps=4)
    assert torch.equal(wrapped.weight, initial["0.weight"])
    optimizer, scheduler = state.reset()
    wrapped(torch.ones(1, 2)).sum().mul(100).backward()
    state.update(optimizer, scheduler)
    assert not torch.equal(wrapped.weight, initial["0.weight"]) and wrapped.weight.grad is None
    # the update clips to optim.max_grad_norm before the optimizer steps
    norms = []
    wrapped(torch.ones(1, 2)).sum().mul(100).backward()
    state.update(SimpleNamespace(step=lambda: norms.append(torch.cat([p.grad.flatten() for p in params.values()]).norm()),
                                 zero_grad=lambda set_to_none: None), SimpleNamespace(step=lambda: None))
    assert norms == [pytest.approx(1.0)]
    wrapped(torch.ones(1, 2)).sum().backward()
    state.reset()
    assert torch.equal(wrapped.weight, initial["0.weight"]) and torch.equal(wrapped.bias, initial["0.bias"])
    assert wrapped.weight.grad is None
