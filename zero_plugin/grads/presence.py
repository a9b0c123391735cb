"""Which parameters some rank had a gradient for, read once per backward instead of once per reduction.

[Note: deferred has-gradient flags]
A reduction carries one flag per parameter ([Note: unused parameters] in ``reducer.py``); the summed flag
says whether any rank had a gradient, and a parameter no rank had one for must keep none, so the optimizer
skips it as single-process training would.  Reading the flags as each reduction completes stalls the host
behind the collective on CUDA ([Note: deferred host reads] in ``comm/host_reads.py``).  Instead the flags
are copied to the host without blocking and read once, at the end of backward, after every reduction
(late re-reductions included) completed:
  * stage 3 (``DeferredPresence``): every member's averaged result is stored at completion (exact zeros
    where no rank had a gradient: every rank sent zeros), and the caller notes whether the member already
    had a gradient before this backward's first store; ``resolve()`` returns the members no rank had a
    gradient for in this backward and that had none before, and the caller drops what it stored for them.
    A member that had a gradient (accumulation) kept it plus exact zeros, unchanged.  Stage 3's stores add
    into the shard gradient and its pooled output buffers cannot wait, hence store-then-drop.
  * stages 1-2 (``DeferredStores``): a member this rank had a gradient for is certainly present and is
    stored at completion; the others' results are copied and stored at ``run()`` if some rank had one.
Stage 0 reads its flags at completion: its store overwrites ``param.grad``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..comm.host_reads import HostRead

__all__ = ["DeferredPresence", "DeferredStores"]

Store = Callable[[Any, torch.Tensor], None]


class DeferredPresence:
    """Stage 3: store now, drop at the end of backward (its stores add into the shard gradient, so
    storing exact zeros changes nothing; its pooled output buffers cannot wait)."""

    def __init__(self) -> None:
        self._reads: list[tuple[list, HostRead]] = []
        self._had_grad: dict[int, tuple[Any, bool]] = {}  # id(member) -> (member, had one before the first store)

    def take(
        self, members: list, flags: torch.Tensor, results: list[torch.Tensor], store: Store, local: list | None = None
    ) -> None:
        """A completed reduction: its summed flags, one per member, and each member's averaged result."""
        self.add(members, flags)
        for member, result in zip(members, results):
            store(member, result)

    def add(self, members: list, flags: torch.Tensor) -> None:
        """A completed reduction's summed flags, one per member, in ``members``' order."""
        self._reads.append((members, HostRead(flags)))

    def note(self, member: Any, had_grad: bool) -> None:
        """Before each store: whether ``member`` holds a gradient already (the first note of a backward counts)."""
        self._had_grad.setdefault(id(member), (member, had_grad))

    def resolve(self) -> list:
        """The members stored for in this backward that no rank had a gradient for and that had none
        before it; forgets this backward."""
        present: set[int] = set()
        for members, read in self._reads:
            for member, flag in zip(members, read.get().tolist()):
                if flag:
                    present.add(id(member))
        absent = [m for key, (m, had) in self._had_grad.items() if not had and key not in present]
        self._reads.clear()
        self._had_grad.clear()
        return absent


class DeferredStores:
    """Stages 1-2 (stage 0's store overwrites ``param.grad``: a late re-reduction's result must not be
    followed by an earlier deferred one, so it reads the flags at completion).  Their stores overwrite (stage 1 copies the reduced region into ``param.grad``), so exact
    zeros cannot be stored and dropped later as at stage 3.  But a member this rank had a gradient for
    (``local``, the flag it sent) has a non-zero summed flag for certain: it is stored at completion, as
    before.  Only the others wait: a copy of their result, stored at ``run()`` (end of backward, after any
    late re-reduction) if some rank had a gradient for them.  Stage 1 refuses late gradients and stage 2's
    store adds, so the result is what reading every flag at completion gave, with one host read per
    backward instead of one per bucket."""

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
