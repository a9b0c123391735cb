"""The causal-LM loss of sequences split over a sequence-parallel group.

[Note: sequence-parallel loss]
Rank r of a group of K holds the logits of its 1/K of the tokens and their shifted labels ([Note: sequence-parallel
batch] in ``batch.py``).  The loss of the group's sequences is S / T: S the sum over all K slices of the per-token
cross-entropies, T the number of labels that are not -100 in the whole sequences; one all-reduce of (S_r, T_r) in
the group gives both, so every rank of the group returns the same value, the one the unsplit sequences give.

Its backward is not that value's: ZeRO averages gradients over all N = D K ranks (D = N / K data-parallel
groups), and rank r's parameters only see the gradient of its own tokens, ∂S_r/∂θ (the attention exchange carries
the cross-slice terms back to the rank whose tokens they came from).  So each rank seeds its own S_r with K / T_g
(T_g its group's count) instead of 1 / T_g.  The average over the N ranks is then
(1/N) Σ_g Σ_r (K / T_g) ∂S_r/∂θ = (1/D) Σ_g ∂(S_g / T_g)/∂θ: the mean over the data-parallel groups of each
group's whole-sequence loss gradient, what D data-parallel ranks without sequence parallelism compute
(``tests/unit/test_sequence_parallel.py`` checks it on one process, and the parity tests across ranks).  Every
rank of a group must backward the same multiple of the returned loss (a gradient-accumulation or loss-scaling
factor is the same on every rank), as each rank scales only its own slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.collectives import Comm
from .batch import IGNORE_INDEX
from .parallel import sequence_parallel_of

__all__ = ["sequence_loss", "sequence_parallel_loss", "token_loss_sum"]


class _GroupMean(torch.autograd.Function):
    """S / T over the group in forward, K / T into this rank's S_r in backward ([Note: sequence-parallel loss])."""

    @staticmethod
    def forward(ctx, local_sum: torch.Tensor, local_count: torch.Tensor, comm: Comm) -> torch.Tensor:
        totals = torch.stack([local_sum.detach().to(torch.float64), local_count.to(torch.float64)])
        comm.all_reduce(totals, tag="sequence loss")
        count = totals[1].clamp(min=1.0)  # no label at all: loss 0, no gradient
        ctx.scale = comm.world_size / count
        return (totals[0] / count).to(local_sum.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale.to(grad.dtype), None, None


def sequence_loss(logits: torch.Tensor, shift_labels: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[Note: sequence-parallel loss] of ``logits`` ``[b, s/K, vocab]`` against this rank's ``shift_labels``
    ``[b, s/K]`` over ``comm``'s group; cross-entropy in float32 at least (float64 logits stay float64)."""
    if logits.shape[:2] != shift_labels.shape:
        raise ValueError(
            f"sequence parallelism: logits {tuple(logits.shape)} and shift_labels {tuple(shift_labels.shape)} "
            "must cover the same tokens ([batch, seq/K, vocab] and [batch, seq/K]: the outputs of the batch "
            "split's input_ids and its shift_labels)"
        )
    labels = shift_labels.to(logits.device)
    return _GroupMean.apply(token_loss_sum(logits, labels), (labels != IGNORE_INDEX).sum(), comm)


def token_loss_sum(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """S_r of [Note: sequence-parallel loss]: the per-token cross-entropies of this rank's tokens summed, in float32
    at least, labels -100 left out.  For a loop that normalises the sum itself (the HF Trainer's
    ``num_items_in_batch``): each rank must then scale its own S_r as the Note says."""
    if logits.element_size() < 4:
        logits = logits.float()
    labels = shift_labels.to(logits.device)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def sequence_parallel_loss(logits: torch.Tensor, shift_labels: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """:func:`sequence_loss` over ``model``'s sequence-parallel group (``zp.setup`` with
    ``ZeroConfig(sequence_parallel_size=K)``): the whole sequences' mean per-token loss on every rank of the
    group, with the backward ZeRO's average over all ranks needs ([Note: sequence-parallel loss])."""
    return sequence_loss(logits, shift_labels, sequence_parallel_of(model).comm)
