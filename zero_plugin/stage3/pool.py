"""Reusable flat buffers for stage-3 collectives (all-gather inputs/outputs, reduce-scatter buffers).

[Note: buffer reuse]  Every unit gathers and reduces through flat buffers of its own size, several
times per step.  Allocating them fresh each time makes the host allocator (glibc) keep the freed
blocks: its mmap threshold rises to the largest block freed, after which unit-sized blocks come from
the heap, which grows around the activations allocated in between and does not shrink.  Peak RSS
then ends up at or above DDP's although the live bytes are far lower.  Reusing the same few blocks
(decoder layers all have the same size) keeps the allocator out of the loop.  On CUDA the caching
allocator reuses blocks already; the pool only saves its bookkeeping there.

A block is handed out as a 1-D view of exactly the requested size and must be given back only after
the collective that used it completed (the records of ``comm/layout.py`` give buffers back after
``wait``) and, on CUDA, after the compute stream waited for the side stream that used it: the next
user, on any stream, is then ordered after every earlier use ([Note: side streams] in
``zero_plugin/comm/streams.py``).  Free blocks are kept per (dtype, device), at most ``max_free`` of them:
the smallest is dropped beyond that.
"""

from __future__ import annotations

import torch

__all__ = ["BufferPool"]


class BufferPool:
    def __init__(self, max_free: int = 6) -> None:
        self.max_free = max_free
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        blocks = self._free.get((dtype, torch.device(device)), [])
        fitting = [i for i, b in enumerate(blocks) if b.numel() >= numel]
        if fitting:
            block = blocks.pop(min(fitting, key=lambda i: blocks[i].numel()))
        else:
            if blocks and len(blocks) >= self.max_free:
                blocks.pop(0)  # sorted ascending: drop the smallest rather than grow the pool
            block = torch.empty(numel, dtype=dtype, device=device)
        return block[:numel]

    def give(self, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            return
        block = tensor._base if tensor._base is not None else tensor
        blocks = self._free.setdefault((block.dtype, block.device), [])
        if any(b is block for b in blocks):
            return
        blocks.append(block)
        blocks.sort(key=lambda b: b.numel())
        while len(blocks) > self.max_free:
            blocks.pop(0)

    def clear(self) -> None:
        self._free.clear()

    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for blocks in self._free.values() for b in blocks)
