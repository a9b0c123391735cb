"""After the optimizer step of stages 1-2: all-gather every rank's updated region.

Pipeline per bucket: ``copy_in (own region) -> all_gather (async) -> wait -> copy_out``.
At most two buckets are in flight, so copies overlap communication while buffers stay bounded.
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
from ..tensors.flat import copy_from_rows

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
        return comm_layout.gather_buffered(
            self.comm, bucket.slots, p0.dtype, p0.device, comm_layout.each(_fill_own_chunk)
        )

    def _complete(self, pending: comm_layout.BufferedGather) -> None:
        rows = pending.wait(_WHAT)
        for slot, columns in pending.columns(rows):
            copy_from_rows(
                slot.param.data.view(-1), columns, slot.layout, skip_rank=self.comm.rank
            )  # our own region is already up to date


def _fill_own_chunk(slot: MasterParam, chunk: torch.Tensor) -> None:
    """Copy-in: this rank's updated region, zero padding after it."""
    n_local = slot.layout.local_numel
    chunk[:n_local].copy_(slot.local.reshape(-1))
    chunk[n_local:].zero_()
