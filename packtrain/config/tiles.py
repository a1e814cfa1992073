"""The memory savings' keys in ``train`` (each may be ``auto``) and the tile each tiled saving takes by device when it
is on: the one home of the tile defaults, read by the kernels' back end (:func:`packtrain.packed.kernels.select_backend`),
the memory estimate, the savings' choice and the assembly of a model that only runs forwards. Torch-free.

The MLP's tile on CPU keeps one [rows, intermediate] activation in a core's cache (the bench model's [512, 768] float32
is 1.5 MiB, under a 2 MiB L2; docs/performance.md, "MLP blocks"); on CUDA it is the tile the memory measurement of the
seed pack took (a 27B tile's [8192, 17408] bf16 is 272 MiB against 4.3 GiB for the whole pack's; docs/performance.md,
"Memory", "Tiled MLP and norms"). The norm's tile on CUDA: six float32 pieces at the 27B's width are 1 GiB; on CPU the
MLP's. The loss chunk: three float32 [rows, V] at V 248,320 under 1 GiB.
"""

from __future__ import annotations

AUTO = "auto"
# the train keys of the memory savings: each auto (chosen by need, packtrain.memory.savings) or given
KEYS = ("activation_checkpointing", "offload", "loss_chunk_rows", "mlp_chunk_rows", "norm_chunk_rows")

TILE_ROWS = {"cpu": {"loss": 256, "mlp": 512, "norm": 512},
             "cuda": {"loss": 256, "mlp": 8192, "norm": 8192}}


def device_tiles(device: str) -> dict[str, int]:
    """The tiles of ``device`` (a device type: ``cpu``, ``cuda``; any other takes CUDA's)."""
    return TILE_ROWS["cpu" if device == "cpu" else "cuda"]


def inference_rows(cfg, device: str) -> tuple[int, int | None, int]:
    """(loss, MLP, norm) rows of a model that only runs forwards without grad (``eval``, generation) where the config
    leaves them auto: the device's tiles, which recompute nothing without a backward and hold no [rows, vocabulary]
    or [rows, intermediate] larger than one tile."""
    t, tiles = cfg.train, device_tiles(device)

    def pick(value, tile):
        return tile if value == AUTO else value

    return pick(t.loss_chunk_rows, tiles["loss"]), pick(t.mlp_chunk_rows, tiles["mlp"]), pick(t.norm_chunk_rows,
                                                                                             tiles["norm"])


def offload_layers(offload, layers: int):
    """``train.offload`` as a count of the model's ``layers`` decoder layers whose inputs go to host memory (true:
    all, false: none, N: the first N); ``auto`` stays ``auto``."""
    if offload is True:
        return layers
    if offload is False:
        return 0
    return offload if offload == AUTO else int(offload)
