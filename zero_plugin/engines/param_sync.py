"""After the optimizer step of stages 1-2: all-gather every rank's updated region.

Pipeline per bucket: ``copy_in (own region) -> all_gather (async) -> wait -> copy_out``.
At most two buckets are in flight, so copies overlap communication while buffers stay bounded.
The copies are batched per bucket, as stage 3's are (a step is host-bound on a GPU, issue #39): the
copy-in is one ``_foreach_copy_`` of the owned regions (and one ``_foreach_zero_`` of the padding where a
region is shorter than its chunk), the copy-out one ``_foreach_copy_`` of the other ranks' valid spans.
On gloo every rank's region is instead broadcast straight into the parameters (no buffer, no copy):
[Note: collective layouts] in ``comm/layout.py``; there the step itself can run bucket by bucket with each
bucket's gather in flight behind it ([Note: pipelined step] in ``pipelined_step.py``).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..comm import layout as comm_layout
from ..comm.collectives import Comm
from ..grads.bucket import Bucket, plan_buckets
from ..optim.master import MasterParam
from ..tensors.flat import ShardLayout, copy_into_chunks

__all__ = ["ParamAllGather"]

_MAX_INFLIGHT = 2
_WHAT = "parameter all-gather after the step"


class ParamAllGather:
    def __init__(self, slots: list[MasterParam], comm: Comm, bucket_bytes: int) -> None:
        self.comm = comm
        self.slots = slots
        self.buckets = plan_buckets(slots, bucket_bytes, sharded=True)

    @torch.no_grad()
    def run(self) -> None:
        if self.comm.world_size == 1:
            return  # the masters are the parameters' own (only) region
        if self.comm.gathers_regions_in_place:
            self._launch_in_place(self.slots).wait(_WHAT)
            return
        inflight: list[comm_layout.BufferedGather] = []
        for bucket in self.buckets:
            inflight.append(self._launch(bucket))
            if len(inflight) > _MAX_INFLIGHT:  # bounded: at most this many output buffers alive
                self._complete(inflight.pop(0))
        for pending in inflight:
            self._complete(pending)

    @property
    def pipelines(self) -> bool:
        """Whether :meth:`run_stepping` applies: several ranks, gloo's in-place layout."""
        return self.comm.world_size > 1 and self.comm.gathers_regions_in_place

    @torch.no_grad()
    def run_stepping(self, step: Callable[[list[MasterParam]], None]) -> None:
        """``step(slots)`` for each bucket, its regions' gather in flight while the next bucket steps; returns
        once every gather completed ([Note: pipelined step] in pipelined_step.py).  In place only."""
        assert self.pipelines
        pending = []
        for bucket in self.buckets:
            step(bucket.slots)
            pending.append(self._launch_in_place(bucket.slots))
        for gather in pending:
            gather.wait(_WHAT)

    def _launch_in_place(self, slots: list[MasterParam]) -> comm_layout.InPlaceGather:
        """Every rank's regions of ``slots`` broadcast straight into the parameters (gloo's layout)."""
        flats = [slot.param.data.view(-1) for slot in slots]
        return comm_layout.gather_in_place(self.comm, slots, flats, tag="parameters after the step")

    def _launch(self, bucket: Bucket) -> comm_layout.BufferedGather:
        p0 = bucket.slots[0].param
        return comm_layout.gather_buffered(self.comm, bucket.slots, p0.dtype, p0.device, _fill_own_chunks)

    def _complete(self, pending: comm_layout.BufferedGather) -> None:
        rows = pending.wait(_WHAT)
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for slot, columns in pending.columns(rows):  # our own region is already up to date
            _other_spans(slot.param.data.view(-1), columns, slot.layout, self.comm.rank, dsts, srcs)
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
