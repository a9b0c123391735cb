"""Static gradient buckets: which parameters are reduced together, and how.

Buckets are fixed at setup (parameters in reverse registration order, the order
backward usually produces their gradients, cut at ``bucket_size_mb``), so every
rank issues the same collectives in the same order whatever the order in which
its hooks fire.  A bucket is issued once all its parameters are ready and every
bucket before it was issued ([Note: rank-agreed reduction order] in
``schedule.py``); the rest are flushed at the end of backward.

A bucket's collective uses one of the layouts of [Note: collective layouts] in
``zero_plugin/comm/layout.py``: stage 0 a flat buffer of ``width`` elements (every
parameter whole); stages 1-2 in place (gloo) or as rank-major rows of ``width``
padded columns (NCCL).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..comm.layout import packed_offsets
from ..optim.master import MasterParam

__all__ = ["Bucket", "plan_buckets"]


@dataclass(eq=False)
class Bucket:
    slots: list[MasterParam]
    width: int  # padded columns (reduce-scatter) or total numel (all-reduce)
    ready: set[int] = field(default_factory=set)  # indices of slots whose grad is final this backward
    launched: bool = False  # issued in this backward (its record is the schedule's)

    def reset(self) -> None:
        self.ready.clear()
        self.launched = False


def plan_buckets(slots: list[MasterParam], bucket_bytes: int, sharded: bool) -> list[Bucket]:
    """Group slots (given in registration order) into buckets of about ``bucket_bytes``."""
    buckets: list[Bucket] = []
    current: list[MasterParam] = []
    size = 0

    def close() -> None:
        nonlocal current, size
        if current:
            buckets.append(_make_bucket(current, sharded))
        current, size = [], 0

    for slot in reversed(slots):
        nbytes = slot.param.numel() * slot.param.element_size()
        if current and size + nbytes > bucket_bytes:
            close()
        current.append(slot)
        size += nbytes
    close()
    return buckets


def _make_bucket(slots: list[MasterParam], sharded: bool) -> Bucket:
    _, width = packed_offsets(s.layout.shard_numel if sharded else s.layout.numel for s in slots)
    return Bucket(slots=list(slots), width=width)
