"""Which parameters some rank had a gradient for, read once per backward instead of once per reduction.

[Note: deferred has-gradient flags]
A reduction carries one flag per parameter ([Note: unused parameters] in ``reducer.py``); the summed flag
says whether any rank had a gradient, and a parameter no rank had one for must keep none, so the optimizer
skips it as single-process training would.  Reading the flags as each reduction completes stalls the host
behind the collective on CUDA ([Note: deferred host reads] in ``comm/host_reads.py``).  With a
``DeferredPresence`` the completion instead stores every member's averaged result (exact zeros where no
rank had a gradient: every rank sent zeros), hands the flags to ``add`` (copied to the host without
blocking), and the caller notes for each stored member whether it already had a gradient before this
backward's first store.  ``resolve()`` at the end of backward, after every reduction completed, reads the
flags once and returns the members no rank had a gradient for in this backward and that had none
before: the caller drops what it stored for them.  A member that had a gradient (accumulation) kept it
plus exact zeros, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.host_reads import HostRead

__all__ = ["DeferredPresence"]


class DeferredPresence:
    def __init__(self) -> None:
        self._reads: list[tuple[list, HostRead]] = []
        self._had_grad: dict[int, tuple[Any, bool]] = {}  # id(member) -> (member, had one before the first store)

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
