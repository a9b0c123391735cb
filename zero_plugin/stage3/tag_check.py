"""[Note: gather tag] checks that do not stall the host ([Note: deferred host reads] in ``comm/host_reads.py``).

A buffered gather carries every rank's unit tag in its trailing columns.  The rows of tags are copied to
the host without blocking and compared there: at once when the copy has landed (always on the CPU), else
at a later gather's poll, and at the latest by ``flush()``, which the runtime calls at the end of every
backward (before any gradient is final: a step never applies gradients computed from mixed weights) and at
the start of every forward (a forward-only loop learns of a divergence one forward late, having updated
nothing).  Callers that hand gathered values to the user (``zp.gathered_parameters``, state dicts,
generation) flush right after their gathers.
"""

from __future__ import annotations

from collections import deque

import torch

from ..comm.host_reads import HostRead

__all__ = ["TagChecks", "tag_of"]


def tag_of(index: int) -> tuple[int, int]:
    """Unit ``index``'s tag: exact in every float dtype (values <= 129), unique per unit index."""
    return (index // 128 + 1, index % 128 + 1)


def _index_of(tag: list) -> int:
    return int((tag[0] - 1) * 128 + tag[1] - 1)


class TagChecks:
    def __init__(self) -> None:
        self._pending: deque[tuple[int, str, HostRead]] = deque()

    def add(self, index: int, name: str, tags: torch.Tensor) -> None:
        """``tags``: the gathered ``(world_size, 2)`` trailing columns of unit ``index``'s gather."""
        self._pending.append((index, name, HostRead(tags)))
        self.poll()

    def poll(self) -> None:
        """Check the reads that have landed, in order, without waiting."""
        while self._pending and self._pending[0][2].ready():
            self._check(*self._pending.popleft())

    def flush(self) -> None:
        """Check everything gathered so far, waiting for the copies still in flight."""
        while self._pending:
            self._check(*self._pending.popleft())

    @staticmethod
    def _check(index: int, name: str, read: HostRead) -> None:
        rows = read.get().tolist()
        expected = tag_of(index)
        bad = [r for r, row in enumerate(rows) if tuple(row) != expected]
        if bad:
            got = [_index_of(rows[r]) for r in bad]
            raise RuntimeError(
                f"zero_plugin stage 3: collective order diverged. This rank gathered unit {index} "
                f"({name!r}) while rank(s) {bad} gathered unit(s) {got} at the same point. Every rank must "
                "run the same blocks in the same order (a conditional branch that skips a block on some ranks?). "
                "Run the block on every rank (e.g. multiply its output by 0) or exclude it from sharding."
            )
