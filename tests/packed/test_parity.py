"""The central promise: every continuation of a pack trains exactly as if it were alone.

Per-example losses and every trainable gradient (LoRA with random A and B on attention, MLP and Gated DeltaNet
projections) of one packed forward/backward equal those of the examples run one by one through the model's own
unmodified forward, and the losses equal transformers' forward with labels.

Tolerances: measured worst case over CASES (relative; gradients as max|diff| / max|grad| per tensor), then a
margin. Reproduce with the loop in `compare` over CASES.
- float64 with the model's float32 casts removed (test-only patch, `without_float32_casts`): losses 1.2e-15
  (summation order only), gradients 3.6e-8 — the GDN gate still computes `a.float()` in both paths, so that
  gradient is rounded to float32 at slightly different inputs. Bounds 1e-13 and 5e-7.
- float64 as shipped: the model casts to float32 in RMSNorm, the gated norm and transformers' chunk rule
  (packed P is chunked from 0 and each continuation from |P|; standalone from 0 throughout): losses 1.1e-6
  (also vs transformers' forward), gradients 3.9e-5. Bounds 5e-6 and 1e-4.
- float32: losses 2.9e-7 (3.8e-7 vs transformers), gradients 5.8e-5. Bounds 3e-6 and 2e-4.
A leak is orders of magnitude above all of these (tests/packed/test_leaks.py shows the check failing).

The packed and standalone forwards run their MLPs in recomputed tiles of 7 rows (the back end's ``mlp_rows``) and
every norm in tiles of 5 rows (``norm_rows``), small enough that every buffer is split, transformers' no-grad
reference in one piece.
"""

import pytest
import torch
from parity import compare, hf_losses, max_rel, packed_run, rel, without_float32_casts
from tiny_models import patched_lora_model, random_pack, tiny_lora_model

from packtrain.packed.kernels import Backend
from packtrain.packed.patch import patch_model

L, F = "linear_attention", "full_attention"

# (prefix length, [(item length, target length), ...], layer types)
CASES = [
    (1, [(0, 1), (5, 3), (70, 4)], [F, L, L, F]),
    (2, [(1, 1), (60, 8)], [L, F, L, L]),
    (3, [(0, 2), (2, 1), (130, 70)], [L, L, F, L]),
    (5, [(10, 1)], [L, L, L, F]),  # one continuation
    (63, [(1, 1), (64, 1), (0, 3), (40, 30)], [F, L, L, L]),
    (64, [(63, 2), (65, 6), (3, 1)], [L, F, L, F]),
    (65, [(0, 1), (3, 1), (70, 5), (130, 20), (10, 1)], [L, F, L, L, F]),
    (130, [(i % 9, 1 + i % 4) for i in range(14)], [L, L, F, L]),  # many continuations
    (7, [(200, 80), (3, 2)], [L, F]),  # a continuation over 256 tokens: the GDN continuations in chunks of 32
]
IDS = [f"P{c[0]}-n{len(c[1])}" for c in CASES]


def _model(layer_types, dtype, seed=0):
    model = tiny_lora_model(layer_types, dtype=dtype, seed=seed)
    return patch_model(model, Backend(gdn="torch", attention="batched", mlp_rows=7, norm_rows=5))


@pytest.mark.parametrize("prefix_len,specs,layer_types", CASES, ids=IDS)
def test_float64_exact_packed_equals_standalone(prefix_len, specs, layer_types, monkeypatch):
    with without_float32_casts(monkeypatch):
        model = _model(layer_types, torch.float64)
        prefix, conts = random_pack(prefix_len, specs, seed=prefix_len)
        d = compare(model, prefix, conts)
    assert d.loss < 1e-13, d
    assert d.grad < 5e-7, d


@pytest.mark.parametrize("prefix_len,specs,layer_types", CASES, ids=IDS)
def test_float64_as_shipped_equals_standalone_and_transformers(prefix_len, specs, layer_types):
    model = _model(layer_types, torch.float64)
    prefix, conts = random_pack(prefix_len, specs, seed=prefix_len)
    d = compare(model, prefix, conts)
    assert d.loss < 5e-6, d
    assert d.grad < 1e-4, d
    reference = torch.tensor(hf_losses(model, prefix, conts), dtype=torch.float64)
    packed = torch.tensor(d.losses_a, dtype=torch.float64)
    assert ((packed - reference).abs() / reference.abs()).max() < 5e-6


def test_loss_in_chunks_of_5_rows_packed_equals_standalone_and_one_chunk(monkeypatch):
    """train.loss_chunk_rows 5: chunks within an example's targets and across examples. Packed == standalone with
    the parity bounds; == the loss in one chunk within summation order (1e-13)."""
    prefix_len, specs, layer_types = CASES[2]
    with without_float32_casts(monkeypatch):
        model = _model(layer_types, torch.float64)
        prefix, conts = random_pack(prefix_len, specs, seed=prefix_len)
        d = compare(model, prefix, conts, loss_chunk_rows=5)
        one_losses, one_grads = packed_run(model, prefix, conts)
        losses, grads = packed_run(model, prefix, conts, loss_chunk_rows=5)
    assert d.loss < 1e-13 and d.grad < 5e-7, d
    assert rel(torch.tensor(losses), torch.tensor(one_losses)) < 1e-13
    assert max_rel(grads, one_grads) < 1e-13


@pytest.mark.parametrize("prefix_len,specs,layer_types", CASES[::2], ids=IDS[::2])
def test_float32_packed_equals_standalone(prefix_len, specs, layer_types):
    model = _model(layer_types, torch.float32)
    prefix, conts = random_pack(prefix_len, specs, seed=prefix_len)
    d = compare(model, prefix, conts)
    assert d.loss < 3e-6, d
    assert d.grad < 2e-4, d
    reference = torch.tensor(hf_losses(model, prefix, conts))
    assert ((torch.tensor(d.losses_a) - reference).abs() / reference.abs()).max() < 3e-6


def test_dense_and_batched_attention_agree(monkeypatch):
    """The dense-mask path (built straight from the predicate) and the batched path compute the same thing."""
    with without_float32_casts(monkeypatch):
        prefix, conts = random_pack(65, [(0, 1), (70, 5), (10, 2)], seed=3)
        results = []
        for attention in ("dense", "batched"):
            model = patched_lora_model([F, L, F], seed=1, backend=Backend(gdn="torch", attention=attention))
            from parity import packed_run

            results.append(packed_run(model, prefix, conts))
    (la, ga), (lb, gb) = results
    assert torch.allclose(torch.tensor(la), torch.tensor(lb), rtol=1e-13, atol=0)
    for n in ga:
        assert torch.allclose(ga[n], gb[n], rtol=1e-10, atol=1e-14), n
