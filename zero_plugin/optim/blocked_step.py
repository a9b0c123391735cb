"""The offloaded Adam/AdamW step over host masters, one cache-sized block at a time.

[Note: cache-blocked offload step]
With masters separate from their parameters on the host, an offloaded step is three passes over each
parameter: bring the reduced gradient to the host in the master's dtype, run Adam (reads master,
gradient and both moments, writes three of them back), bring the updated master back into the
parameter in ``param_dtype``.  Done a whole tensor at a time (``MasterParam.set_grad``, ``step()``,
``MasterParam.write_back``), each pass finishes before the next starts.  This step instead walks the
masters in blocks of ``BLOCK`` elements, and each block goes through all three passes:

* CPU-only machine, bf16/fp16 parameters with fp32 masters (the host is the device, nothing is copied,
  but the casts remain): cast the block's gradient into one reused fp32 scratch, run torch's fused
  kernel on views of that block of master and moments, cast the block of the master back into the
  parameter.  The scratch and the just-updated master are still in cache when the next pass reads them,
  so DRAM moves about 30 bytes per parameter instead of about 46 (with write-allocate reads), and no
  fp32 gradient larger than one block is allocated: the whole-tensor path allocated a fresh one, 4 bytes
  per parameter, every step.
* CUDA: ``set_grad(blocked=True)`` issues every gradient's device->host copy and records an event after
  each; the step waits for one master's copy just before its first block (the CPU step of the first
  masters overlaps the copies of the later ones), and writes every block back non-blocking right after
  its kernel (the copy overlaps the next block's step).  Ordering against the next step's host writes is
  as in [Note: asynchronous host copies] in ``offload.py``.

Bitwise the same as the whole-tensor path: the kernel is elementwise, and every piece starts at a
multiple of ``ALIGN`` elements of its own tensor, so the kernel's vectorised body and scalar tail
cover the same elements as in one call over the whole tensor (pieces cut at other offsets round
differently in the last bit).  Several small tensors share a block; one kernel call steps a block.
Measured on the CPU by ``benchmarks/offload_step.py``: ``benchmarks/results/offload_step.md``.

Used when :func:`~zero_plugin.optim.cpu_step.covered` allows a direct fused step (exact Adam/AdamW,
nothing hooked into ``step``) and some master is a separate copy on the host; otherwise the step takes
the whole-tensor path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cpu_step import covered, group_state, run_kernel
from .master import MasterParam
from .offload import to_device

__all__ = ["BlockedStep", "BLOCK", "ALIGN", "SINGLE_BLOCK", "block_elements"]

BLOCK = 1 << 18  # elements per block: 1 MiB of fp32 gradient scratch, ~5 MiB touched per block
# Separate masters of at most this many blocks in all are stepped as one block: all of it stays in cache
# anyway, and each extra block costs a kernel launch over fewer elements (torch's fused kernel splits
# 256K elements over two threads less evenly than 1M; measured in benchmarks/results/design_figures.md).
SINGLE_BLOCK = 4
ALIGN = 64  # pieces start at multiples of this many elements of their tensor (a multiple of any vector width)


def block_elements(separate_numels) -> int:
    """Elements per block (and of the scratch) for separate masters of these sizes: ``BLOCK``, or all of them
    together when they are at most ``SINGLE_BLOCK`` blocks; at least ``ALIGN``, so that an empty block
    always takes a piece of the next tensor, however large."""
    need = sum(_pad16(n) for n in separate_numels)
    return max(ALIGN, need if need <= SINGLE_BLOCK * BLOCK else BLOCK)


def _pad16(n: int) -> int:
    """``n`` rounded up to 16 elements: scratch pieces start 64-byte aligned."""
    return -(-n // 16) * 16


@dataclass(slots=True)
class _Piece:
    """The ``k``-th piece of one entry (``size`` elements), and where its fp32 gradient sits in the scratch."""

    entry: int
    k: int
    size: int
    at: int | None  # scratch offset, None when the gradient is already fp32 and used in place


@dataclass(slots=True)
class _Entry:
    """One parameter's tensors as flat views; ``views`` holds their pieces once the blocks are planned."""

    tensors: list[torch.Tensor]  # master, grad, exp_avg, exp_avg_sq[, max_exp_avg_sq][, local]
    step: torch.Tensor
    cast: bool  # the gradient is bf16/fp16 and goes through the scratch
    store: object  # writes a master piece into its parameter piece (None: identity master)
    ready: object  # event of the gradient's host copy, waited for before the first piece
    sizes: list[int]
    views: list[tuple] | None = None


class BlockedStep:
    """Steps a covered optimizer block by block, casting gradients in and masters out on the way."""

    def __init__(self, slots: list[MasterParam]) -> None:
        self.slot_of = {id(s.master): s for s in slots}
        self.scratch: torch.Tensor | None = None
        self.block: int | None = None  # elements per block, fixed at the first step (see SINGLE_BLOCK)

    @staticmethod
    def wanted(slots: list[MasterParam]) -> bool:
        """True when some master is a separate copy on the host: the fp32 master of a bf16/fp16 parameter on a
        CPU-only machine, or any offloaded master of a CUDA parameter."""
        return any(s.separate and s.master.device.type == "cpu" for s in slots)

    def applies(self, optimizer: torch.optim.Optimizer) -> bool:
        """Checked every step (a hook registered later turns it off); True means :meth:`step` will run."""
        if not covered(optimizer):
            return False
        for group in optimizer.param_groups:  # pieces are flat views: every tensor involved must be contiguous
            for p in group["params"]:
                slot = self.slot_of.get(id(p))
                if not p.is_contiguous() or (slot is not None and slot.separate and not slot.local.is_contiguous()):
                    return False
                if not all(t.is_contiguous() for t in optimizer.state.get(p, {}).values() if torch.is_tensor(t)):
                    return False
        return True

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step every group; separate masters' gradients come from ``slot.deferred_grad`` (left there by
        ``set_grad(blocked=True)``) or the host copy in ``master.grad`` (waited for by its ``grad_ready``
        event), and the updated masters are written back here, block by block."""
        optimizer._opt_called = True  # type: ignore[attr-defined]  # as in fused_cpu_step: no LR-scheduler warning
        for group in optimizer.param_groups:
            entries, written = self._entries(optimizer, group)
            blocks = list(self._blocks(entries, self._block_size()))
            for e in entries:  # every piece's views, made by one split per tensor
                e.views = list(zip(*(t.split(e.sizes) for t in e.tensors)))
            for block in blocks:
                self._step_block(optimizer, group, entries, block)
            for slot in written:
                slot.deferred_grad = slot.grad_ready = None
                slot.written_back = True

    def _entries(self, opt: torch.optim.Optimizer, group: dict) -> tuple[list[_Entry], list[MasterParam]]:
        masters, grads, slots = [], [], []
        for p in group["params"]:
            slot = self.slot_of.get(id(p))
            grad = slot.deferred_grad if slot is not None and slot.deferred_grad is not None else p.grad
            if grad is not None:
                masters.append(p)
                grads.append(grad)
                slots.append(slot if slot is not None and slot.separate else None)
        if not masters:
            return [], []
        states = group_state(opt, group, masters)
        names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        entries = []
        for m, g, st, slot in zip(masters, grads, states, slots):
            tensors = [m.view(-1), g.reshape(-1)] + [st[k].view(-1) for k in names]
            store = ready = None
            if slot is not None:
                tensors.append(slot.local.view(-1))
                store = _copy_into if slot.local.device == m.device else to_device
                ready = slot.grad_ready
            entries.append(_Entry(tensors, st["step"], g.dtype != m.dtype, store, ready, []))
        return entries, [s for s in slots if s is not None]

    @staticmethod
    def _blocks(entries: list[_Entry], limit: int):
        """Lists of pieces of at most ``limit`` elements in all (recording each entry's piece sizes); every
        piece starts at a multiple of ``ALIGN`` elements of its tensor and of 16 elements of the scratch."""
        block: list[_Piece] = []
        used = at = 0  # elements in this block; scratch elements taken by its pieces that cast
        for i, e in enumerate(entries):
            n = e.tensors[0].numel()
            lo = 0
            while lo < n:
                room = limit - used
                take = n - lo if n - lo <= room else room - room % ALIGN
                if take == 0:
                    assert block, "a block of at least ALIGN elements always takes a piece"
                    yield block
                    block, used, at = [], 0, 0
                    continue
                block.append(_Piece(i, len(e.sizes), take, at if e.cast else None))
                e.sizes.append(take)
                used += _pad16(take)
                if e.cast:
                    at += _pad16(take)
                lo += take
                if used >= limit:
                    yield block
                    block, used, at = [], 0, 0
        if block:
            yield block

    def _step_block(self, opt, group, entries: list[_Entry], block: list[_Piece]) -> None:
        amsgrad = group["amsgrad"]
        params, grads, avgs, sqs, maxes, steps = [], [], [], [], [], []
        for pc in block:
            e = entries[pc.entry]
            if pc.k == 0 and e.ready is not None:
                e.ready.synchronize()  # this master's gradient copy, not the later ones still in flight
            views = e.views[pc.k]
            grad = views[1]
            if pc.at is not None:
                grad = self._scratch()[pc.at : pc.at + pc.size].copy_(grad)
            params.append(views[0])
            grads.append(grad)
            avgs.append(views[2])
            sqs.append(views[3])
            if amsgrad:
                maxes.append(views[4])
            steps.append(e.step)
        run_kernel(opt, group, params, grads, avgs, sqs, maxes, steps)
        for pc in block:  # on CUDA non-blocking: this block's copy overlaps the next block's step
            e = entries[pc.entry]
            if e.store is not None:
                views = e.views[pc.k]
                e.store(views[-1], views[0])

    def _block_size(self) -> int:
        if self.block is None:
            self.block = block_elements(s.master.numel() for s in self.slot_of.values() if s.separate)
        return self.block

    def _scratch(self) -> torch.Tensor:
        if self.scratch is None:  # once, at the first piece that casts
            dtype = next(s.master.dtype for s in self.slot_of.values() if s.separate)
            self.scratch = torch.empty(self._block_size(), dtype=dtype)
        return self.scratch


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return dst.copy_(src)
