"""Keep normalisation running statistics identical on every rank.

BatchNorm-style modules update ``running_mean``/``running_var`` from each rank's own batch, so ranks
drift apart.  After every training forward we average those floating-point buffers over the ranks
(one all-reduce per dtype), so every rank holds the same statistics at all times -- what evaluation
and checkpoints need.  Other buffers (rotary tables, masks) are constants and are left alone.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm.collectives import Comm

__all__ = ["BufferSync"]


class BufferSync:
    def __init__(self, buffers: list[torch.Tensor], comm: Comm) -> None:
        self.buffers = buffers
        self.comm = comm
        self.handle = None

    @classmethod
    def attach(cls, model: nn.Module, comm: Comm) -> BufferSync | None:
        stats = [
            b
            for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
            for b in (m.running_mean, m.running_var)
            if b is not None and b.is_floating_point()
        ]
        if comm.world_size == 1 or not stats:
            return None
        sync = cls(stats, comm)
        sync.handle = model.register_forward_hook(sync._after_forward)
        return sync

    @torch.no_grad()
    def _after_forward(self, module: nn.Module, args, output) -> None:
        if not module.training:
            return
        # Coalesced writes go through .data: autograd saved these buffers but does not use them in backward.
        self.comm.coalesced(self.buffers, self._average)

    def _average(self, flat: torch.Tensor) -> None:
        self.comm.all_reduce(flat, tag="running statistics")
        flat.div_(self.comm.world_size)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
