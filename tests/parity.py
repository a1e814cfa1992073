"""Packed vs standalone comparison used by the parity tests (and by the leak tests, which expect it to fail)."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from transformers.models.qwen3 import modeling_qwen3 as hf_qwen3
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from packtrain.models.lora_compute import lora_forward
from packtrain.packed.kernels import torch_ref
from packtrain.packed.layout import build_pack_layout, build_standalone_layout
from packtrain.packed.lm import PackCall, PackedLM, StandaloneCall
from packtrain.packed.patch import patch_model, text_parts


@dataclass
class Diff:
    loss: float  # max relative difference of per-example losses
    grad: float  # max over trainable tensors of max|g_a - g_b| / max|g_b|
    losses_a: list
    losses_b: list


def trainable_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|; zero against zero is 0 (the floor), as a gradient a mode cuts is in both."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def max_rel(a: dict, b: dict) -> float:
    """The largest :func:`rel` over ``b``'s tensors (gradients or parameters by name)."""
    return max(rel(a[n], b[n]) for n in b)


def _with_pixels(layout, conts, pixels):
    """pixels: one [patches, dim] tensor per image of each continuation (a list per continuation)."""
    if pixels is not None:
        images = [p for c, per in zip(conts, pixels) for p in per]
        layout.pixel_values = torch.cat(images) if images else None
    return layout


def packed_run(model, prefix, conts, vision=None, pixels=None, context_grad="full", loss_chunk_rows=0):
    model.zero_grad(set_to_none=True)
    out = PackedLM(model, context_grad, loss_chunk_rows)(PackCall(_with_pixels(build_pack_layout(prefix, conts, vision), conts, pixels)))
    out.loss_sum.backward()
    return out.per_example.tolist(), trainable_grads(model)


def standalone_run(model, prefix, conts, vision=None, pixels=None, context_grad="full", loss_chunk_rows=0):
    model.zero_grad(set_to_none=True)
    lm = PackedLM(model, context_grad, loss_chunk_rows)
    losses = []
    for i, c in enumerate(conts):
        layout = build_standalone_layout(prefix, c, vision)
        out = lm(StandaloneCall(_with_pixels(layout, [c], None if pixels is None else [pixels[i]])))
        out.loss_sum.backward()
        losses.extend(out.per_example.tolist())
    return losses, trainable_grads(model)


def compare(model, prefix, conts, vision=None, pixels=None, context_grad="full", loss_chunk_rows=0) -> Diff:
    """``loss_chunk_rows`` (train.loss_chunk_rows) for both; 0, one chunk, is the loss as one cross-entropy."""
    la, ga = packed_run(model, prefix, conts, vision, pixels, context_grad, loss_chunk_rows)
    lb, gb = standalone_run(model, prefix, conts, vision, pixels, context_grad, loss_chunk_rows)
    assert ga.keys() == gb.keys() and ga
    for name, g in gb.items():  # a zero gradient would make the comparison vacuous
        assert g.abs().max() > 0, f"zero gradient for {name}"
    loss = rel(torch.tensor(la, dtype=torch.float64), torch.tensor(lb, dtype=torch.float64))
    return Diff(loss=loss, grad=max(rel(ga[n], gb[n]) for n in ga), losses_a=la, losses_b=lb)


@contextlib.contextmanager
def peft_lora_forward(model):
    """peft's own ``lora.Linear.forward`` inside, where packtrain installed its own (``lora_compute.install``)."""
    layers = [m for m in model.modules()
              if isinstance(m, PeftLoraLinear) and getattr(vars(m).get("forward"), "__func__", None) is lora_forward]
    installed = [vars(m).pop("forward") for m in layers]
    try:
        yield
    finally:
        for m, forward in zip(layers, installed):
            m.forward = forward


@contextlib.contextmanager
def transformers_mlp(model):
    """For a reference computation: the dense MLPs as transformers wrote them, in one piece (the back end's tiles,
    packtrain/packed/recompute.py, set aside by patching again with ``mlp_rows`` off; then put back)."""
    kernels = getattr(text_parts(model)[0], "packtrain_kernels", None)
    if kernels is None:
        yield
        return
    backend = kernels.backend
    patch_model(model, dataclasses.replace(backend, mlp_rows=None))
    try:
        yield
    finally:
        patch_model(model, backend)


def hf_losses(model, prefix, conts):
    """transformers' own forward with labels on concat(P, Ci), one example at a time (no packtrain code: peft's LoRA
    forward, the MLPs whole)."""
    out = []
    with torch.no_grad(), peft_lora_forward(model), transformers_mlp(model):
        for c in conts:
            ids = torch.tensor([list(prefix) + list(c.item_ids) + list(c.target_ids)])
            labels = torch.full_like(ids, -100)
            start = len(prefix) + len(c.item_ids)
            labels[0, start:] = ids[0, start:]
            out.append(model(input_ids=ids, labels=labels).loss.item())
    return out


def hf_loss_tensors(model, prefix, conts):
    """transformers' own forward on each concat(P, Ci) (peft's LoRA forward, the MLPs whole), the cross-entropy of
    its logits over the target in the model's dtype (its loss function would cast them to float32), with the graph:
    a reference gradient."""
    out = []
    with peft_lora_forward(model), transformers_mlp(model):
        for c in conts:
            ids = torch.tensor([list(prefix) + list(c.item_ids) + list(c.target_ids)])
            logits = model(input_ids=ids).logits[0]
            start = len(prefix) + len(c.item_ids)
            out.append(torch.nn.functional.cross_entropy(logits[start - 1:-1], ids[0, start:]))
    return out


def _rmsnorm_same_dtype(self, x):
    return self._norm(x) * (1.0 + self.weight)


def _plain_rmsnorm_same_dtype(self, x):  # Qwen3: weight * norm(x), not (1 + weight)
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _gated_norm_same_dtype(self, hidden_states, gate):
    var = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(var + self.variance_epsilon)) * torch.nn.functional.silu(gate)


def _recurrent_rule_same_dtype(q, k, v, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, **unused):
    out, state = torch_ref.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel)
    return out, state if output_final_state else None


@contextlib.contextmanager
def without_float32_casts(monkeypatch):
    """Test-only: keep transformers' RMSNorm, gated norm and delta rules (the chunked one, and the token-by-token one
    its cache path takes for a one-token input) in the input dtype, so a float64 run is float64 throughout and
    packed-vs-standalone differences come from summation order alone (every family)."""
    for module, prefix in ((hf, "Qwen3_5"), (hf_moe, "Qwen3_5Moe"), (hf_next, "Qwen3Next")):
        monkeypatch.setattr(getattr(module, f"{prefix}RMSNorm"), "forward", _rmsnorm_same_dtype)
        monkeypatch.setattr(getattr(module, f"{prefix}RMSNormGated"), "forward", _gated_norm_same_dtype)
        monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", torch_ref.chunk_gated_delta_rule)
        monkeypatch.setattr(module, "torch_recurrent_gated_delta_rule", _recurrent_rule_same_dtype)
    monkeypatch.setattr(hf_qwen3.Qwen3RMSNorm, "forward", _plain_rmsnorm_same_dtype)
    yield
