"""Handles that ``Comm`` returns for async collectives when it issues something other than one
``dist.Work``: nothing (one rank), an all-reduce standing in for a reduce-scatter, or several calls that
make up one logical collective ([Note: in-place region gather] in ``collectives.py``).  Each has
``wait(timeout=None)`` like ``dist.Work``."""

from __future__ import annotations

import torch

__all__ = ["DoneWork", "RowWork", "SumWork", "Works"]


class DoneWork:
    """Stands in for a ``dist.Work`` when no communication is needed (one rank)."""

    def wait(self) -> bool:
        return True


class RowWork:
    """An in-place all-reduce standing in for a reduce-scatter: on completion, copy this rank's row out
    (divided by ``divisor``: an average)."""

    def __init__(self, work, output: torch.Tensor, row: torch.Tensor, divisor: int = 1) -> None:
        self.work, self.output, self.row, self.divisor = work, output, row, divisor

    def wait(self, timeout=None) -> bool:
        ok = self.work.wait() if timeout is None else self.work.wait(timeout=timeout)
        self.output.copy_(self.row)
        if self.divisor != 1:
            self.output.div_(self.divisor)
        return ok


class Works:
    """Several async collectives waited on as one."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self, timeout=None) -> bool:
        ok = True
        for w in self.works:
            ok = (w.wait() if timeout is None else w.wait(timeout=timeout)) and ok
        return ok


class SumWork:
    """A reduce-scatter sent point to point ([Note: point-to-point exchange] in ``collectives.py``): once
    the exchange completed, the peers' contributions are added into this rank's regions, peer by peer in
    rank order (at two ranks the sum equals gloo's all-reduce bit for bit: addition commutes)."""

    def __init__(self, works: list, mine: list[torch.Tensor], received: list[list[torch.Tensor]]) -> None:
        self.works, self.mine, self.received = works, mine, received
        self.done = False

    def wait(self, timeout=None) -> bool:
        ok = Works(self.works).wait(timeout)
        if not self.done:
            self.done = True
            for row in self.received:
                for target, contribution in zip(self.mine, row):
                    target.add_(contribution)
        return ok
