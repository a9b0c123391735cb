"""Stage 0: gradients kept as views of persistent bucket buffers, as DDP's ``gradient_as_bucket_view``.

[Note: gradients as bucket views]
Stage 0 used to copy each bucket's gradients into a fresh flat buffer, all-reduce it, then copy the
average back into ``param.grad``: two passes over Ψ, plus the page faults of a new Ψ-sized buffer every
backward.  Now each bucket owns one buffer for the whole run (``width`` elements, every parameter whole
at its offset, then one has-gradient flag per parameter, the layout of ``FlatAllReduce`` in
``comm/layout.py``), and after a reduction ``param.grad`` *is* the parameter's view of it.  Copy-in
(from the gradient hook, while the gradient is warm in cache, or at the launch) happens only for a
gradient that is not that view already (a fresh one after ``zero_grad(set_to_none=True)``,
which autograd allocated; the fresh tensor is then let go); a gradient accumulated into the view
(``zero_grad(set_to_none=False)``, accumulation, a second backward) is reduced where it is, and the
average is written in place, with no copy-out.  Values are those of the copying path bit for bit: the
same buffer is summed by the same collective and divided by the same N.
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

__all__ = ["BucketViews"]


class BucketViews:
    """The persistent buffer of each bucket that can hold its gradients as views."""

    def __init__(self, reduce_dtype: torch.dtype | None) -> None:
        self.reduce_dtype = reduce_dtype
        self._buffers: dict[int, torch.Tensor] = {}  # id(bucket) -> width + len(slots) elements
        self._offsets: dict[int, list[int]] = {}  # id(bucket) -> each slot's offset in it

    def applies(self, bucket: Bucket) -> bool:
        p0 = bucket.slots[0].param
        dtype = self.reduce_dtype or p0.dtype
        return all(s.param.dtype == dtype and s.param.device == p0.device for s in bucket.slots)

    def buffer(self, bucket: Bucket) -> torch.Tensor:
        buf = self._buffers.get(id(bucket))
        if buf is None:
            p0 = bucket.slots[0].param
            buf = torch.empty(bucket.width + len(bucket.slots), dtype=p0.dtype, device=p0.device)
            self._buffers[id(bucket)] = buf
        return buf

    def offsets(self, bucket: Bucket) -> list[int]:
        offsets = self._offsets.get(id(bucket))
        if offsets is None:
            offsets = self._offsets[id(bucket)] = packed_offsets(s.layout.numel for s in bucket.slots)[0]
        return offsets

    @torch.no_grad()
    def adopt(self, bucket: Bucket, index: int) -> None:
        """From the gradient hook: ``param.grad`` becomes its view, copied in while it is still warm in
        cache (as DDP does); a later gradient of the same backward accumulates into the view."""
        slot = bucket.slots[index]
        grad = slot.param.grad
        if grad is not None:
            view = _view(self.buffer(bucket), slot, self.offsets(bucket)[index])
            if not _is(grad, view):
                view.copy_(grad)
                slot.param.grad = view

    @torch.no_grad()
    def fill(self, bucket: Bucket) -> torch.Tensor:
        """Copy-in where still needed: every gradient into its view (``param.grad`` becomes the view),
        zeros where this rank has none, then the flags; the filled buffer."""
        buf = self.buffer(bucket)
        for i, (slot, off) in enumerate(zip(bucket.slots, self.offsets(bucket))):
            view = _view(buf, slot, off)
            grad = slot.param.grad
            buf[bucket.width + i] = float(grad is not None)  # a scalar fill: no pageable copy on CUDA
            if grad is None:
                view.zero_()
            elif not _is(grad, view):
                view.copy_(grad)
                slot.param.grad = view
        return buf

    def tensors(self) -> list[torch.Tensor]:
        return list(self._buffers.values())


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
