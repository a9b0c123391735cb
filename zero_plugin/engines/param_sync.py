"""After the optimizer step of stages 1-2: all-gather every rank's updated region.

The batching is the layout's (``Layout.gather_all``, [Note: collective layouts] in ``comm/layout.py``):
buffered (NCCL), bucket by bucket ``copy_in (own region) -> all_gather (async) -> wait -> copy_out`` with at
most ``MAX_INFLIGHT`` launched buckets waiting, so copies overlap communication while buffers stay bounded;
in place (gloo), every rank's region broadcast straight into the parameters in one collective (no buffer,
no copy), or bucket by bucket behind the optimizer where the layout says so (``gathers_while_stepping``,
[Note: pipelined step] in ``pipelined_step.py``).  This module provides both ends of the gather
(``_SyncEnds``).  The buffered copies are batched per bucket, as stage 3's are (a step is host-bound on a
GPU, issue #39): the copy-in is one ``_foreach_copy_`` of the owned regions (and one ``_foreach_zero_`` of the
padding where a region is shorter than its chunk), the copy-out one ``_foreach_copy_`` of the other ranks'
valid spans.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..comm import layout as comm_layout
from ..comm.collectives import Comm
from ..grads.bucket import plan_buckets
from ..optim.master import MasterParam
from ..tensors.flat import ShardLayout, copy_into_chunks
from ..tensors.phases import phase

__all__ = ["ParamAllGather"]

MAX_INFLIGHT = 2  # buffered: launched buckets waiting when the next is launched (planner/replay.py reads it)
_WHAT = "parameter all-gather after the step"
_TAG = "parameters after the step"


class ParamAllGather:
    def __init__(self, slots: list[MasterParam], comm: Comm, bucket_bytes: int) -> None:
        self.comm = comm
        self.layout = comm_layout.layout_of(comm)  # [Note: collective layouts] in comm/layout.py
        self.slots = slots
        self.buckets = plan_buckets(slots, bucket_bytes, sharded=True)
        self._ends = _SyncEnds()

    @torch.no_grad()
    def run(self, slots: list[MasterParam] | None = None) -> None:
        """Every rank's updated regions into the parameters; ``slots``: only those (one of several optimizers
        stepped them: [Note: several optimizers] in engine.py), None: all."""
        if self.comm.world_size == 1:
            return  # the masters are the parameters' own (only) region
        buckets = [bucket.slots for bucket in self.buckets]
        members = self.slots
        if slots is not None and len(slots) != len(self.slots):
            wanted = {id(slot) for slot in slots}
            buckets = [kept for kept in ([s for s in b if id(s) in wanted] for b in buckets) if kept]
            members = [s for b in buckets for s in b]
        with phase("param_all_gather"):  # [Note: profiler phases]
            self.layout.gather_all(self.comm, members, buckets, self._ends, _WHAT, MAX_INFLIGHT, tag=_TAG)

    @property
    def pipelines(self) -> bool:
        """Whether :meth:`run_stepping` applies: several ranks, a layout that gathers while the step runs."""
        return self.comm.world_size > 1 and self.layout.gathers_while_stepping

    @torch.no_grad()
    def run_stepping(self, step: Callable[[list[MasterParam]], None]) -> None:
        """``step(slots)`` for each bucket, its regions' gather in flight while the next bucket steps; returns
        once every gather completed ([Note: pipelined step] in pipelined_step.py).  Only where :attr:`pipelines`."""
        assert self.pipelines
        pending = []
        for bucket in self.buckets:
            step(bucket.slots)
            with phase("param_all_gather"):  # [Note: profiler phases]: each bucket's launch, then the waits
                pending += self.layout.gather(self.comm, bucket.slots, self._ends, tag=_TAG)
        with phase("param_all_gather"):
            for gather in pending:
                comm_layout.finish(gather, _WHAT, self._ends)


class _SyncEnds:
    """Both ends of the parameter sync's gathers (a ``comm_layout.GatherEnds``): the parameters are the full
    tensors, with this rank's region written back by the step."""

    def open_full(self, members: list[MasterParam]) -> list[torch.Tensor]:
        return [slot.param.data.view(-1) for slot in members]

    def rows(self, members: list[MasterParam]) -> list[comm_layout.GatherRow]:
        """One all-gather per bucket, in its first parameter's dtype, on its device."""
        p0 = members[0].param
        return [comm_layout.GatherRow(p0.dtype, p0.device, members)]

    def fill(self, members: list[MasterParam], chunks: list[torch.Tensor], extra: list) -> None:
        _fill_own_chunks(members, chunks, extra)

    def expose(self, members: list[MasterParam]) -> None:
        """The regions were gathered into the parameters themselves."""

    def copy_out(self, record: comm_layout.BufferedGather, rows: torch.Tensor) -> None:
        """The other ranks' valid spans into the parameters in one batched copy (our own region is already up
        to date)."""
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for slot, columns in record.columns(rows):
            _other_spans(slot.param.data.view(-1), columns, slot.layout, record.comm.rank, dsts, srcs)
        if dsts:
            torch._foreach_copy_(dsts, srcs)


def _fill_own_chunks(slots: list[MasterParam], chunks: list[torch.Tensor], extra: list) -> None:
    """Copy-in: this rank's updated region of every slot into its chunk, zero padding after it; one batched
    copy (and one batched zero where some region is shorter than its chunk)."""
    assert not extra, "the parameter sync sends no trailer"
    copy_into_chunks((chunk, slot.local.reshape(-1)) for slot, chunk in zip(slots, chunks))


def _other_spans(
    flat: torch.Tensor, columns: torch.Tensor, layout: ShardLayout, skip_rank: int, dsts: list, srcs: list
) -> None:
    """The (destination, source) pairs of ``copy_from_rows(flat, columns, layout, skip_rank)``: every rank's
    valid span of the padded ``(world_size, shard_numel)`` columns but ``skip_rank``'s, into the full flat
    tensor."""
    s = layout.shard_numel
    if s == 0:
        return
    full_rows, rem = divmod(layout.numel, s)
    spans = [(0, full_rows)] if skip_rank >= full_rows else [(0, skip_rank), (skip_rank + 1, full_rows)]
    for a, b in spans:
        if b > a:
            dsts.append(flat[a * s : b * s].view(b - a, s))
            srcs.append(columns[a:b])
    if rem and skip_rank != full_rows:
        dsts.append(flat[full_rows * s :])
        srcs.append(columns[full_rows, :rem])
