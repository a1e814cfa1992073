"""Merged export: the base checkpoint with the LoRA adapter folded in, in the checkpoint's own layout.

``packtrain export OUTPUT_DIR --merged DIR`` writes DIR as a copy of the base checkpoint directory where every
tensor an adapter touches is replaced: W + scale * B @ A for a LoRA target (peft's ``get_delta_weight``, added in
float32 or wider and cast back to the checkpoint's dtype), the trained copy for a ``modules_to_save`` module. The
base's shard files, key names and index are kept, so serving engines that read the original read DIR; every shard
without a changed tensor is copied byte for byte, and in the others every unchanged tensor keeps its bytes (the
tensors the model class does not load, ``mtp.*``, included). Config, generation config, tokenizer and processor
files are copied. Memory: one shard at a time plus the adapter; the base model is only ever built on the meta
device, to learn its parameter names.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from packtrain.models.loading import INDEX_FILE, SafetensorsCheckpoint, WeightMap, module_names


def _load_adapter(base: nn.Module, adapter_dir: Path) -> nn.Module:
    """The adapter on the meta-device base (adapter weights real, on the CPU), as peft would load it."""
    from peft import LoraConfig, PeftConfig, get_peft_model, set_peft_model_state_dict

    from packtrain.models.build import adapters_on_cpu
    from packtrain.models.loading import read_adapter

    tensors = read_adapter(adapter_dir)  # a damaged file: one line naming it
    config = PeftConfig.from_pretrained(str(adapter_dir))
    if not isinstance(config, LoraConfig):
        raise ValueError(f"--adapter: {adapter_dir} holds a {type(config).__name__}, only LoRA merges")
    if config.use_dora or config.lora_bias:
        raise ValueError(f"--adapter: {adapter_dir} uses DoRA or LoRA biases, which this merge does not support")
    config.inference_mode = True
    with adapters_on_cpu(base) as cpu:  # peft would move the loaded adapter to the base's (meta) device too
        model = get_peft_model(base, config, autocast_adapter_dtype=True)
        cpu.drop_copies()  # modules_to_save copies: meta, then assigned the trained tensors
        result = set_peft_model_state_dict(model, tensors, low_cpu_mem_usage=True)
    missing = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
    if missing:
        raise ValueError(f"--adapter: {adapter_dir} lacks {len(missing)} adapter tensors, e.g. {missing[0]}")
    return model


@torch.no_grad()
def adapter_changes(model: nn.Module, names: dict[nn.Module, str]):
    """(model parameter name -> a function giving the LoRA delta, name -> the trained modules_to_save tensor)."""
    from peft.tuners.lora import LoraLayer

    deltas, replaced = {}, {}
    for module in model.modules():
        if isinstance(module, LoraLayer) and module.active_adapters:
            base_layer = module.get_base_layer()
            for adapter in module.active_adapters:
                if adapter in module.lora_A or adapter in module.lora_embedding_A:
                    deltas[f"{names[base_layer]}.weight"] = lambda m=module, a=adapter: m.get_delta_weight(a)
        copies = getattr(module, "modules_to_save", None)
        original = getattr(module, "original_module", None)
        if isinstance(copies, nn.ModuleDict) and original is not None:
            trained = copies[module.active_adapters[0]]
            for (name, p), (_, orig) in zip(trained.named_parameters(), original.named_parameters()):
                replaced[f"{names[original]}.{name}"] = p.detach()
    return deltas, replaced


def _merge(w: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    wide = torch.promote_types(w.dtype, torch.float32)
    return (w.to(wide) + delta.to(wide)).to(w.dtype)


def _copy_side_files(base_dir: Path, out: Path, extra_dirs: list[Path]) -> list[str]:
    """Every top-level file of the base that is not a weight file (config, generation config, tokenizer,
    processor, chat template, ...), then those of ``extra_dirs`` the base lacks (a tokenizer kept elsewhere)."""
    copied = []
    for d in [base_dir, *extra_dirs]:
        for f in sorted(d.iterdir()):
            if not f.is_file() or f.name.endswith(".safetensors") or f.name == INDEX_FILE or (out / f.name).exists():
                continue
            shutil.copy2(f, out / f.name)
            copied.append(f.name)
    return copied


def export_merged(base_dir: Path, adapter_dir: Path, out: Path, extra_dirs: list[Path] = (), log=print) -> dict:
    """Write the merged checkpoint to ``out`` (which must not exist); returns counts for the report."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from packtrain.models.build import empty_model, model_class_for

    if out.exists():
        raise ValueError(f"--merged: {out} already exists (choose a new directory)")
    hf_config = AutoConfig.from_pretrained(base_dir, local_files_only=True)
    base = empty_model(model_class_for(hf_config.model_type), hf_config, torch.float32)
    names = module_names(base)
    checkpoint = SafetensorsCheckpoint(base_dir)
    weights = WeightMap(base, checkpoint)
    model = _load_adapter(base, adapter_dir)
    deltas, replaced = adapter_changes(model, names)
    source_of = {ckpt_key: name for name, ckpt_key in weights.direct.items()}
    for name in [*deltas, *replaced]:
        if name not in weights.direct:
            raise ValueError(f"{base_dir}: the adapter changes {name}, which the checkpoint does not store as one "
                             "tensor of its own (tied or converted); cannot merge it in the checkpoint's layout")
    tmp = out.parent / f".tmp-{out.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    merged = copied_files = 0
    for shard in checkpoint.files():
        keys = [k for k, f in checkpoint.file_of.items() if f == shard]
        if not any(source_of.get(k) in deltas or source_of.get(k) in replaced for k in keys):
            shutil.copyfile(shard, tmp / shard.name)  # nothing changes in this shard: byte for byte
            copied_files += 1
            continue
        with safe_open(str(shard), framework="pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - a safetensors handle, not a dict
        for key, w in tensors.items():
            name = source_of.get(key)
            if name in deltas:
                tensors[key] = _merge(w, deltas[name]())
                merged += 1
            elif name in replaced:
                new = replaced[name]
                if new.shape != w.shape:
                    raise ValueError(f"{shard.name}: {key} has shape {tuple(w.shape)}, the trained module "
                                     f"{tuple(new.shape)}")
                tensors[key] = new.to(w.dtype).contiguous()
                merged += 1
        save_file(tensors, str(tmp / shard.name), metadata=metadata)
        del tensors
    index = base_dir / INDEX_FILE
    data = json.loads(index.read_text()) if index.is_file() else {"metadata": {}}
    data["weight_map"] = {k: f.name for k, f in checkpoint.file_of.items()}
    data.setdefault("metadata", {})["total_size"] = sum(
        (tmp / f.name).stat().st_size for f in checkpoint.files())
    (tmp / INDEX_FILE).write_text(json.dumps(data, indent=2) + "\n")
    side = _copy_side_files(base_dir, tmp, [d for d in extra_dirs if d is not None and d.is_dir()])
    tmp.rename(out)
    report = {"merged_tensors": merged, "shards": len(checkpoint.files()), "shards_copied_unchanged": copied_files,
              "carried_over_not_loaded": len(weights.extra), "files": side}
    log(f"packtrain export: {out}: {merged} tensors merged, {len(checkpoint.files())} shards "
        f"({copied_files} copied unchanged), {len(weights.extra)} tensors the model class does not load carried "
        f"over ({weights.extra_summary() or 'none'}); copied {', '.join(side) or 'no other files'}")
    return report
