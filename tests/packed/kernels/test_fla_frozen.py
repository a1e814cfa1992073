"""The fla back end's frozen plumbing (packtrain/packed/kernels/fla_frozen.py): a buffer of continuations only, P's
keys, values and Gated DeltaNet state read from outside. On CPU with fla's kernels as pure-torch stand-ins
(fla_interp.fake_fla), in float64 with the model's float32 casts removed: the packed frozen pass equals the torch back
end's; FlexAttention's frozen block mask is checked on the forward, eager (FlexAttention has no backward on CPU)."""

import sys

import pytest
import torch
from fla_interp import fake_fla  # noqa: F401 - the fixture, used by name
from parity import max_rel, packed_run, rel, without_float32_casts
from tiny_models import patched_lora_model, random_pack

from packtrain.packed.kernels import Backend
from packtrain.packed.layout import build_pack_layout
from packtrain.packed.lm import PackCall, PackedLM

L, F = "linear_attention", "full_attention"


def _model(layer_types, seed=0):
    return patched_lora_model(layer_types, seed=seed, backend=Backend(gdn="torch", attention="batched"))


@pytest.fixture
def fake_fla_frozen(monkeypatch):
    import packtrain.packed.kernels as kernels_pkg

    monkeypatch.delitem(sys.modules, "packtrain.packed.kernels.fla_frozen", raising=False)
    # `from packtrain.packed.kernels import fla_frozen` reads the package attribute first: where the real one was
    # imported earlier in the session (tests/run/test_generate.py's interpreter test), it would be used instead
    monkeypatch.delattr(kernels_pkg, "fla_frozen", raising=False)
    yield
    sys.modules.pop("packtrain.packed.kernels.fla_frozen", None)


@pytest.mark.usefixtures("fake_fla")
@pytest.mark.parametrize("prefix_len", [1, 65])
def test_fla_frozen_plumbing_equals_torch_back_end(fake_fla_frozen, monkeypatch, prefix_len):
    with without_float32_casts(monkeypatch):
        prefix, conts = random_pack(prefix_len, [(0, 1), (3, 2), (70, 5), (10, 1)], seed=prefix_len)
        ref = packed_run(_model([L, F], seed=5), prefix, conts, context_grad="frozen")
        fla_model = patched_lora_model([L, F], seed=5, backend=Backend("fla", "batched"))
        got = packed_run(fla_model, prefix, conts, context_grad="frozen")
    assert rel(torch.tensor(got[0]), torch.tensor(ref[0])) < 1e-13
    assert max_rel(got[1], ref[1]) < 1e-10


@pytest.mark.usefixtures("fake_fla")
def test_frozen_flex_mask_equals_the_batched_path_forward(fake_fla_frozen, monkeypatch):
    """FlexAttention has no backward on CPU, so its frozen block mask (continuation queries offset by |P| against
    [P ; continuations] keys) is checked on the forward, eager, against the batched path."""
    from torch.nn.attention.flex_attention import flex_attention

    from packtrain.packed.kernels import fla_frozen

    monkeypatch.setattr(fla_frozen, "_compiled_flex", flex_attention)
    prefix, conts = random_pack(37, [(0, 2), (5, 3), (70, 4)], seed=10)
    losses = {}
    for attention in ("batched", "flex"):
        model = patched_lora_model([L, F], dtype=torch.float32, seed=10, backend=Backend("torch", attention))
        with torch.no_grad():
            losses[attention] = PackedLM(model, "frozen")(PackCall(build_pack_layout(prefix, conts))).per_example
    assert rel(losses["flex"], losses["batched"]) < 1e-6
