"""Load the base model (a local directory, or a config dict with random init) and put LoRA on it.

No downloads: ``model.path`` must be a local transformers directory. A random model built from
``model.config`` is saved to ``OUTPUT/base/`` so any tool (peft, transformers) can load the base the adapter
belongs to.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from packtrain.config import Config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def model_class_for(model_type: str):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    classes = {"qwen3_5_text": Qwen3_5ForCausalLM, "qwen3_5": Qwen3_5ForConditionalGeneration}
    if model_type not in classes:
        raise ValueError(f"model.config.model_type: {model_type!r} is not supported "
                         f"(supported: {', '.join(classes)})")
    return classes[model_type]


def build_base_model(cfg: Config, save_to: Path | None = None) -> nn.Module:
    """The base model in ``model.dtype``; from ``model.config`` it is seeded and saved to ``save_to``."""
    from transformers import AutoConfig

    dtype = DTYPES[cfg.model.dtype]
    if cfg.model.path is not None:
        path = cfg.resolve_path(cfg.model.path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model.path: {path} is not a local transformers model directory (no config.json)")
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        cls = model_class_for(hf_config.model_type)
        return cls.from_pretrained(path, dtype=dtype, local_files_only=True, attn_implementation="sdpa")
    if cfg.model.config is None:
        raise ValueError("model: set model.path (a local model directory) or model.config (a config dict)")
    raw = dict(cfg.model.config)
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise ValueError("model.config.model_type: missing (qwen3_5_text or qwen3_5)")
    cls = model_class_for(model_type)
    try:
        hf_config = AutoConfig.for_model(model_type, **raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"model.config: {e}") from None
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(cfg.model.seed)
    model = cls(hf_config).to(dtype)
    if save_to is not None:
        model.save_pretrained(save_to)
    return model


def lora_config(cfg: Config) -> LoraConfig:
    lc = cfg.lora
    return LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=list(lc.target_modules),
                      init_lora_weights=lc.init_lora_weights, modules_to_save=lc.modules_to_save, bias=lc.bias,
                      use_rslora=lc.use_rslora)


def apply_lora(model: nn.Module, cfg: Config) -> nn.Module:
    """LoRA via peft, initialised from ``train.seed``; adapter weights in float32 (peft's autocast) whatever the
    base dtype.

    ``enable_input_require_grads`` marks the frozen embedding's output as requiring grad, so checkpointed layers
    see an input that needs gradients (without it the seed's runs trained with grad_norm exactly 0).
    """
    # get_peft_model draws lora_A (and lora_B when init_lora_weights is False) from torch's global RNG, which
    # nothing else seeds when the base comes from model.path: seed it from the config, the same on every rank, so
    # one config gives one adapter whatever the base's source and the number of ranks (FSDP shards that init).
    torch.manual_seed(cfg.train.seed)
    try:
        model = get_peft_model(model, lora_config(cfg), autocast_adapter_dtype=True)
    except ValueError as e:
        raise ValueError(f"lora: {e}") from None
    model.enable_input_require_grads()
    return model
