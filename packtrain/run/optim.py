"""Optimizer and LR schedule: torch's AdamW / SGD and transformers' warmup schedules."""

from __future__ import annotations

import torch
from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

from packtrain.config import OptimConfig


def build_optimizer(params, oc: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if oc.name == "adamw":
        return torch.optim.AdamW(params, lr=oc.lr, betas=tuple(oc.betas), eps=oc.eps, weight_decay=oc.weight_decay)
    return torch.optim.SGD(params, lr=oc.lr, momentum=oc.momentum, weight_decay=oc.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, oc: OptimConfig, total_steps: int):
    if oc.schedule == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, oc.warmup_steps, total_steps)
    return get_constant_schedule_with_warmup(optimizer, oc.warmup_steps)
