"""The packed forward under activation checkpointing, no_grad, standalone mode, back-end choice, bad models."""

import pytest
import torch
from parity import hf_losses, packed_run, standalone_run
from tiny_models import patched_lora_model, random_pack, tiny_lora_model
from transformers import LlamaConfig, LlamaForCausalLM

from packtrain.models.wrap import checkpoint_decoder_layers
from packtrain.packed.kernels import (
    CPU_MLP_ROWS,
    CPU_NORM_ROWS,
    CUDA_MLP_ROWS,
    CUDA_NORM_ROWS,
    Backend,
    select_backend,
)
from packtrain.packed.layout import build_pack_layout, build_standalone_layout
from packtrain.packed.lm import PackCall, PackedLM, StandaloneCall
from packtrain.packed.patch import UnsupportedModelError, patch_model

L, F = "linear_attention", "full_attention"
BACKEND = Backend(gdn="torch", attention="batched")


@pytest.mark.parametrize("run", [packed_run, standalone_run], ids=["packed", "standalone"])
def test_activation_checkpointing_changes_nothing(run):
    prefix, conts = random_pack(65, [(0, 1), (70, 5), (10, 2)], seed=7)
    plain = patched_lora_model([L, F, L], seed=3, backend=BACKEND)
    checkpointed = checkpoint_decoder_layers(patched_lora_model([L, F, L], seed=3, backend=BACKEND))
    la, ga = run(plain, prefix, conts)
    lb, gb = run(checkpointed, prefix, conts)
    assert la == lb  # identical, not merely close: the recompute runs the same layout through the same kernels
    ga = {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in ga.items()}
    gb = {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in gb.items()}
    assert ga.keys() == gb.keys()
    for n in ga:
        assert torch.equal(ga[n], gb[n]), n


def test_no_grad_eval_gives_the_training_losses():
    model = patched_lora_model([L, F], seed=4, backend=BACKEND)
    prefix, conts = random_pack(20, [(5, 2), (9, 3)], seed=8)
    losses, _ = packed_run(model, prefix, conts)
    with torch.no_grad():
        out = PackedLM(model)(PackCall(build_pack_layout(prefix, conts)))
    assert out.per_example.tolist() == losses
    assert not out.loss_sum.requires_grad


def test_loss_sum_is_sum_of_per_example_means():
    model = patched_lora_model([L, F], seed=4, backend=BACKEND)
    prefix, conts = random_pack(20, [(5, 2), (9, 3), (1, 7)], seed=9)
    out = PackedLM(model)(PackCall(build_pack_layout(prefix, conts)))
    assert out.target_tokens.tolist() == [2, 3, 7]
    assert torch.isclose(out.loss_sum.detach(), out.per_example.sum(), rtol=1e-14)


def test_unpatched_model_behaves_as_shipped_after_patching():
    model = tiny_lora_model([L, F], seed=5)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        patch_model(model, BACKEND)
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)


def test_unsupported_model_is_a_clear_error():
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        patch_model(LlamaForCausalLM(cfg), BACKEND)
    with pytest.raises(UnsupportedModelError):
        PackedLM(LlamaForCausalLM(cfg))


def test_backend_choice_is_explicit():
    # None: the device's default tile (what a saving the choice turns on takes); 0: whole
    assert select_backend("auto", "cpu") == Backend(gdn="torch", attention="batched", mlp_rows=CPU_MLP_ROWS,
                                                    norm_rows=CPU_NORM_ROWS)
    assert select_backend("torch", "cuda").mlp_rows == CUDA_MLP_ROWS
    assert select_backend("torch", "cuda").norm_rows == CUDA_NORM_ROWS
    assert select_backend("torch", "cuda", mlp_chunk_rows=0, norm_chunk_rows=0) == Backend("torch", "batched")
    assert select_backend("torch", "cpu", mlp_chunk_rows=7, norm_chunk_rows=5).mlp_rows == 7
    assert "mlp=recomputed tiles of 512 rows" in select_backend("torch", "cpu").describe()
    assert "mlp=whole, rmsnorm=whole" in select_backend("torch", "cpu", mlp_chunk_rows=0,
                                                        norm_chunk_rows=0).describe()
    assert select_backend("torch", "cpu", attention="dense").attention == "dense"
    with pytest.raises(ValueError, match="unknown"):
        select_backend("triton", "cpu")


def test_text_stack_of_vision_language_model(monkeypatch):
    """Qwen3_5ForConditionalGeneration (the Qwen3.6 form): text-only packs through its language model.

    Weights that make the recurrent path matter: text matrices at std 0.2 (as tiny_lora_model), slow GDN decay
    (A_log = log U(0.02, 0.2), dt_bias = -2). With the default tiny init, starting every continuation from a zero
    state instead of P's changed the loss by 9e-10 (bound 5e-6: unnoticed); here by 7.3e-2, gradients 2.4.
    Measured: float64 without the float32 casts loss 3e-16, gradients 6.3e-10; as shipped 3.5e-8 / 3.9e-6,
    1.3e-8 vs transformers. Bounds: test_parity.py's.
    """
    from parity import compare, hf_losses, without_float32_casts
    from peft import LoraConfig, get_peft_model
    from tiny_models import tiny_text_config
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen3_5Config(text_config=tiny_text_config([L, F, L]).to_dict(),
                        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                           out_hidden_size=32, patch_size=4, spatial_merge_size=2,
                                           temporal_patch_size=1))
    base = Qwen3_5ForConditionalGeneration(cfg).double()
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "visual" in name:
                continue
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.02, 0.2).log())
            elif name.endswith("dt_bias"):
                p.fill_(-2.0)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "in_proj_qkv", "gate_proj"],
                                            init_lora_weights=False, lora_dropout=0.0))
    patch_model(model, BACKEND)
    assert model.get_base_model().config.vision_config._attn_implementation != "packtrain"  # encoder untouched
    prefix, conts = random_pack(30, [(3, 2), (70, 4)], seed=11)
    d = compare(model, prefix, conts)
    assert d.loss < 5e-6 and d.grad < 1e-4, d  # the float64-as-shipped bounds of test_parity.py
    reference = torch.tensor(hf_losses(model, prefix, conts), dtype=torch.float64)
    assert ((torch.tensor(d.losses_a, dtype=torch.float64) - reference).abs() / reference).max() < 5e-6
    with without_float32_casts(monkeypatch):
        d = compare(model, prefix, conts)
    assert d.loss < 1e-13 and d.grad < 5e-7, d  # float64 throughout: test_parity.py's exact bounds


def test_mlp_tiles_in_every_forward_and_survive_checkpointing():
    """With ``mlp_rows`` every forward runs each dense MLP in tiles of that many rows, packed and standalone, with
    grad (each tile checkpointed: it runs again in backward) and without; the tests' transformers reference sets the
    tiles aside (parity.transformers_mlp). Activation checkpointing's recompute tiles as the forward did (the same
    losses and gradients, bit for bit), and the tiles give the whole MLP's results (float64, 1e-13)."""
    specs = [(0, 1), (70, 5), (10, 2)]
    prefix, conts = random_pack(65, specs, seed=7)
    tiles = Backend(gdn="torch", attention="batched", mlp_rows=16)

    def model(backend, checkpointing=False):
        m = patched_lora_model([L, F, L], seed=3, backend=backend)
        return checkpoint_decoder_layers(m) if checkpointing else m

    def mlp_rows_seen(m, run):
        seen = []
        for layer in m.base_model.model.model.layers:
            mlp = getattr(layer, "_checkpoint_wrapped_module", layer).mlp
            inner = mlp._packtrain_original_forward
            mlp._packtrain_original_forward = lambda x, inner=inner: (seen.append(x.shape[-2]), inner(x))[1]
        return run(m, prefix, conts), seen

    (lb, gb), seen = mlp_rows_seen(model(tiles), packed_run)
    rows = 65 + sum(i + t for i, t in specs)
    assert max(seen) == 16 and sum(seen) == 2 * 3 * rows  # every layer's MLP in tiles, forward and recompute
    lengths = [65 + i + t for i, t in specs]
    (ls, gs), seen_alone = mlp_rows_seen(model(tiles), standalone_run)
    assert max(seen_alone) == 16 and sum(seen_alone) == 2 * 3 * sum(lengths)
    _, seen_hf = mlp_rows_seen(model(tiles), hf_losses)
    assert sorted(seen_hf) == sorted(lengths * 3)

    def no_grad_run(m, prefix, conts):
        with torch.no_grad():
            return PackedLM(m)(StandaloneCall(build_standalone_layout(prefix, conts[1])))

    _, seen_no_grad = mlp_rows_seen(model(tiles), no_grad_run)
    assert max(seen_no_grad) == 16 and sum(seen_no_grad) == 3 * lengths[1]
    (lc, gc), seen_ckpt = mlp_rows_seen(model(tiles, checkpointing=True), packed_run)
    assert max(seen_ckpt) == 16 and sum(seen_ckpt) > 2 * 3 * rows  # the layer's recompute tiles again
    assert lc == lb
    gc = {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in gc.items()}
    assert gc.keys() == gb.keys()
    for n, g in gb.items():
        assert torch.equal(g, gc[n]), n
    for run, (lt, gt) in ((packed_run, (lb, gb)), (standalone_run, (ls, gs))):
        la, ga = run(model(BACKEND), prefix, conts)
        assert torch.allclose(torch.tensor(la), torch.tensor(lt), rtol=1e-13, atol=0)
        for n, g in ga.items():
            assert (g - gt[n]).abs().max() <= 1e-13 * g.abs().max(), n

