"""Which parameters some rank had a gradient for, read once per backward instead of once per reduction.

[Note: deferred has-gradient flags]
A reduction carries one flag per parameter ([Note: unused parameters] in ``reducer.py``); the summed flag
says whether any rank had a gradient, and a parameter no rank had one for must keep none, so the optimizer
skips it as single-process training would.  Reading the flags as each reduction completes stalls the host
behind the collective on CUDA ([Note: deferred host reads] in ``comm/host_reads.py``).  But a member this
rank had a gradient for (``local``, the flag it sent) has a non-zero summed flag for certain: it is stored
at completion, as before.  Only the others wait: a copy of their result (the reduction's buffer may be
reused meanwhile; stage 3 pools them) is stored at ``run()``, at the end of backward after every reduction
(late re-reductions included) completed, if some rank had a gradient for it; the flags are copied to the
host without blocking and read there, once per backward.  Stages 1-3 (buffered layout): stage 1 refuses
late gradients, stages 2 and 3 add what they store, so the result is what reading every flag at
completion gave.  Stage 0 reads its flags at completion: its store overwrites ``param.grad``, and a late
re-reduction's result must not be followed by an earlier deferred one.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..comm.host_reads import HostRead

__all__ = ["DeferredStores"]

Store = Callable[[Any, torch.Tensor], None]


class DeferredStores:
    """Stores that need the summed flags, held until ``run()`` at the end of backward."""

    def __init__(self) -> None:
        self._pending: list[tuple[HostRead, list[tuple[int, Any, torch.Tensor]], Store]] = []

    def take(
        self, members: list, flags: torch.Tensor, results: list[torch.Tensor], store: Store, local: list | None = None
    ) -> None:
        if local is None:
            local = [False] * len(members)
        unknown = []
        for i, (member, result, here) in enumerate(zip(members, results, local)):
            if here:
                store(member, result)
            else:
                unknown.append((i, member, result.clone()))  # the buffer may be reused before run()
        if unknown:
            self._pending.append((HostRead(flags), unknown, store))

    def run(self) -> None:
        pending, self._pending = self._pending, []
        for read, unknown, store in pending:
            flags = read.get().tolist()
            for i, member, result in unknown:
                if flags[i]:
                    store(member, result)
