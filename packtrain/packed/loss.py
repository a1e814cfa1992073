"""The target cross-entropy, and the check that the loss still reaches the adapters.

Every forward of packtrain reads logits only at target positions (the target-only head) and takes the
cross-entropy in float32, or float64 for a float64 model, whatever the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CUT_OFF = ("the adapters are cut off from the loss: frozen embeddings without enable_input_require_grads, a "
           "detached layer, or lora.target_modules the loss does not depend on")


class ZeroGradientError(RuntimeError):
    pass


def target_cross_entropy(logits: torch.Tensor, target_ids: torch.Tensor, reduction: str = "none") -> torch.Tensor:
    ce_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return F.cross_entropy(logits.to(ce_dtype), target_ids, reduction=reduction)


def require_grad(loss: torch.Tensor) -> None:
    """A training forward's loss must depend on something trainable."""
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise ZeroGradientError(CUT_OFF + " (the loss does not require grad at all)")
