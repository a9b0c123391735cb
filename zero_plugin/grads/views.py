"""Stages 0 and 1: gradients kept as views of persistent bucket buffers, as DDP's ``gradient_as_bucket_view``.

[Note: gradients as bucket views]
Stage 0 used to copy each bucket's gradients into a fresh flat buffer, all-reduce it, then copy the
average back into ``param.grad``: two passes over Ψ, plus the page faults of a new Ψ-sized buffer every
backward.  Now each bucket owns one buffer for the whole run (every parameter whole at its offset, then one
has-gradient flag per parameter, the layout of ``FlatAllReduce`` in ``comm/layout.py``), and after a
reduction ``param.grad`` *is* the parameter's view of it.  Copy-in (from the gradient hook, while the
gradient is warm in cache, or at the launch) happens only for a gradient that is not that view already (a
fresh one after ``zero_grad(set_to_none=True)``, which autograd allocated; the fresh tensor is then let
go); a gradient accumulated into the view (``zero_grad(set_to_none=False)``, accumulation, a second
backward) is reduced where it is, and the average is written in place, with no copy-out.  Values are those
of the copying path bit for bit: the same buffer is summed by the same collective and divided by the same N.

Stage 1 (issue #49) keeps its full gradients in the same buffers (parameters whole, not the shard columns
its buckets are planned in), copied in from the gradient hook alike, instead of a fresh Ψ every backward
that lived until ``zero_grad`` (on the host, a Ψ of pages faulted in again every step).  In place (gloo) each
rank's region of the views is summed where it is and the average stays there: nothing is copied in or out.
Buffered (NCCL) stage 1 keeps no views: its reduce-scatter needs each rank's chunks side by side in
rank-major rows, which no view of whole parameters is, so the rows are a copy either way and a view would
add one more per parameter, for nothing a caching device allocator would not already give.  Stage 1's views
keep [Note: reduced regions and later backwards] in ``reducer.py``: a fresh gradient is copied into a view
only while the view holds no average of this step (``owned``), and is then fresh whatever the view held
before; a second synced backward before the step keeps its fresh gradient where autograd put it (allocated,
as before), reduces it there and adds the view's average.  A rank without a gradient that another rank had
gets zeros in its view.  Stage 2 keeps no full gradient, so it has no views.

Consequences, the same as DDP's: the buffers hold Ψ elements between steps even when ``param.grad`` was
set to None (counted in ``memory_report``'s gradients through ``grad_tensors``), and a reference to a
``param.grad`` kept across steps sees the next step's gradient.  Only buckets whose parameters share the
reduction dtype and device use it; mixed precision (a ``reduce_dtype`` other than the parameters') keeps
the copying path, since a view cannot change dtype.
"""

from __future__ import annotations

import torch

from ..comm.layout import packed_offsets
from ..optim.master import MasterParam
from .bucket import Bucket

__all__ = ["BucketViews", "reduce_scatter_keeps_views"]


class BucketViews:
    """The persistent buffer of each bucket that can hold its gradients as views."""

    def __init__(self, reduce_dtype: torch.dtype | None) -> None:
        self.reduce_dtype = reduce_dtype
        self._buffers: dict[int, torch.Tensor] = {}  # id(bucket) -> width + len(slots) elements
        self._packed: dict[int, tuple[list[int], int]] = {}  # id(bucket) -> each slot's offset, total width

    def applies(self, bucket: Bucket) -> bool:
        p0 = bucket.slots[0].param
        dtype = self.reduce_dtype or p0.dtype
        return all(s.param.dtype == dtype and s.param.device == p0.device for s in bucket.slots)

    def buffer(self, bucket: Bucket) -> torch.Tensor:
        buf = self._buffers.get(id(bucket))
        if buf is None:
            p0 = bucket.slots[0].param
            buf = torch.empty(self.width(bucket) + len(bucket.slots), dtype=p0.dtype, device=p0.device)
            self._buffers[id(bucket)] = buf
        return buf

    def offsets(self, bucket: Bucket) -> list[int]:
        return self._pack(bucket)[0]

    def width(self, bucket: Bucket) -> int:
        """Every parameter whole, side by side (stage 0's ``bucket.width``; stage 1's bucket is planned in
        shard columns, so its ``width`` is not this)."""
        return self._pack(bucket)[1]

    def _pack(self, bucket: Bucket) -> tuple[list[int], int]:
        packed = self._packed.get(id(bucket))
        if packed is None:
            packed = self._packed[id(bucket)] = packed_offsets(s.layout.numel for s in bucket.slots)
        return packed

    def view(self, bucket: Bucket, index: int) -> torch.Tensor:
        """Slot ``index``'s view of the bucket's buffer, shaped as its parameter."""
        return _view(self.buffer(bucket), bucket.slots[index], self.offsets(bucket)[index])

    @torch.no_grad()
    def adopt(self, bucket: Bucket, index: int) -> None:
        """From the gradient hook: ``param.grad`` becomes its view, copied in while it is still warm in
        cache (as DDP does); a later gradient of the same backward accumulates into the view."""
        slot = bucket.slots[index]
        grad = slot.param.grad
        if grad is not None:
            view = self.view(bucket, index)
            if not _is(grad, view):
                view.copy_(grad)
                slot.param.grad = view

    @torch.no_grad()
    def fill(self, bucket: Bucket) -> torch.Tensor:
        """Stage 0's copy-in where still needed: every gradient into its view (``param.grad`` becomes the
        view), zeros where this rank has none, then the flags; the filled buffer."""
        buf, width = self.buffer(bucket), self.width(bucket)
        for i, (slot, off) in enumerate(zip(bucket.slots, self.offsets(bucket))):
            view = _view(buf, slot, off)
            grad = slot.param.grad
            buf[width + i] = float(grad is not None)  # a scalar fill: no pageable copy on CUDA
            if grad is None:
                view.zero_()
            elif not _is(grad, view):
                view.copy_(grad)
                slot.param.grad = view
        return buf

    def tensors(self) -> list[torch.Tensor]:
        return list(self._buffers.values())


def reduce_scatter_keeps_views(keep_full_grad: bool, in_place: bool) -> bool:
    """Whether a reduce-scatter reducer keeps its full gradients as bucket views (a bucket whose parameters share
    the reduce dtype and device, ``BucketViews.applies``): stage 1 in the in-place layout.  A buffered reduction
    copies the gradients into its rows anyway, so a view would add a copy; stage 2 lets its full gradients go.
    ``ReduceScatterReducer`` and the planner's replay both ask this."""
    return keep_full_grad and in_place


def _view(buf: torch.Tensor, slot: MasterParam, off: int) -> torch.Tensor:
    return buf[off : off + slot.layout.numel].view(slot.param.shape)


def _is(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def store_view(slot: MasterParam, reduced: torch.Tensor) -> torch.Tensor:
    """The average (a 1-D range of the bucket buffer) becomes ``param.grad``; returns it."""
    p = slot.param
    view = reduced.view(p.shape)
    if p.grad is None or not _is(p.grad, view):
        p.grad = view
    return p.grad
