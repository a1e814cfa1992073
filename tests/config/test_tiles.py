"""The savings' keys and the tile defaults (packtrain/config/tiles.py): what auto resolves to for a model that only
runs forwards, and train.offload as a layer count."""

import pytest
from cli_helpers import TINY_MODEL

from packtrain.config import config_from_dict
from packtrain.config.tiles import AUTO, KEYS, TILE_ROWS, device_tiles, inference_rows, offload_layers


def _cfg(**train):
    return config_from_dict({"model": {"config": TINY_MODEL}, "train": train}, source="test")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_auto_rows_of_a_forward_only_model_are_the_devices_tiles(device):
    tiles = TILE_ROWS[device]
    assert inference_rows(_cfg(), device) == (tiles["loss"], tiles["mlp"], tiles["norm"])
    # given values are kept, 0 and null included
    assert inference_rows(_cfg(loss_chunk_rows=0, mlp_chunk_rows=None, norm_chunk_rows=7), device) == (0, None, 7)


def test_a_device_other_than_the_cpu_takes_cudas_tiles():
    assert device_tiles("cpu") is TILE_ROWS["cpu"] and device_tiles("xpu") is TILE_ROWS["cuda"]
    assert TILE_ROWS["cpu"] != TILE_ROWS["cuda"]  # else the line above could not tell them apart


@pytest.mark.parametrize("value,expected", [(True, 12), (False, 0), (5, 5), (0, 0), ("auto", "auto")])
def test_offload_as_a_layer_count(value, expected):
    assert offload_layers(value, 12) == expected


def test_every_savings_key_defaults_to_auto():
    cfg = _cfg()
    assert {k: getattr(cfg.train, k) for k in KEYS} == dict.fromkeys(KEYS, AUTO)
