"""The one model assembly (packtrain/models/wrap.py): the savings as layers see them (checkpointed, offloaded from
the first N), the FSDP units, a forward-only model's tiles, and an adapter new, trained or none. Sharding itself is
tests/test_distributed.py's (ranks over gloo)."""

import pytest
import torch
from cli_helpers import TINY_MODEL

from packtrain.config import config_from_dict
from packtrain.config.tiles import TILE_ROWS
from packtrain.models.build import build_base_model
from packtrain.models.offload import OffloadedCheckpoint
from packtrain.models.wrap import assemble, decoder_layers, fsdp_units, with_adapter
from packtrain.packed.patch import text_parts

CHOSEN = {"activation_checkpointing": False, "offload": False, "loss_chunk_rows": 0, "mlp_chunk_rows": 0,
          "norm_chunk_rows": 0}


def _cfg(tie=False, **train):
    model = {**TINY_MODEL, "tie_word_embeddings": tie}
    return config_from_dict({"model": {"config": model, "dtype": "float64", "kernels": "torch"},
                             "lora": {"r": 4, "alpha": 8}, "train": {**CHOSEN, **train}}, source="test")


@pytest.mark.parametrize("offload,expected", [(True, [True, True, True]), (2, [True, True, False]),
                                              (1, [True, False, False])])
def test_the_first_n_layers_inputs_are_offloaded_and_every_layer_checkpointed(offload, expected):
    cfg = _cfg(activation_checkpointing=True, offload=offload)
    model, _, _ = assemble(build_base_model(cfg), cfg, "cpu")
    layers = decoder_layers(model)
    assert all(isinstance(layer, OffloadedCheckpoint) for layer in layers)
    assert [layer.offload for layer in layers] == expected


def test_checkpointing_alone_wraps_every_layer_and_no_saving_wraps_none():
    cfg = _cfg(activation_checkpointing=True)
    model, _, _ = assemble(build_base_model(cfg), cfg, "cpu")
    assert all("CheckpointWrapper" in type(layer).__name__ for layer in decoder_layers(model))
    plain, _, _ = assemble(build_base_model(_cfg()), _cfg(), "cpu")
    assert not any("Checkpoint" in type(layer).__name__ for layer in decoder_layers(plain))


def test_the_embedding_and_head_are_fsdp_units_of_their_own_unless_tied():
    untied, _, _ = assemble(build_base_model(_cfg()), _cfg(), "cpu")
    stack, head = text_parts(untied)
    assert fsdp_units(untied) == [*decoder_layers(untied), stack.embed_tokens, head]
    tied, _, _ = assemble(build_base_model(_cfg(tie=True)), _cfg(tie=True), "cpu")
    assert fsdp_units(tied) == decoder_layers(tied)  # one matrix: it stays with the root


def test_a_forward_only_model_takes_the_devices_tiles_where_auto():
    auto = _cfg(**{k: "auto" for k in CHOSEN})
    _, lm, backend = assemble(build_base_model(auto), auto, "cpu", training=False)
    tiles = TILE_ROWS["cpu"]
    assert (lm.loss_chunk_rows, backend.mlp_rows, backend.norm_rows) == (tiles["loss"], tiles["mlp"], tiles["norm"])
    with pytest.raises(ValueError, match="still auto"):
        assemble(build_base_model(auto), auto, "cpu")  # a training model takes the chosen savings


def test_an_adapter_new_none_or_trained_and_frozen(tmp_path):
    cfg = _cfg()
    new = with_adapter(build_base_model(cfg), cfg, "new")
    trainable = [n for n, p in new.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    base = build_base_model(cfg)
    assert with_adapter(base, cfg, None) is base
    new.save_pretrained(tmp_path / "adapter")
    loaded = with_adapter(build_base_model(cfg), cfg, tmp_path / "adapter")
    assert not any(p.requires_grad for p in loaded.parameters())  # a trained adapter is loaded frozen
    a = dict(new.named_parameters())
    lora = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert lora.keys() == set(trainable)
    for name, p in lora.items():
        assert torch.equal(p, a[name]), name
