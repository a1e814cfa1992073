"""LoRA's compute in the model's dtype, with float32 master weights, and dropout that saves no copy of its input.

peft's ``lora.Linear.forward`` casts the layer input to the adapter's dtype (float32 for a bf16 model: peft's
autocast keeps the adapter weights in float32), drops it out (``nn.Dropout``: another copy and its mask), runs
``lora_B(lora_A(.))`` and multiplies by the scaling: a [T, out] float32 output and its scaled copy before the sum
is cast back. Autograd keeps each adapter's float32 (dropped-out) input, so q/k/v keep three float32 copies of one
bf16 input. At a long pack these copies are a large share of a decoder layer's recompute peak
(``docs/performance.md``, "Memory").

:func:`install` gives every peft ``lora.Linear`` of a model :func:`lora_forward` instead, which adds each active
adapter through :class:`LoraDelta`:

- the weights stay float32 parameters (saving, loading, the optimizer and FSDP see peft's names and dtypes); the
  compute casts A and B (r rows each) to the input's dtype and returns float32 gradients for them, as FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)`` would reduce them; dx is in the input's dtype;
- it saves the input tensor itself (the one object the base layer and the sibling adapters see, so q/k/v save it
  once), A, B and the [T, r] product, and adds its [T, out] delta into the base output in place;
- dropout draws its mask as ``F.dropout`` on the CPU does and keeps the RNG state, not the mask: backward draws the
  same mask again (as torch's checkpoint replays RNG). A checkpoint's recompute restores the RNG state before it
  reruns the forward, so the recompute draws the forward's masks. With dropout 0 nothing random is drawn.

What this forward does not cover (merged or disabled adapters, ``adapter_names`` batches, variants such as DoRA,
a ``lora_B`` bias, another dropout module) goes to peft's own forward. MoE expert LoRA (``target_parameters``,
peft's ``ParamWrapper``) is left as peft runs it.
"""

from __future__ import annotations

import types

import torch
from peft.tuners.lora.layer import VARIANT_KWARG_KEYS
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn

from packtrain.packed.rng import replay, rng_state


def install(model: nn.Module) -> None:
    """Every peft ``lora.Linear`` of ``model`` runs :func:`lora_forward` (called once, before anything wraps those
    forwards: kv_only's row-sparse backward wraps the one installed here)."""
    for layer in model.modules():
        if type(layer) is PeftLoraLinear:
            layer.forward = types.MethodType(lora_forward, layer)


def describe(model: nn.Module) -> str | None:
    """One header line: how many adapted linears compute here, in what dtype, and their dropout."""
    layers = [m for m in model.modules() if type(m) is PeftLoraLinear]
    if not layers:
        return None
    first = layers[0]
    name = first.active_adapters[0]
    weight, compute = first.lora_A[name].weight.dtype, first.base_layer.weight.dtype
    dropout = first.lora_dropout[name]
    p = dropout.p if isinstance(dropout, nn.Dropout) else 0.0
    masks = f"dropout {p:g}, masks drawn again in backward" if p else "no dropout"
    return (f"LoRA compute: {len(layers)} adapted linears in {str(compute)[6:]} ({str(weight)[6:]} weights and "
            f"gradients; no float32 input copies), {masks}")


def lora_forward(self: PeftLoraLinear, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's ``lora.Linear.forward`` for a plain active adapter, computed by :class:`LoraDelta`."""
    if not _covered(self, kwargs):
        return PeftLoraLinear.forward(self, x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    for name in self.active_adapters:
        if name not in self.lora_A:
            continue
        dropout = self.lora_dropout[name]
        p = dropout.p if isinstance(dropout, nn.Dropout) and dropout.training else 0.0
        result = LoraDelta.apply(x, result, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name], p)
    return result


def _covered(self: PeftLoraLinear, kwargs: dict) -> bool:
    if self.disable_adapters or self.merged or kwargs.keys() & {"adapter_names", *VARIANT_KWARG_KEYS}:
        return False
    for name in self.active_adapters:
        if name in self.lora_A and (name in self.lora_variant or self.lora_B[name].bias is not None
                                    or type(self.lora_dropout[name]) not in (nn.Dropout, nn.Identity)):
            return False
    return True


def _mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """The kept elements scaled by 1 / (1 - p), drawn as ``F.dropout`` draws on the CPU (the same mask there)."""
    return torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)


class LoraDelta(torch.autograd.Function):
    """``result += dropout_p(x) @ A^T @ B^T * scaling`` in x's dtype, in place; A and B stay in their own dtype.

    Shapes: x [..., in], result [..., out], A [r, in], B [out, r]; u = dropout(x) @ A^T is [..., r]."""

    @staticmethod
    def forward(ctx, x, result, A, B, scaling: float, p: float):
        dtype = x.dtype
        ctx.rng = rng_state(x.device) if p > 0 else None
        x_in = _mask(x, p).mul_(x) if p > 0 else x
        u = x_in @ A.to(dtype).T
        del x_in
        # B scaled before the cast: no [T, out] product is scaled, and the delta is summed into result by addmm
        result.view(-1, result.shape[-1]).addmm_(u.view(-1, u.shape[-1]), (B * scaling).to(dtype).T)
        ctx.mark_dirty(result)
        ctx.save_for_backward(x, A, B, u)
        ctx.scaling, ctx.p = scaling, p
        return result

    @staticmethod
    def backward(ctx, grad):
        x, A, B, u = ctx.saved_tensors
        dtype, s, p = x.dtype, ctx.scaling, ctx.p
        g = grad.reshape(-1, grad.shape[-1])
        u = u.view(-1, u.shape[-1])
        gu = g @ (B * s).to(dtype)  # d loss / d u, [T, r]
        dx = dA = dB = None
        mask = None
        if p > 0:
            with replay(ctx.rng, x.device):
                mask = _mask(x, p)
        if ctx.needs_input_grad[0]:
            dx = (gu @ A.to(dtype)).view(x.shape)
            if mask is not None:
                dx.mul_(mask)
        if ctx.needs_input_grad[2]:
            x_in = mask.mul_(x) if mask is not None else x
            dA = (gu.T @ x_in.reshape(-1, x.shape[-1])).to(A.dtype)
        if ctx.needs_input_grad[3]:
            dB = (g.T @ u).to(B.dtype) * s
        return dx, grad, dA, dB, None, None
