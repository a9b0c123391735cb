"""The LM head and its cross-entropy computed in tiles of tokens, so the ``[tokens, vocab]`` logits never exist
at once (the tiled loss of DeepSpeed's ALST, arXiv 2506.13996 section 3.2; Liger's and Cut Cross-Entropy's fused
linear cross-entropy tile the same product).

[Note: tiled LM loss]
For tokens n with hidden state h_n and label y_n (not ignored), the loss is l_n = lse_n - z_{n,y_n}, with
z_n = W h_n + b and lse_n = logsumexp(z_n).  Forward runs over tiles of ``tile_tokens`` tokens: it computes one
tile's logits, its lse and its picked logit, and drops the logits; what it keeps for backward is the input
``hidden`` itself (a reference, no copy), W, b, the labels and one lse per token.  Backward recomputes each tile's
logits and forms dL/dz_n = g_n (softmax(z_n) - onehot(y_n)) (g_n: the upstream gradient of the sum, 0 for ignored
tokens), then dL/dh_n = dL/dz_n W (that tile's rows of the hidden gradient), dL/dW += dL/dz^T h and
dL/db += Σ_n dL/dz_n, accumulated over the tiles.  So peak memory holds one tile's logits (and their softmax)
instead of all of them, at the price of a second matmul with W per tile in backward (the forward's, recomputed).

Precision follows transformers' causal-LM loss, ``F.cross_entropy(lm_head(hidden).float(), ...)``: the matmul
runs in the inputs' dtype, the logits are taken to float32 at least (float64 stays float64) for the softmax, and
in backward the logits' gradient goes back to the inputs' dtype before its matmuls, as autograd does through the
``.float()``; W's and b's gradients are summed over the tiles in that float32 and cast once at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .loss import _GroupMean
from .parallel import sequence_parallel_of

__all__ = ["tiled_lm_loss"]

DEFAULT_TILE_TOKENS = 1024


class _TiledLinearCrossEntropy(torch.autograd.Function):
    """Σ_n l_n over the tokens whose label is not ``ignore_index``, tile by tile ([Note: tiled LM loss])."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, tile_tokens: int, ignore_index: int):
        kept = labels != ignore_index
        targets = torch.where(kept, labels, 0)
        lse = torch.empty(hidden.shape[0], dtype=_loss_dtype(hidden), device=hidden.device)
        total = torch.zeros((), dtype=lse.dtype, device=hidden.device)
        for rows in _tiles(hidden.shape[0], tile_tokens):
            logits = _tile_logits(hidden[rows], weight, bias)
            lse[rows] = torch.logsumexp(logits, -1)
            picked = logits.gather(1, targets[rows, None]).squeeze(1)
            total += torch.where(kept[rows], lse[rows] - picked, 0).sum()
        ctx.save_for_backward(hidden, weight, bias, targets, kept, lse)
        ctx.tile_tokens = tile_tokens
        return total

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets, kept, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
        grad_bias = torch.zeros(bias.shape, dtype=lse.dtype, device=bias.device) if bias is not None else None
        scale = torch.where(kept, grad.to(lse.dtype), 0)
        for rows in _tiles(hidden.shape[0], ctx.tile_tokens):
            grad_logits = _tile_logits(hidden[rows], weight, bias).sub_(lse[rows, None]).exp_()  # softmax, in place
            grad_logits[torch.arange(grad_logits.shape[0], device=grad_logits.device), targets[rows]] -= 1
            grad_logits *= scale[rows, None]
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight.dtype == hidden.dtype:
                grad_weight.addmm_(grad_logits.t(), hidden[rows])  # no weight-sized temporary per tile
            else:
                grad_weight += (grad_logits.t() @ hidden[rows]).to(grad_weight.dtype)
        grad_weight = grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _loss_dtype(hidden: torch.Tensor) -> torch.dtype:
    return torch.float32 if hidden.element_size() < 4 else hidden.dtype


def _tiles(tokens: int, tile_tokens: int):
    for start in range(0, tokens, tile_tokens):
        yield slice(start, min(start + tile_tokens, tokens))


def _tile_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(hidden, weight, bias).to(_loss_dtype(hidden))


def tiled_lm_loss(
    hidden: torch.Tensor,
    lm_head: nn.Module | torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    tile_tokens: int = DEFAULT_TILE_TOKENS,
    ignore_index: int = -100,
    reduction: str = "mean",
    shift: bool = False,
    sequence_parallel: nn.Module | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``lm_head(hidden)`` against ``labels`` without the whole logits ([Note: tiled LM loss]):
    equal to ``F.cross_entropy(lm_head(hidden).float().flatten(0, -2), labels.flatten(), ignore_index=...,
    reduction=...)`` with at most ``tile_tokens`` tokens' logits alive at once.

    ``hidden`` ``[..., T, H]`` (the backbone's last hidden state, e.g. ``model.model(ids).last_hidden_state``);
    ``lm_head`` an ``nn.Linear`` (its ``weight`` and ``bias`` are read) or a weight ``[vocab, H]`` (then ``bias``
    may be given); ``labels`` ``[..., T]`` aligned with ``hidden`` (label n is the target of token n), unless
    ``shift=True``: then token n predicts ``labels[..., n + 1]``, the last token nothing, as transformers' causal-LM
    loss shifts them.  ``reduction``: ``"mean"`` over the labels that are not ``ignore_index`` (NaN when there are
    none, as ``F.cross_entropy``) or ``"sum"``.  ``sequence_parallel``: the model given to ``zp.setup`` with
    ``ZeroConfig(sequence_parallel_size=K)``; the labels are then this rank's ``shift_labels`` and the result is
    ``zp.sequence_parallel_loss``'s, the whole sequences' mean with its backward ([Note: sequence-parallel loss]
    in ``loss.py``; ``reduction`` must be ``"mean"``, ``shift`` False)."""
    weight, bias = _head_parameters(lm_head, bias)
    _check(hidden, weight, labels, tile_tokens, reduction, shift, sequence_parallel)
    if shift:
        labels = F.pad(labels[..., 1:], (0, 1), value=ignore_index)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1).to(hidden.device)
    total = _TiledLinearCrossEntropy.apply(flat_hidden, weight, bias, flat_labels, tile_tokens, ignore_index)
    count = (flat_labels != ignore_index).sum()
    if sequence_parallel is not None:
        return _GroupMean.apply(total, count, sequence_parallel_of(sequence_parallel).comm)
    if reduction == "sum":
        return total
    return total / count


def _head_parameters(lm_head: nn.Module | torch.Tensor, bias: torch.Tensor | None):
    if isinstance(lm_head, torch.Tensor):
        return lm_head, bias
    if bias is not None:
        raise ValueError("tiled_lm_loss: bias= is for a weight given as a tensor; an nn.Linear's own bias is read")
    return lm_head.weight, getattr(lm_head, "bias", None)


def _check(hidden, weight, labels, tile_tokens, reduction, shift, sequence_parallel) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"tiled_lm_loss: reduction must be 'mean' or 'sum', got {reduction!r}")
    if tile_tokens < 1:
        raise ValueError(f"tiled_lm_loss: tile_tokens must be >= 1, got {tile_tokens}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"tiled_lm_loss: the head's weight {tuple(weight.shape)} must be [vocab, {hidden.shape[-1]}] for hidden "
            f"{tuple(hidden.shape)} (at stage 3, read it inside the model's forward or after its backbone's: "
            "[Note: direct reads of the output embedding] in zero_plugin/stage3/direct_reads.py)"
        )
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"tiled_lm_loss: hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} must cover the same "
            "tokens ([..., T, H] and [..., T])"
        )
    if sequence_parallel is not None and (reduction != "mean" or shift):
        raise ValueError(
            "tiled_lm_loss: with sequence_parallel= the labels are the batch split's shift_labels (shift=False) "
            "and the loss is the whole sequences' mean (reduction='mean')"
        )
