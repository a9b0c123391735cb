"""After the optimizer step of stages 1-2: all-gather every rank's updated region.

Pipeline per bucket: ``copy_in (own region) -> all_gather (async) -> wait -> copy_out``.
All buckets are launched before the first wait so copies overlap communication.
"""
from __future__ import annotations

import torch

from .._flat import copy_from_rows
from ..collectives import Comm
from ..grads.bucket import plan_buckets
from .master import MasterParam

__all__ = ["ParamAllGather"]


class ParamAllGather:
    def __init__(self, slots: list[MasterParam], comm: Comm, bucket_bytes: int) -> None:
        self.comm = comm
        self.buckets = plan_buckets(slots, bucket_bytes, sharded=True)

    @torch.no_grad()
    def run(self) -> None:
        if self.comm.world_size == 1:
            return   # the masters are the parameters' own (only) region
        n = self.comm.world_size
        inflight = []
        for bucket in self.buckets:
            p0 = bucket.slots[0].param
            inp = torch.zeros(bucket.width, dtype=p0.dtype, device=p0.device)
            for slot, off in zip(bucket.slots, bucket.offsets):
                inp[off: off + slot.layout.local_numel].copy_(slot.local.reshape(-1))
            out = torch.empty(n * bucket.width, dtype=inp.dtype, device=inp.device)
            inflight.append((bucket, out, self.comm.all_gather(out, inp, async_op=True)))
        for bucket, out, work in inflight:
            self.comm.wait(work, "parameter all-gather after the step")
            rows = out.view(n, bucket.width)
            for slot, off in zip(bucket.slots, bucket.offsets):
                copy_from_rows(slot.param.data.view(-1), rows[:, off: off + slot.layout.shard_numel], slot.layout)
