"""Checkpoint directories laid out like released ones, built from tiny random models for the loading tests.

Sharded safetensors with an index (transformers' own ``save_pretrained``), optionally: the tokenizer copied in,
extra tensors the model class does not load (``mtp.*``, as Qwen3.6 ships its multi-token-prediction head) in a shard
of their own, the vision-language key layout, bf16 on disk.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from cli_helpers import REPO, TINY_MODEL
from safetensors.torch import save_file

BUNDLED_TOKENIZER = REPO / "packtrain" / "assets" / "tokenizer"
VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32,
          "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64}


def text_config(**over) -> dict:
    return {**TINY_MODEL, **over}


def hf_model(config: dict, seed: int = 0, scale: float | None = 0.2):
    """A random transformers model from a packtrain-style config dict (``model_type`` included)."""
    from transformers import AutoConfig

    from packtrain.models.build import model_class_for

    raw = dict(config)
    model_type = raw.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **raw)
    torch.manual_seed(seed)
    model = model_class_for(model_type)(hf_config)
    if scale is not None:  # weights large enough that every tensor moves the logits
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, scale)
    return model


def vlm_config(text: dict | None = None, **over) -> dict:
    text = dict(text or TINY_MODEL)
    text.pop("model_type", None)
    return {"model_type": "qwen3_5", "text_config": text, "vision_config": VISION, "image_token_id": 1000,
            "video_token_id": 1001, "vision_start_token_id": 1002, "vision_end_token_id": 1003,
            "tie_word_embeddings": text.get("tie_word_embeddings", False), **over}


MTP_TENSORS = {"mtp.fc.weight": (32, 64), "mtp.norm.weight": (32,), "mtp.layers.0.mlp.up_proj.weight": (48, 32)}


def save_checkpoint(path: Path, config: dict, *, shard_kb: int | None = 40, dtype: torch.dtype = torch.float32,
                    tokenizer: bool = True, mtp: bool = True, seed: int = 0, model=None) -> Path:
    """``config`` saved as a checkpoint directory; returns it. ``mtp``: extra tensors in a shard of their own."""
    model = model if model is not None else hf_model(config, seed)
    model.to(dtype).save_pretrained(path, max_shard_size=f"{shard_kb}KB" if shard_kb else "50GB")
    if tokenizer:
        for f in BUNDLED_TOKENIZER.iterdir():
            shutil.copy(f, path / f.name)
    if mtp:
        add_extra_tensors(path, {k: torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(dtype)
                                 for i, (k, shape) in enumerate(MTP_TENSORS.items())})
    return path


def add_extra_tensors(path: Path, tensors: dict[str, torch.Tensor], name: str = "model-extra.safetensors") -> None:
    """Add ``tensors`` in a shard file of their own and list them in the index (made if the checkpoint had one
    file)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
    else:
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            data = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    save_file(tensors, str(path / name), metadata={"format": "pt"})
    data["weight_map"].update({k: name for k in tensors})
    index.write_text(json.dumps(data, indent=2))


def relayout_as_vlm_text(path: Path) -> None:
    """Rename a text checkpoint's ``model.*`` keys to the vision-language layout ``model.language_model.*``
    (how Qwen3.6 ships), keeping its text config: a text class must read it through transformers' key mapping."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    new_map = {}
    for shard in sorted(set(data["weight_map"].values())):
        with safe_open(str(path / shard), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                   for k, v in tensors.items()}
        save_file(renamed, str(path / shard), metadata={"format": "pt"})
        new_map.update({k: shard for k in renamed})
    data["weight_map"] = new_map
    index.write_text(json.dumps(data, indent=2))


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))
