"""hpZ (ZeRO++, arXiv 2306.10209, section 3.2): a secondary shard of each unit inside the node.

[Note: secondary shards]
``ZeroConfig.secondary_shard_size=k``: when a unit is released after a forward that a backward will follow,
each rank first keeps its 1/k of every parameter of the unit, the region of a k-way ``ShardLayout`` over
the k consecutive ranks of its node (``Comm.node_group``), copied from the gathered (in qwZ: dequantized)
full tensors.  Until the end of that backward every gather of the unit (backward's, and a recompute's under
activation checkpointing) all-gathers those regions inside the node instead of the primary shards across
the world, so backward moves no inter-node bytes and computes on exactly the values forward used: hpZ is
lossless (``tests/parity/test_zeropp.py`` holds it bit-identical to plain stage 3).  The final callback
drops the regions (``Unit.end_backward``).  Cost: Ψ/k elements in the compute dtype per rank, for every
unit released between its forward and its backward (``memory_report``'s ``secondary`` entry).  The
regions are a copy of the weights of one forward, valid only until the shards are written: when that
forward gets no backward, the next forward, the step and every write to the shards (a load, a gathered edit)
drop them first (``Unit.forget_forward``, [Note: pending forward] in ``hooks.py``), so no later gather
reads old weights from them, and a backward still to come gathers the written shards, as plain stage 3.
"""

from __future__ import annotations

import torch

from ..comm import layout as comm_layout
from ..comm.collectives import Comm
from ..tensors.flat import ShardLayout
from .param import ShardedParam

__all__ = ["SecondaryShard"]


class SecondaryMember:
    """One parameter in a secondary gather: its k-way layout, its kept region, and the copy-out."""

    __slots__ = ("sp", "layout", "region")

    def __init__(self, sp: ShardedParam, layout: ShardLayout) -> None:
        self.sp, self.layout = sp, layout
        self.region: torch.Tensor | None = None

    @property
    def param(self) -> torch.nn.Parameter:
        return self.sp.param

    def fill(self, chunk: torch.Tensor) -> None:
        n = self.region.numel()
        chunk[:n].copy_(self.region)
        chunk[n:].zero_()

    def to_unsharded(self, rows: torch.Tensor) -> None:
        self.sp.to_unsharded(rows, self.layout)


class SecondaryShard:
    """A unit's secondary shard over ``comm`` (the k ranks of this rank's node): [Note: secondary shards]."""

    def __init__(self, comm: Comm, params: list[ShardedParam]) -> None:
        self.comm = comm
        self.members = [
            SecondaryMember(sp, ShardLayout(sp.layout.numel, comm.world_size, comm.rank))
            for sp in params
            if sp.layout.numel
        ]
        self.kept = False

    @torch.no_grad()
    def keep(self) -> None:
        """Copy this rank's k-way regions out of the unit's gathered tensors (before they are released)."""
        for m in self.members:
            m.region = m.layout.local_view(m.sp.unsharded.view(-1)).clone()
        self.kept = True

    def drop(self) -> None:
        for m in self.members:
            m.region = None
        self.kept = False

    def nbytes(self) -> int:
        return sum(m.region.numel() * m.region.element_size() for m in self.members if m.region is not None)

    def gather(self, trailer: tuple, tag: str) -> list[comm_layout.BufferedGather]:
        """One buffered all-gather per dtype inside the node; the records' members are ``SecondaryMember``s."""
        by_dtype: dict[torch.dtype, list[SecondaryMember]] = {}
        for m in self.members:
            by_dtype.setdefault(m.sp.unsharded.dtype, []).append(m)
        return [
            comm_layout.gather_buffered(
                self.comm,
                group,
                dtype,
                group[0].sp.unsharded.device,
                comm_layout.each(SecondaryMember.fill),
                trailer=trailer,
                tag=tag,
            )
            for dtype, group in by_dtype.items()
        ]
