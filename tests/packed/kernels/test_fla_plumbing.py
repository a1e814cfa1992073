"""The fla back end's index plumbing (tailed varlen conv buffer, cu_seqlens, per-continuation initial states),
checked on CPU in float64 without fla installed: its two kernels are replaced by pure-torch varlen equivalents (a
loop over cu_seqlens segments of the torch reference); tests/packed/kernels/test_fla_interpreter*.py run fla's real
kernels. Everything packtrain does around them runs as on the GPU, and must equal the torch back end."""

import pytest
import torch
from fla_interp import fake_fla  # noqa: F401 - the fixture, used by name
from parity import packed_run, without_float32_casts
from tiny_models import patched_lora_model, random_pack

from packtrain.packed.kernels import Backend


@pytest.mark.usefixtures("fake_fla")
@pytest.mark.parametrize("prefix_len", [1, 2, 65])
def test_fla_plumbing_equals_torch_back_end(monkeypatch, prefix_len):
    with without_float32_casts(monkeypatch):
        prefix, conts = random_pack(prefix_len, [(0, 1), (3, 2), (70, 5), (10, 1)], seed=prefix_len)
        ref = packed_run(patched_lora_model(["linear_attention", "full_attention"], seed=5,
                                            backend=Backend("torch", "batched")), prefix, conts)
        got = packed_run(patched_lora_model(["linear_attention", "full_attention"], seed=5,
                                            backend=Backend("fla", "batched")), prefix, conts)
    assert torch.allclose(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=1e-13, atol=0)
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=1e-10, atol=1e-13)
