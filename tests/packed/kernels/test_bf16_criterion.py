"""The bf16 criterion tests/packed/kernels/test_gpu.py judges fla with (bf16 pack vs bf16 standalone, same kernels), run
here with the torch back end in bf16 on CPU: correct code meets it, and each of the three broken plumbings fails it, so
a correct GPU passes and a broken one cannot."""

import pytest
import torch
from mutations import GPU_SPECS, MUTATIONS, bf16_criterion_holds, break_plumbing, long_memory_model
from parity import compare
from tiny_models import random_pack

from packtrain.packed.kernels import Backend
from packtrain.packed.patch import patch_model

L, F = "linear_attention", "full_attention"


def _bf16_diff(prefix_len, seed=0):
    prefix, conts = random_pack(prefix_len, GPU_SPECS, seed=prefix_len)
    model = long_memory_model([L, F, L, L, F], seed=seed).to(torch.bfloat16)
    return compare(patch_model(model, Backend("torch", "batched")), prefix, conts)


@pytest.mark.parametrize("prefix_len", [1, 65, 300])
def test_correct_code_meets_the_bf16_criterion(prefix_len):
    d = _bf16_diff(prefix_len)
    assert bf16_criterion_holds(d), d


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_each_broken_plumbing_fails_the_bf16_criterion(mutation, monkeypatch):
    break_plumbing(mutation, monkeypatch)
    d = _bf16_diff(65)
    assert not bf16_criterion_holds(d), (mutation, d)
