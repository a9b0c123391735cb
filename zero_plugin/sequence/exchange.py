"""The Ulysses all-to-all: one tensor re-split from one dimension to another across a sequence-parallel group.

[Note: Ulysses exchange]
Each rank of a group of K holds a tensor split along one dimension (its 1/K of the sequence: q, k, v as
``[batch, heads, seq / K, head_dim]``); the exchange leaves it split along another (its 1/K of the heads, the whole
sequence: ``[batch, heads / K, seq, head_dim]``).  Rank r sends its chunk j of the dimension being scattered to
rank j, and concatenates what rank j sent, in rank order, along the dimension being gathered.  Every element moves
to exactly one place, so the map is a permutation of the group's elements: its adjoint, the backward, is its
inverse, the same exchange with the two dimensions swapped (no sum, no scaling).  One ``Comm.all_to_all`` each way,
counted under ``all_to_all`` with the group's label ``"sequence"`` in ``comm_stats``.
"""

from __future__ import annotations

import torch

from ..comm.collectives import Comm

__all__ = ["exchange", "resplit"]


def resplit(x: torch.Tensor, comm: Comm, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """[Note: Ulysses exchange], without autograd: ``x`` split along ``gather_dim`` over the group becomes split
    along ``scatter_dim`` (which must divide by the group's size)."""
    k = comm.world_size
    if k == 1:
        return x
    assert x.shape[scatter_dim] % k == 0, f"resplit: dimension {scatter_dim} of {tuple(x.shape)} by {k}"
    rows = torch.stack(x.chunk(k, dim=scatter_dim))  # row j goes to rank j
    received = torch.empty_like(rows)
    comm.all_to_all(received, rows, tag="sequence")
    return torch.cat(received.unbind(0), dim=gather_dim)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.comm, ctx.scatter_dim, ctx.gather_dim = comm, scatter_dim, gather_dim
        return resplit(x, comm, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # The inverse permutation: [Note: Ulysses exchange].
        return resplit(grad.contiguous(), ctx.comm, ctx.gather_dim, ctx.scatter_dim), None, None, None


def exchange(x: torch.Tensor, comm: Comm, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """``x`` re-split from ``gather_dim`` to ``scatter_dim`` over ``comm``'s ranks, differentiable
    ([Note: Ulysses exchange]); collective over the group, in forward and in backward."""
    return _Exchange.apply(x, comm, scatter_dim, gather_dim)
