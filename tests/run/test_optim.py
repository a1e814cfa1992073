"""The optimizer and LR schedule built from `optim` (packtrain/run/optim.py): only trainable parameters, the config's
hyperparameters, and each schedule's learning rate per step against its formula computed by hand."""

import math

import pytest
import torch

from packtrain.config import OptimConfig
from packtrain.run.optim import build_optimizer, build_scheduler


def _params():
    trained, frozen = torch.nn.Parameter(torch.tensor([1.0, -2.0])), torch.nn.Parameter(torch.tensor([3.0]))
    frozen.requires_grad_(False)
    return trained, frozen


def test_adamw_takes_the_trainable_parameters_and_the_configs_hyperparameters():
    trained, frozen = _params()
    oc = OptimConfig(name="adamw", lr=0.01, weight_decay=0.1, betas=[0.8, 0.95], eps=1e-6)
    opt = build_optimizer([trained, frozen], oc)
    assert isinstance(opt, torch.optim.AdamW)
    (group,) = opt.param_groups
    assert [id(p) for p in group["params"]] == [id(trained)]  # a frozen base weight gets no optimizer state
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.01, (0.8, 0.95), 1e-6, 0.1)


def test_sgd_steps_as_momentum_sgd_with_weight_decay_by_hand():
    trained, frozen = _params()
    opt = build_optimizer([trained, frozen], OptimConfig(name="sgd", lr=0.5, weight_decay=0.1, momentum=0.9))
    assert isinstance(opt, torch.optim.SGD) and [id(p) for p in opt.param_groups[0]["params"]] == [id(trained)]
    p, velocity = [1.0, -2.0], [0.0, 0.0]
    for grad in ([0.3, -0.4], [0.2, 0.1]):
        trained.grad = torch.tensor(grad)
        opt.step()
        for i in range(2):  # v = momentum * v + (g + wd * p), p -= lr * v (first step: v = g + wd * p)
            velocity[i] = 0.9 * velocity[i] + grad[i] + 0.1 * p[i]
            p[i] -= 0.5 * velocity[i]
        assert trained.tolist() == pytest.approx(p, rel=1e-6)
    assert frozen.item() == 3.0


def _lrs(schedule: str, warmup: int, total: int) -> list[float]:
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(1))], OptimConfig(lr=0.2))
    sched = build_scheduler(opt, OptimConfig(lr=0.2, schedule=schedule, warmup_steps=warmup), total)
    lrs = []
    for _ in range(total + 1):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_constant_schedule_warms_up_linearly_then_holds():
    assert _lrs("constant", 4, 8) == pytest.approx([0.2 * min(1.0, s / 4) for s in range(9)])


def test_cosine_schedule_warms_up_then_decays_to_zero_at_the_last_step():
    warmup, total = 3, 11
    expected = [0.2 * s / warmup if s < warmup else
                0.2 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))) for s in range(total + 1)]
    lrs = _lrs("cosine", warmup, total)
    assert lrs == pytest.approx(expected, abs=1e-12)
    assert lrs[warmup] == pytest.approx(0.2) and lrs[total] == pytest.approx(0.0, abs=1e-12)
