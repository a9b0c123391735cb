"""Workers for test_p2p_collectives.py: ``Comm.gather_regions`` and ``Comm.reduce_in_place`` on gloo,
sent point to point ([Note: point-to-point exchange] in zero_plugin/comm/collectives.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero_plugin.comm.collectives import Comm
from zero_plugin.comm.layout import rank_regions
from zero_plugin.tensors.flat import ShardLayout

# Odd sizes: padded shards, a region that is empty on the last ranks (5 elements at 4 ranks), one element.
SIZES = (105, 7 * 15, 5, 1, 64)


def _tensor(numel: int, rank: int, index: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * index + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def gather_worker(dtype_name: str, rounds: int) -> bool:
    """Every rank fills only its own regions; after the gather every region holds its owner's values.
    ``rounds`` gathers are in flight at once (a unit and its prefetches) before any is waited for."""
    comm = Comm()
    rank, n = comm.rank, comm.world_size
    dtype = getattr(torch, dtype_name)
    layouts = [ShardLayout(numel, n, rank) for numel in SIZES]
    pending, outputs = [], []
    for k in range(rounds):
        expected = [_tensor(numel, 0, 10 * k + i, dtype) for i, numel in enumerate(SIZES)]
        flats = [torch.full_like(e, float("nan")) for e in expected]
        for flat, full, layout in zip(flats, expected, layouts):
            layout.local_view(flat).copy_(layout.local_view(full))
        pending.append(comm.gather_regions(rank_regions(flats, layouts, n), async_op=True))
        outputs.append((flats, expected))
    for work in pending:
        work.wait()
    for flats, expected in outputs:
        for flat, full in zip(flats, expected):
            assert torch.equal(flat, full), (rank, flat, full)
    return True


def reduce_worker(dtype_name: str) -> dict:
    """Each rank's own regions end as the sum over ranks of everyone's tensors (exact in float64 at these
    magnitudes up to rounding, compared with a float64 sum in rank order); other regions are untouched."""
    comm = Comm()
    rank, n = comm.rank, comm.world_size
    dtype = getattr(torch, dtype_name)
    layouts = [ShardLayout(numel, n, rank) for numel in SIZES]
    grads = [_tensor(numel, rank, i, dtype) for i, numel in enumerate(SIZES)]
    before = [g.clone() for g in grads]
    flags = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float32) * (rank + 1)
    comm.reduce_in_place(rank_regions(grads, layouts, n), flags, async_op=True).wait()
    worst = 0.0
    for i, (grad, old, layout) in enumerate(zip(grads, before, layouts)):
        total = sum(_tensor(SIZES[i], r, i, torch.float64) for r in range(n))
        region = layout.local_view(grad).double()
        worst = max(worst, (region - layout.local_view(total)).abs().max().item() if region.numel() else 0.0)
        outside = torch.ones(grad.numel(), dtype=torch.bool)
        layout.local_view(outside).fill_(False)
        assert torch.equal(grad[outside], old[outside]), "a region another rank owns was changed"
    expected_flags = torch.tensor([1.0, 0.0, 1.0]) * sum(range(1, n + 1))
    assert torch.equal(flags, expected_flags), flags
    return {"worst": worst, "rank": rank}


def matches_all_reduce_worker() -> bool:
    """At two ranks the point-to-point sum is gloo's all-reduce bit for bit (addition commutes)."""
    comm = Comm()
    rank, n = comm.rank, comm.world_size
    layouts = [ShardLayout(numel, n, rank) for numel in SIZES]
    grads = [_tensor(numel, rank, i, torch.float32) for i, numel in enumerate(SIZES)]
    reference = [g.clone() for g in grads]
    for t in reference:
        dist.all_reduce(t)
    comm.reduce_in_place(rank_regions(grads, layouts, n), None)
    for grad, ref, layout in zip(grads, reference, layouts):
        assert torch.equal(layout.local_view(grad), layout.local_view(ref))
    return True
