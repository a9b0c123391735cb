"""After the optimizer step of stages 1-2: all-gather every rank's updated region.

Pipeline per bucket: ``copy_in (own region) -> all_gather (async) -> wait -> copy_out``.
At most two buckets are in flight, so copies overlap communication while buffers stay bounded.
On gloo every rank's region is instead broadcast straight into the parameters (no buffer, no copy;
[Note: in-place region gather] in ``collectives.py``).
"""
from __future__ import annotations

import torch

from .._flat import copy_from_rows
from ..collectives import Comm
from ..grads.bucket import plan_buckets
from .master import MasterParam

__all__ = ["ParamAllGather"]

_MAX_INFLIGHT = 2


class ParamAllGather:
    def __init__(self, slots: list[MasterParam], comm: Comm, bucket_bytes: int) -> None:
        self.comm = comm
        self.slots = slots
        self.buckets = plan_buckets(slots, bucket_bytes, sharded=True)

    @torch.no_grad()
    def run(self) -> None:
        if self.comm.world_size == 1:
            return   # the masters are the parameters' own (only) region
        if self.comm.gathers_regions_in_place:
            self._run_in_place()
            return
        inflight: list = []
        for bucket in self.buckets:
            inflight.append(self._launch(bucket))
            if len(inflight) > _MAX_INFLIGHT:   # bounded: at most this many output buffers alive
                self._complete(*inflight.pop(0))
        for item in inflight:
            self._complete(*item)

    def _run_in_place(self) -> None:
        regions: list[list[torch.Tensor]] = [[] for _ in range(self.comm.world_size)]
        for slot in self.slots:
            flat = slot.param.data.view(-1)
            for r, views in enumerate(regions):
                lo, hi = slot.layout.bounds(r)
                views.append(flat[lo:hi])
        self.comm.wait(self.comm.gather_regions(regions, async_op=True, tag="parameters after the step"),
                       "parameter all-gather after the step")

    def _launch(self, bucket):
        p0 = bucket.slots[0].param
        inp = torch.empty(bucket.width, dtype=p0.dtype, device=p0.device)
        for slot, off in zip(bucket.slots, bucket.offsets):
            n_local = slot.layout.local_numel
            inp[off: off + n_local].copy_(slot.local.reshape(-1))
            inp[off + n_local: off + slot.layout.shard_numel].zero_()   # padding only
        out = torch.empty(self.comm.world_size * bucket.width, dtype=inp.dtype, device=inp.device)
        return bucket, out, self.comm.all_gather(out, inp, async_op=True)

    def _complete(self, bucket, out, work) -> None:
        self.comm.wait(work, "parameter all-gather after the step")
        rows = out.view(self.comm.world_size, bucket.width)
        for slot, off in zip(bucket.slots, bucket.offsets):
            copy_from_rows(slot.param.data.view(-1), rows[:, off: off + slot.layout.shard_numel], slot.layout,
                           skip_rank=self.comm.rank)   # our own region is already up to date
