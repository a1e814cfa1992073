"""Three deliberately broken plumbings of the packed Gated DeltaNet, as test-only monkeypatches, for checking that
a parity check catches them (on both back ends: the conv tail comes from the layout both use; the initial state is
zeroed at the chunk-rule call of each)."""

from __future__ import annotations

import torch
from tiny_models import tiny_lora_model

from packtrain.packed.kernels import torch_ref
from packtrain.packed.layout import PackLayout

MUTATIONS = ["zero initial state", "no conv tail", "tail off by one"]


def _zero_initial_state(rule):
    def broken(*args, initial_state=None, **kwargs):
        if initial_state is not None:  # continuations start from zero instead of P's final state
            initial_state = torch.zeros_like(initial_state)
        return rule(*args, initial_state=initial_state, **kwargs)

    return broken


def break_plumbing(name: str, monkeypatch) -> None:
    """Apply mutation ``name`` for the rest of the test (``monkeypatch`` undoes it)."""
    if name == "zero initial state":
        monkeypatch.setattr(torch_ref, "chunk_gated_delta_rule", _zero_initial_state(torch_ref.chunk_gated_delta_rule))
        try:
            from packtrain.packed.kernels import fla_backend
        except ImportError:  # no fla here: only the torch back end can run
            return
        monkeypatch.setattr(fla_backend, "chunk_gated_delta_rule", _zero_initial_state(fla_backend.chunk_gated_delta_rule))
    elif name == "no conv tail":  # every continuation's conv history is zeros instead of P's last W-1 inputs
        monkeypatch.setattr(PackLayout, "conv_tail_index",
                            lambda self, width: torch.full((width - 1,), -1, dtype=torch.long,
                                                           device=self.input_ids.device))
    elif name == "tail off by one":  # P's tokens W..2 before its end instead of W-1..1
        correct = PackLayout.conv_tail_index
        monkeypatch.setattr(PackLayout, "conv_tail_index", lambda self, width: (correct(self, width) - 1).clamp_min(-1))
    else:
        raise KeyError(name)


def long_memory_model(layer_types, dtype=torch.float32, seed=0, **config):
    """tiny_lora_model with slow GDN decay (g ~ -0.03 per token, as in trained long-memory heads): the random init
    forgets within a token or two, which would hide the state a continuation inherits from P."""
    model = tiny_lora_model(layer_types, dtype=dtype, seed=seed, **config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-4.0, -3.0)
    return model


# The bf16 criterion (tests/packed/kernels/test_gpu.py; its margin is shown on CPU by
# tests/packed/kernels/test_bf16_criterion.py): a pack in bf16 against the same model's standalone examples in bf16 with
# the same kernels. Measured on CPU with the torch back end in bf16 (long_memory_model([L, F, L, L, F]), test_gpu's
# continuations, P = 1 / 65 / 300, seeds 0 and 1): correct code gives loss gaps <= 1.4e-2 and gradient gaps <= 0.38; the
# three broken plumbings give gradient gaps >= 1.38 (their loss gaps can be as small as 5.9e-3: zero initial state at P
# = 65, so gradients decide). The gradient bound is half the smallest broken gap, 1.8x the largest correct one; the loss
# bound ~3.5x the largest correct loss gap.
BF16_LOSS_BOUND = 0.05
BF16_GRAD_BOUND = 0.69
GPU_SPECS = [(0, 1), (3, 2), (70, 5), (130, 20), (10, 1), (64, 64)]


def bf16_criterion_holds(diff) -> bool:
    return diff.loss < BF16_LOSS_BOUND and diff.grad < BF16_GRAD_BOUND
