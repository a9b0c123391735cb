"""The offloaded mixed-precision step on a CPU-only machine, one cache-sized block at a time.

[Note: cache-blocked offload step]
With ``param_dtype`` below the fp32 masters, an offloaded step is three passes over each parameter:
cast the reduced bf16/fp16 gradient up to fp32, run Adam (reads master, gradient and both moments,
writes three of them back), cast the updated master down into the parameter.  Done a whole tensor at
a time, as DeepSpeed's ZeRO-Offload does and as ``MasterParam.set_grad`` / ``write_back`` do, every
pass streams the whole shard through DRAM: about 46 bytes per parameter with the write-allocate reads,
and a full fp32 gradient (4 bytes per parameter of this rank's shard) is allocated for every step.
On a CPU-only machine the host is the device and all three passes run here, so this step walks the
masters in blocks of ``BLOCK`` elements instead: cast that block's gradient into one reused fp32
scratch, run torch's fused kernel on views of that block of the master and its state, cast the block
of the master back into the parameter.  The scratch and the just-updated master are still in cache
when the next pass reads them, so DRAM moves about 30 bytes per parameter, and no gradient larger than
one block is ever allocated (host memory stays at the masters and moments, 12 bytes per parameter,
plus ``BLOCK`` * 4 bytes).  Measured in ``benchmarks/offload_step.py``.

Bitwise the same as the whole-tensor path: the kernel is elementwise, and every piece starts at a
multiple of ``ALIGN`` elements of its own tensor, so the kernel's vectorised body and scalar tail
cover the same elements as in one call over the whole tensor (pieces cut at other offsets round
differently in the last bit).  Several small tensors share a block; one kernel call steps a block.

Used when :func:`~zero_plugin.optim.cpu_step.covered` allows a direct fused step (exact Adam/AdamW,
nothing hooked into ``step``) and the engine has masters separate from their parameters on the same
(CPU) device; otherwise the step takes the whole-tensor path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cpu_step import covered, group_state, run_kernel
from .master import MasterParam

__all__ = ["BlockedStep", "BLOCK", "ALIGN"]

BLOCK = 1 << 18   # elements per block: 1 MiB of fp32 gradient scratch, ~5 MiB touched per block
ALIGN = 64        # pieces start at multiples of this many elements of their tensor (a multiple of any vector width)


@dataclass(slots=True)
class _Piece:
    """The ``k``-th piece of one entry (``size`` elements), and where its fp32 gradient sits in the scratch."""
    entry: int
    k: int
    size: int
    at: int | None   # scratch offset, None when the gradient is already fp32 and used in place


@dataclass(slots=True)
class _Entry:
    """One parameter's tensors as flat views; ``views`` holds their pieces once the blocks are planned."""
    tensors: list[torch.Tensor]   # master, grad, exp_avg, exp_avg_sq[, max_exp_avg_sq][, local]
    step: torch.Tensor
    cast: bool                    # the gradient is bf16/fp16 and goes through the scratch
    local: bool                   # a separate master, written back into its parameter region
    sizes: list[int]
    views: list[tuple] | None = None


class BlockedStep:
    """Steps a covered optimizer block by block, casting gradients in and masters out on the way."""

    def __init__(self, slots: list[MasterParam]) -> None:
        self.slot_of = {id(s.master): s for s in slots}
        self.scratch: torch.Tensor | None = None

    @staticmethod
    def wanted(slots: list[MasterParam]) -> bool:
        """True when some master is a separate fp32 copy on the parameter's own device, the CPU."""
        return any(s.separate and s.master.device == s.local.device == torch.device("cpu") for s in slots)

    def applies(self, optimizer: torch.optim.Optimizer) -> bool:
        """Checked every step (a hook registered later turns it off); True means :meth:`step` will run."""
        if not covered(optimizer):
            return False
        for group in optimizer.param_groups:
            for p in group["params"]:
                slot = self.slot_of.get(id(p))
                if not p.is_contiguous() or (slot is not None and slot.separate and not slot.local.is_contiguous()):
                    return False
        return True

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step every group; separate masters' gradients come from ``slot.deferred_grad`` (left there by
        ``set_grad(defer_cast=True)``) and the updated masters are written back here."""
        optimizer._opt_called = True   # type: ignore[attr-defined]  # as in fused_cpu_step: no LR-scheduler warning
        for group in optimizer.param_groups:
            entries, written = self._entries(optimizer, group)
            blocks = list(self._blocks(entries))
            for e in entries:   # every piece's views, made by one split per tensor
                e.views = list(zip(*(t.split(e.sizes) for t in e.tensors)))
            for block in blocks:
                self._step_block(optimizer, group, entries, block)
            for slot in written:
                slot.deferred_grad = None
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
            if slot is not None:
                tensors.append(slot.local.view(-1))
            entries.append(_Entry(tensors, st["step"], g.dtype != m.dtype, slot is not None, []))
        return entries, [s for s in slots if s is not None]

    @staticmethod
    def _blocks(entries: list[_Entry]):
        """Lists of pieces of at most ``BLOCK`` elements in all (recording each entry's piece sizes); every
        piece starts at a multiple of ``ALIGN`` elements of its tensor and of 16 elements of the scratch."""
        block: list[_Piece] = []
        used = at = 0   # elements in this block; scratch elements taken by its pieces that cast
        for i, e in enumerate(entries):
            n = e.tensors[0].numel()
            lo = 0
            while lo < n:
                room = BLOCK - used
                take = n - lo if n - lo <= room else room - room % ALIGN
                if take == 0:
                    yield block
                    block, used, at = [], 0, 0
                    continue
                block.append(_Piece(i, len(e.sizes), take, at if e.cast else None))
                e.sizes.append(take)
                used += -(-take // 16) * 16
                at += -(-take // 16) * 16 if e.cast else 0
                lo += take
                if used >= BLOCK:
                    yield block
                    block, used, at = [], 0, 0
        if block:
            yield block

    def _step_block(self, opt, group, entries: list[_Entry], block: list[_Piece]) -> None:
        scratch = self._scratch()
        amsgrad = group["amsgrad"]
        params, grads, avgs, sqs, maxes, steps = [], [], [], [], [], []
        for pc in block:
            e = entries[pc.entry]
            views = e.views[pc.k]
            grad = views[1]
            if pc.at is not None:
                grad = scratch[pc.at:pc.at + pc.size].copy_(grad)
            params.append(views[0])
            grads.append(grad)
            avgs.append(views[2])
            sqs.append(views[3])
            if amsgrad:
                maxes.append(views[4])
            steps.append(e.step)
        run_kernel(opt, group, params, grads, avgs, sqs, maxes, steps)
        for pc in block:
            e = entries[pc.entry]
            if e.local:
                views = e.views[pc.k]
                views[-1].copy_(views[0])

    def _scratch(self) -> torch.Tensor:
        if self.scratch is None:   # once: one block, or less when every separate master together is smaller
            need = sum(-(-s.master.numel() // 16) * 16 for s in self.slot_of.values() if s.separate)
            dtype = next(s.master.dtype for s in self.slot_of.values() if s.separate)
            self.scratch = torch.empty(max(16, min(BLOCK, need)), dtype=dtype)
        return self.scratch
