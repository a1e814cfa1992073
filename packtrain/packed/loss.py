"""The target cross-entropy (the one home of head + loss), and the check that the loss still reaches the adapters.

Every forward of packtrain reads logits only at target positions (the target-only head) and takes the
cross-entropy in float32, or float64 for a float64 model, whatever the model's dtype. :func:`target_losses` runs
``lm_head`` and that cross-entropy ``train.loss_chunk_rows`` target rows at a time, each chunk checkpointed: its
logits are dropped after its forward and recomputed in backward, so no [rows, V] tensor larger than one chunk's
exists, forward or backward (three float32 [M, V] tensors would be alive in one cross-entropy's backward).
``train.loss_chunk_rows`` 0 runs all rows at once and keeps what autograd keeps: nothing is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from packtrain.packed.equal import anchored

CUT_OFF = ("the adapters are cut off from the loss: frozen embeddings without enable_input_require_grads, a "
           "detached layer, or lora.target_modules the loss does not depend on")


class ZeroGradientError(RuntimeError):
    pass


def target_losses(lm_head: nn.Module, hidden_MD: torch.Tensor, target_ids: torch.Tensor, chunk_rows: int,
                  constant: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token cross-entropy [M] of the targets ``target_ids`` [M] read off the hidden rows ``hidden_MD`` [M, D],
    ``chunk_rows`` rows per chunk (0: one chunk). ``constant`` [M] (frozen context): rows whose logits are taken
    as constants (the no_grad pass's).

    Each chunk calls ``lm_head.forward`` itself, so autograd differentiates whatever the head holds (LoRA,
    modules_to_save). Not ``lm_head(...)``: under FSDP2 the head is its own unit, and
    :func:`packtrain.models.wrap.wrap` runs this whole function as that unit's forward, so its weight is gathered
    once for all chunks and once for all their recomputes in backward, not once per chunk."""
    if not chunk_rows:  # all rows at once, kept for backward: nothing recomputed
        return _chunk_losses(lm_head, hidden_MD, target_ids, constant)
    rows = chunk_rows
    # one backward node for all chunks, which concatenates their gradients once (a slice per chunk would add up a
    # zero-padded [M, D] gradient per chunk)
    hidden = hidden_MD.split(rows)
    flags = constant.split(rows) if constant is not None else [None] * len(hidden)
    chunks = zip(hidden, target_ids.split(rows), flags)
    return torch.cat([checkpoint(_chunk_losses, lm_head, h, t, c, use_reentrant=False) for h, t, c in chunks])


def _chunk_losses(lm_head: nn.Module, h_CD: torch.Tensor, target_ids: torch.Tensor,
                  constant: torch.Tensor | None) -> torch.Tensor:
    logits = lm_head.forward(h_CD)
    if constant is not None:  # frozen: a target read off P's last row takes its logit from the no_grad pass
        logits = torch.where(constant[:, None], logits.detach(), logits)
    ce_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return F.cross_entropy(logits.to(ce_dtype), target_ids, reduction="none")


def describe(chunk_rows: int) -> str:
    """The run header's line for ``train.loss_chunk_rows``."""
    if chunk_rows == 0:
        return "lm_head + cross-entropy over all target rows at once (train.loss_chunk_rows 0)"
    return f"lm_head + cross-entropy in chunks of {chunk_rows:,} target rows (recomputed in backward)"


def require_grad(loss: torch.Tensor) -> None:
    """A training forward's loss must depend on something trainable."""
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise ZeroGradientError(CUT_OFF + " (the loss does not require grad at all)")


@dataclass
class LossOutput:
    loss_sum: torch.Tensor  # scalar: sum over examples of their mean target cross-entropy
    per_example: torch.Tensor  # [N] detached per-example losses
    target_tokens: torch.Tensor  # [N]
    live: torch.Tensor | None = None  # [N] the per-example losses with their gradient (packtrain.run.objective)
    # [M] each target token's log-probability with its gradient, example after example (grpo's token terms)
    token_logp: torch.Tensor | None = None

    @property
    def num_examples(self) -> int:
        return int(self.per_example.numel())


def examples_loss(lm, layout, hidden: torch.Tensor, positions: torch.Tensor,
                  constant: torch.Tensor | None) -> LossOutput:
    """The loss of ``layout``'s examples (a pack, a group of one, or one example alone) from the final hidden
    states ``hidden`` [1, T', D]: targets read off rows ``positions`` [M], those of ``constant`` [M] (or None) as
    constants, through ``lm``'s (a PackedLM) target-only head; each example's cross-entropy averaged over its
    target tokens."""
    token_loss = lm.target_losses(hidden[0].index_select(0, positions), layout.target_ids, constant=constant)
    n = layout.num_examples
    counts = layout.target_counts.to(token_loss.dtype)
    # each example's target rows lie together, in example order (packed/layout.py): summed per example in sequence,
    # the same bits on every run (index_add_ adds them in parallel on CUDA)
    lengths = layout.target_counts.to(token_loss.device)
    per_example = torch.segment_reduce(token_loss, "sum", lengths=lengths, axis=0) / counts
    loss_sum = per_example.sum()
    if constant is not None:
        # frozen, every target read off P's last row: nothing to learn, but the backward must still run (zero
        # gradients) so that every rank makes the same FSDP calls and the trainer's step goes on
        loss_sum = anchored(loss_sum, hidden[0, 1:])
    return LossOutput(loss_sum=loss_sum, per_example=per_example.detach(), target_tokens=layout.target_counts,
                      live=per_example, token_logp=-token_loss)


def concat_outputs(outs: list[LossOutput]) -> LossOutput:
    """Several forwards' losses as one output, their examples in order (a pair's two answers, each alone)."""
    return LossOutput(loss_sum=sum((o.loss_sum for o in outs[1:]), outs[0].loss_sum),
                      per_example=torch.cat([o.per_example for o in outs]),
                      target_tokens=torch.cat([o.target_tokens for o in outs]),
                      live=torch.cat([o.live for o in outs]),
                      token_logp=None if any(o.token_logp is None for o in outs)
                      else torch.cat([o.token_logp for o in outs]))
