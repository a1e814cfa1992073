"""The one place that assembles a model, for train, eval, generate, smoke and bench (:func:`assemble`), always in
this order: LoRA (a new adapter, a trained one, or none) -> model patch -> activation checkpointing (+ offload, for
training) -> FSDP (where the world size asks for it).

Activation checkpointing goes through torch's own checkpoint per decoder layer (the path FSDP composes with),
never transformers' gradient checkpointing: its recompute receives the same keyword arguments, so the pack
layout is rebuilt identically in backward. With ``train.offload`` the checkpointed layer inputs live in host
memory (:mod:`packtrain.models.offload`). FSDP2 ``fully_shard`` goes on every decoder layer, the embedding and the head
(:func:`fsdp_units`), then on the root :class:`~packtrain.packed.lm.PackedLM`, whose forward runs the whole model
(embedding, layers, norm, head). A ``model.path`` base built on the meta device gets its memory last, each rank
reading only its shards (:mod:`packtrain.models.loading`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from packtrain.config import Config
from packtrain.config.tiles import AUTO, KEYS, inference_rows, offload_layers
from packtrain.models.build import adapters_on_cpu, apply_lora
from packtrain.models.loading import (
    SafetensorsCheckpoint,
    WeightMap,
    fix_mmap_threshold,
    is_meta,
    keep_heap_between_steps,
    materialize,
    module_names,
    read_adapter,
    real_tensors,
)
from packtrain.models.offload import DEFAULT_CHUNK_BYTES, ChunkPool, OffloadChain, OffloadedCheckpoint
from packtrain.packed.kernels import Backend, select_backend
from packtrain.packed.lm import PackedLM
from packtrain.packed.patch import patch_model, text_parts


def checkpoint_decoder_layers(model: nn.Module) -> nn.Module:
    """Checkpoint every decoder layer of the text stack (non-reentrant: frozen inputs still give adapter grads)."""
    text_model, _ = text_parts(model)
    layer_type = type(text_model.layers[0])
    apply_activation_checkpointing(
        text_model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, layer_type),
    )
    return model


def offload_decoder_layers(model: nn.Module, pool: ChunkPool, layers: int | None = None) -> nn.Module:
    """Checkpoint every decoder layer; the first ``layers`` (None: all) keep their input in ``pool`` until backward
    needs it, the others on the device. All of them share one :class:`OffloadChain`: in backward, the layer after an
    offloaded one starts copying its input back (:mod:`packtrain.models.offload`)."""
    text_model, _ = text_parts(model)
    n = len(text_model.layers) if layers is None else layers
    chain = OffloadChain(pool)
    for i, layer in enumerate(text_model.layers):
        text_model.layers[i] = OffloadedCheckpoint(layer, chain, i, offload=i < n)
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    text_model, _ = text_parts(model)
    return list(text_model.layers)


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded on their own, each gathered only while it runs: every decoder layer, and the embedding
    and the head when they share no weight (a vocabulary-sized matrix each: 5 GB of Qwen3.6-27B's 54 GB together,
    which as part of the root would stay gathered for the whole forward and backward)."""
    text_model, lm_head = text_parts(model)
    embed = text_model.embed_tokens
    units = decoder_layers(model)
    if not {id(p) for p in embed.parameters()} & {id(p) for p in lm_head.parameters()}:
        units += [embed, lm_head]
    return units


def head_unit_forward(lm_head: nn.Module, target_losses):
    """``target_losses`` run as a forward of the FSDP unit ``lm_head``: its weight gathered once for all the
    loss's chunks and once for all their recomputes in backward, its gradient reduced once (the chunks call the
    head's own ``forward``, which runs no hooks). Calling the unit per chunk would gather the vocabulary-sized
    matrix twice per chunk."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    lm_head.packtrain_target_losses = target_losses
    register_fsdp_forward_method(lm_head, "packtrain_target_losses")
    return lm_head.packtrain_target_losses


def wrap(model: nn.Module, backend: Backend, *, checkpointing: bool = False, offload: int = 0,
         shard: bool = False, device=None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
         context_grad: str = "full", loss_chunk_rows: int = 0, fill=None) -> PackedLM:
    """A LoRA-wrapped model -> the trainable root module. ``offload``: the number of decoder layers (from the
    first) whose checkpointed inputs go to host memory (``train.offload``); it implies checkpointing. ``context_grad``
    is ``packing.context_grad`` (:mod:`packtrain.packed.context`), ``loss_chunk_rows`` ``train.loss_chunk_rows``
    (:mod:`packtrain.packed.loss`).

    ``fill(lm, kept)``: for a model built on the meta device, called last (after ``fully_shard``) to allocate and
    fill each rank's shards; ``kept`` are the tensors that already had values (see :mod:`packtrain.models.loading`)."""
    patch_model(model, backend)
    if offload:
        pin = device is not None and getattr(device, "type", str(device)) == "cuda"
        offload_decoder_layers(model, ChunkPool(chunk_bytes, pin_memory=pin), offload)
    elif checkpointing:
        checkpoint_decoder_layers(model)
    lm = PackedLM(model, context_grad, loss_chunk_rows)
    kept = real_tensors(lm) if fill is not None else None
    if device is not None and fill is None:
        lm = lm.to(device)
    if shard:
        from torch.distributed.fsdp import fully_shard

        units = fsdp_units(model)
        for unit in [*units, lm]:
            fully_shard(unit)
            # The ranks' gradients are summed, not averaged: every rank scales its units' losses by 1 / (the step's
            # examples) as one rank does (run.units.step_scale), so each pack's backward is the 1-rank one bit for
            # bit. A world factor in the loss instead (3 / n at 3 ranks against 1 / n) changed the rounding at the
            # model's float32 casts: a float64 run on 3 ranks differed from 1 rank by 8e-9 after one step. Only SUM
            # reaches the collectives (gloo has no PREMUL_SUM).
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        _, lm_head = text_parts(model)
        if lm_head in units:
            lm.target_losses = head_unit_forward(lm_head, lm.target_losses)
    if fill is not None:
        fill(lm, kept)
    return lm


def assemble(base_model: nn.Module, cfg: Config, device, shard: bool = False, backend: Backend | None = None,
             adapter: str | Path | None = "new", training: bool = True) -> tuple[nn.Module, PackedLM, Backend]:
    """The whole order from a config: the adapter, the back end (``model.kernels``, chosen for ``device``), patch,
    checkpointing / offload (``train.*``, when ``training``) and the loss's chunks, ``packing.context_grad`` and,
    with ``shard`` (more than one rank), FSDP. Returns (the model with its adapter, root, back end).

    ``adapter``: ``"new"`` a LoRA adapter from ``lora.*`` (training); a directory: a trained PEFT adapter, frozen
    (``packtrain eval --adapter DIR``); None: the base model alone (``--adapter none``).
    A base built on the meta device (``build_base_model(..., meta=True)``) is filled last from ``model.path``,
    each rank reading only its shards; the load report is left on the root as ``lm.load_report``. On the CPU the
    process's heap is then kept between steps (:func:`packtrain.models.loading.keep_heap_between_steps`).
    ``backend``: kernels chosen by the caller instead of ``model.kernels`` (``plan --measure`` runs CUDA's on the
    CPU under fake tensors)."""
    fill = None
    if is_meta(base_model):
        fix_mmap_threshold()
        weights = WeightMap(base_model, SafetensorsCheckpoint(cfg.resolve_path(cfg.model.path)))
        names = module_names(base_model)

        def fill(lm, kept):
            lm.load_report = materialize(lm, kept, names, weights, device)
    model = with_adapter(base_model, cfg, adapter)
    t = cfg.train
    if training:
        left = [f"train.{k}" for k in KEYS if getattr(t, k) == AUTO]
        if left:
            raise ValueError(f"assemble: {', '.join(left)} still auto: a training model takes the chosen savings "
                             "(packtrain.run.units.choose_savings)")
        loss_rows, mlp_rows, norm_rows = t.loss_chunk_rows, t.mlp_chunk_rows, t.norm_chunk_rows
    else:
        loss_rows, mlp_rows, norm_rows = inference_rows(cfg, torch.device(device).type)
    backend = backend or select_backend(cfg.model.kernels, device, mlp_chunk_rows=mlp_rows, norm_chunk_rows=norm_rows,
                                        gdn_kernel=cfg.model.gdn_kernel)
    offload = 0
    if training:
        offload = offload_layers(t.offload, len(decoder_layers(model)))
    lm = wrap(model, backend, checkpointing=training and bool(t.activation_checkpointing), offload=offload,
              shard=shard, device=device, context_grad=cfg.packing.context_grad, loss_chunk_rows=loss_rows,
              fill=fill)
    if torch.device(device).type == "cpu":  # activations are host memory: keep them between steps
        keep_heap_between_steps()
    return model, lm, backend


def root(model: nn.Module, cfg: Config) -> PackedLM:
    """Another root over a model :func:`assemble` made (one rank, no FSDP), under ``cfg``'s
    ``packing.context_grad`` and ``train.loss_chunk_rows``: the bench's variants train one model under each of
    their configs."""
    return PackedLM(model, cfg.packing.context_grad, cfg.train.loss_chunk_rows)


def with_adapter(base_model: nn.Module, cfg: Config, adapter: str | Path | None) -> nn.Module:
    """``base_model`` with a new LoRA adapter (``"new"``), a trained one loaded frozen (a directory), or none.

    On a meta-device base peft would load a trained adapter's tensors into meta tensors (a no-op, and the fill then
    finds them missing): its layers are made on the CPU and loaded there (:class:`adapters_on_cpu`), kept through
    the fill as the tensors that had values."""
    if adapter is None:
        return base_model
    if adapter == "new":
        return apply_lora(base_model, cfg)
    from peft import PeftConfig, PeftModel, get_peft_model, set_peft_model_state_dict

    if not is_meta(base_model):
        return PeftModel.from_pretrained(base_model, adapter, is_trainable=False)
    config = PeftConfig.from_pretrained(str(adapter))
    config.inference_mode = True
    with adapters_on_cpu(base_model) as cpu:
        model = get_peft_model(base_model, config, autocast_adapter_dtype=True)
        cpu.drop_copies()
        result = set_peft_model_state_dict(model, read_adapter(Path(adapter)), low_cpu_mem_usage=True)
    missing = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
    if missing:
        raise ValueError(f"--adapter: {adapter} lacks {len(missing)} adapter tensors of this model, e.g. {missing[0]}")
    return model
