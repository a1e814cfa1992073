"""The FSDP root (packtrain/packed/lm.py): ``lm(call)`` runs the call and counts it; a pack's loss per example, from
the final hidden states at its target rows through the target-only head, against transformers' own loss of each
example alone; the refusals of a body that cannot run what a layout holds."""

import pytest
import torch
from parity import hf_loss_tensors, without_float32_casts
from tiny_models import patched_lora_model, random_pack

from packtrain.packed.kernels import Backend
from packtrain.packed.layout import build_pack_layout, build_standalone_layout
from packtrain.packed.lm import PackCall, PackedLM, StandaloneCall

L, FULL = "linear_attention", "full_attention"


def _lm(**kw):
    return PackedLM(patched_lora_model([L, FULL, L], seed=3, backend=Backend(gdn="torch", attention="batched")), **kw)


def test_a_call_runs_on_the_root_and_each_forward_is_counted():
    lm = _lm()

    class Echo:
        def run(self, root):
            return root

    assert lm(Echo()) is lm and lm(Echo()) is lm
    assert lm.calls == 2


@pytest.mark.parametrize("chunk_rows", [0, 3])
def test_a_packs_losses_are_transformers_losses_of_each_example_alone(monkeypatch, chunk_rows):
    """Independent reference: transformers' own forward on each ``concat(P, C)`` with peft's LoRA forward and the
    MLPs whole, the cross-entropy of its logits at the target rows; float64 throughout (transformers' float32
    casts off), so only the order of sums differs."""
    with without_float32_casts(monkeypatch):
        prefix, conts = random_pack(30, [(4, 3), (0, 2), (6, 5)], seed=11)
        lm = _lm(loss_chunk_rows=chunk_rows)
        out = lm(PackCall(build_pack_layout(prefix, conts)))
        alone = lm(StandaloneCall(build_standalone_layout(prefix, conts[2])))
        with torch.no_grad():
            expected = torch.stack(hf_loss_tensors(lm.model, prefix, conts))
    torch.testing.assert_close(out.per_example, expected, rtol=1e-12, atol=1e-12)
    assert out.target_tokens.tolist() == [3, 2, 5] and lm.calls == 2
    torch.testing.assert_close(alone.per_example, expected[2:], rtol=1e-12, atol=1e-12)


def test_a_layout_with_images_needs_a_vision_language_model():
    prefix, conts = random_pack(8, [(2, 2)], seed=1)
    layout = build_pack_layout(prefix, conts)
    layout.image_grid_thw = torch.tensor([[1, 2, 2]])
    with pytest.raises(ValueError, match="examples with images need a vision-language model"):
        _lm().run_body(layout)


def test_the_loss_line_names_the_chunking():
    assert _lm(loss_chunk_rows=0).describe_loss() == ("lm_head + cross-entropy over all target rows at once "
                                                      "(train.loss_chunk_rows 0)")
    assert "in chunks of 256 target rows" in _lm(loss_chunk_rows=256).describe_loss()
