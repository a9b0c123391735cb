"""Static gradient buckets: which parameters are reduced together, and how.

Buckets are fixed at setup (parameters in reverse registration order, the order
backward usually produces their gradients, cut at ``bucket_size_mb``), so every
rank issues the same collectives in the same order whatever the order in which
its hooks fire.  A bucket is launched as soon as all its parameters are ready;
the rest are flushed at the end of backward.

Two layouts (see :mod:`zero_plugin._flat` for the per-parameter chunking):
  * all-reduce (stage 0): a flat buffer, parameter i at ``offsets[i]``;
  * reduce-scatter (stages 1-2): a ``(world_size, S)`` buffer whose row r holds
    rank r's chunk of every parameter, so that rank r receives exactly its
    chunks as one contiguous ``S``-long output.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..optim.master import MasterParam

__all__ = ["Bucket", "plan_buckets"]


@dataclass(eq=False)
class Bucket:
    slots: list[MasterParam]
    offsets: list[int]                 # column (reduce-scatter) or flat (all-reduce) offsets
    width: int                         # S (reduce-scatter) or total numel (all-reduce)
    ready: set[int] = field(default_factory=set)   # indices of slots whose grad is final this backward
    launched: bool = False
    work: Any = None
    buffer: torch.Tensor | None = None            # input of the collective (kept alive until wait)
    output: torch.Tensor | None = None            # reduce-scatter output

    def reset(self) -> None:
        self.ready.clear()
        self.launched = False
        self.work = self.buffer = self.output = None


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
    offsets, width = [], 0
    for slot in slots:
        offsets.append(width)
        width += slot.layout.shard_numel if sharded else slot.layout.numel
    return Bucket(slots=list(slots), offsets=offsets, width=width)
