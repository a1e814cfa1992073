"""Vision-language packs on a tiny Qwen3_5ForConditionalGeneration (float64): images of different grid sizes,
several per pack, one continuation with two images, one without; LoRA and a trainable merger.

Tolerances, measured over seeds 0-7 of these fixtures (reproduce: loop `compare` over `tiny_vlm(s)`,
`vlm_pack(s)`):
- float64 with the model's float32 casts removed (`without_float32_casts`): losses 6e-16, gradients 5e-11 —
  the structure (positions, image placement, the one vision batch, isolation) is exact. Bounds 1e-13, 1e-9.
- MoE form (Qwen3_5MoeForConditionalGeneration, routed experts with LoRA), seed 1: losses 3.2e-16, gradients
  7.0e-8 (in_proj_qkv: the GDN gate's float32 `a`, bounded at 5e-7 as in tests/packed/test_parity.py; the experts'
  gradients 2.3e-10); as shipped: losses 4.5e-7 (4.2e-7 vs transformers), gradients 1.1e-5.
- float64 as shipped: losses 9.2e-6 packed vs standalone and 1.1e-5 vs transformers, gradients 7.1e-5 — the
  RMSNorm / gated-norm / chunk-rule float32 casts of tests/packed/test_parity.py, on larger activations here.
  Bounds 3e-5 and 2e-4.
"""

import pytest
import torch
from parity import compare, packed_run, transformers_mlp, without_float32_casts
from tiny_models import IMAGE, tiny_vlm, vlm_pack

from packtrain.data.images import VisionSpec, mrope_positions
from packtrain.packed.kernels import Backend
from packtrain.packed.layout import Continuation, build_pack_layout
from packtrain.packed.patch import patch_model, vision_spec


def hf_vlm_losses(model, prefix, conts, pixels):
    """transformers' own forward with pixel_values, image_grid_thw and labels on each standalone example."""
    out = []
    with torch.no_grad(), transformers_mlp(model):
        for c, px in zip(conts, pixels):
            ids = torch.tensor([list(prefix) + list(c.item_ids) + list(c.target_ids)])
            labels = torch.full_like(ids, -100)
            start = len(prefix) + len(c.item_ids)
            labels[0, start:] = ids[0, start:]
            kw = {}
            if c.images:
                kw = dict(pixel_values=torch.cat(px), image_grid_thw=torch.tensor([list(g) for g in c.images]),
                          mm_token_type_ids=(ids == IMAGE).int())
            out.append(model(input_ids=ids, labels=labels, **kw).loss.item())
    return out


@pytest.mark.parametrize("seed,moe", [(0, False), (2, False), (1, True)])
def test_vlm_packed_equals_standalone_exactly(seed, moe, monkeypatch):
    with without_float32_casts(monkeypatch):
        model = tiny_vlm(seed, moe)
        prefix, conts, pixels = vlm_pack(seed)
        d = compare(model, prefix, conts, vision_spec(model), pixels)
    # the MoE fixture's worst gradient (7.0e-8, in_proj_qkv of a GDN layer) is the GDN gate's `a.float()` that
    # tests/packed/test_parity.py bounds at 5e-7; the experts' own gradients agree to 2.3e-10
    assert d.loss < 1e-13 and d.grad < (5e-7 if moe else 1e-9), d
    # compare() asserts every trainable gradient is non-zero: the merger (modules_to_save) trains
    assert any("merger" in n and p.requires_grad for n, p in model.named_parameters())


@pytest.mark.parametrize("seed,moe", [(0, False), (2, False), (1, True)])
def test_vlm_as_shipped_equals_standalone_and_transformers(seed, moe):
    model = tiny_vlm(seed, moe)
    spec = vision_spec(model)
    assert spec == VisionSpec(IMAGE, 2)
    prefix, conts, pixels = vlm_pack(seed)
    d = compare(model, prefix, conts, spec, pixels)
    assert d.loss < 3e-5 and d.grad < 2e-4, d
    reference = torch.tensor(hf_vlm_losses(model, prefix, conts, pixels), dtype=torch.float64)
    assert ((torch.tensor(d.losses_a, dtype=torch.float64) - reference).abs() / reference).max() < 3e-5


def test_continuation_never_sees_another_continuations_image(monkeypatch):
    """Changing C1's image changes C1's loss and nothing else; the same check fails with a leaky mask."""
    from packtrain.packed import layout as layout_module

    model = tiny_vlm(seed=1)
    spec = vision_spec(model)
    prefix, conts, pixels = vlm_pack(seed=2)
    changed = [list(p) for p in pixels]
    changed[0] = [p + 1.0 for p in pixels[0]]

    def losses(px, attention="batched"):
        patch_model(model, Backend(gdn="torch", attention=attention))
        return torch.tensor(packed_run(model, prefix, conts, spec, px)[0])

    a, b = losses(pixels), losses(changed)
    assert (a[0] - b[0]).abs() > 1e-6  # C1 does read its image
    assert torch.equal(a[1:], b[1:])  # nobody else does, bitwise
    monkeypatch.setattr(layout_module, "shared_prefix_allowed", lambda sq, skv, q, kv: kv <= q)
    a, b = losses(pixels, "dense"), losses(changed, "dense")
    assert not torch.equal(a[1:], b[1:])  # the check catches a leak


def test_merged_grid_advances_the_cursor_by_its_longer_side():
    spec = VisionSpec(image_token_id=7, merge_size=2)
    c = 11
    ids = [1, 2] + [7] * (14 * 20) + [3]  # a 14 x 20 merged grid (28 x 40 patches)
    axes, end = mrope_positions(ids, [(1, 28, 40)], spec, start=c - 2)
    t, h, w = axes
    assert (t[2], h[2], w[2]) == (c, c, c)  # first image token at the cursor
    assert (h[2 + 14 * 20 - 1], w[2 + 14 * 20 - 1]) == (c + 13, c + 19)  # last row, last column
    assert (t[-1], h[-1], w[-1]) == (c + 20, c + 20, c + 20)  # the following text: c + 20, not c + 280
    assert end == c + 21


def test_packed_coordinates_equal_standalone_coordinates_from_transformers():
    """Every continuation's (t, h, w) coordinates in the pack equal transformers' get_rope_index on the
    standalone example."""
    model = tiny_vlm()
    spec = vision_spec(model)
    prefix, conts, _ = vlm_pack(seed=3)
    layout = build_pack_layout(prefix, conts, spec)
    vlm = model.get_base_model().model
    start = len(prefix)
    for i, c in enumerate(conts):
        ids = torch.tensor([list(prefix) + list(c.item_ids) + list(c.target_ids)])
        grids = torch.tensor([list(g) for g in c.images]) if c.images else None
        ref, _ = vlm.get_rope_index(ids, mm_token_type_ids=(ids == IMAGE).int(), image_grid_thw=grids)
        n = len(c)
        packed = layout.position_ids[1:, 0, start:start + n]
        assert torch.equal(packed, ref[:, 0, len(prefix):]), f"continuation {i}"
        start += n
    assert torch.equal(layout.position_ids[1:, 0, :len(prefix)], torch.arange(len(prefix)).expand(3, -1))


def test_images_in_the_prefix_are_refused():
    with pytest.raises(ValueError, match="text-only"):
        build_pack_layout([1, IMAGE, 2], [Continuation([3], [4])], VisionSpec(IMAGE, 2))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_vlm_loss_in_chunks_of_5_rows_equals_standalone_and_transformers(moe, monkeypatch):
    """float64, the MLPs in the fixture's 7-row tiles and the loss in chunks of 5 target rows: packed == standalone
    == the loss in one chunk, and all equal transformers' own forward on each example (its MLPs whole, its loss one
    cross-entropy) as closely as the loss in one chunk does (1.3e-7 here, chunked or not: the vision path keeps a
    float32 rounding the float64 patch does not reach)."""
    with without_float32_casts(monkeypatch):
        model = tiny_vlm(0, moe)
        prefix, conts, pixels = vlm_pack(0)
        d = compare(model, prefix, conts, vision_spec(model), pixels, loss_chunk_rows=5)
        whole = compare(model, prefix, conts, vision_spec(model), pixels, loss_chunk_rows=0)
        reference = torch.tensor(hf_vlm_losses(model, prefix, conts, pixels), dtype=torch.float64)
    assert d.loss < 1e-13 and d.grad < (5e-7 if moe else 1e-9), d
    chunked = torch.tensor(d.losses_a, dtype=torch.float64)
    assert ((chunked - torch.tensor(whole.losses_a, dtype=torch.float64)).abs() / chunked).max() < 1e-13
    assert ((chunked - reference).abs() / reference).max() < 1e-6
