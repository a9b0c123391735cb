"""The order in which gradient reductions are issued: the same on every rank.

[Note: rank-agreed reduction order]
Collectives on one process group pair up by position: the k-th reduction a rank issues is summed with
the k-th reduction of every other rank.  If each rank issued a bucket (stages 0-2) or a unit (stage 3)
as soon as its own gradients were ready, ranks that use parameters unevenly (an expert that gets tokens
on one rank only, a branch taken on some ranks) would issue them in different orders: same sizes and
gloo silently sums one bucket's gradients into another's; different sizes and it aborts the process.

So reductions follow one order that every rank knows without talking: the bucket order fixed at setup
(stages 0-2) or the reverse of the forward order that every rank checked against its peers at the end of
the forward (stage 3, see [Note: collective order] in ``stage3/order.py``).  An item is issued when it is
ready *and* every item before it was issued (DDP's next-bucket rule); one whose gradients are missing on
this rank waits its turn and goes at the end of backward with zeros and has-grad flags of 0, so the result
is DDP's: the average over ranks, zeros from ranks that did not use a parameter, no gradient for a
parameter no rank used.  When every rank uses everything in the usual order nothing waits longer than
before.  Gradients that arrive after their item was issued (a parameter reused across reentrant
checkpoint segments) are reduced once more at the end of backward, in order, after the ranks agreed
which items that concerns (:meth:`ReductionSchedule.end_backward`).  That agreement is one small exchange
on the control channel, issued before the wait for the reductions in flight and read after it, so its
latency hides behind theirs.  Stages 0-2 exchange plain flags (:class:`LateFlags`); stage 3 lets its
``OrderGuard`` carry them, so the exchange also checks that every rank is at the same point.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Generic, Iterable, Protocol, Sequence, TypeVar

from ..comm.collectives import Comm

__all__ = ["ReductionSchedule", "LateAgreement", "LateFlags"]

T = TypeVar("T")


class LateAgreement(Protocol):
    """Which items any rank got late gradients for, in two halves so that the exchange overlaps a wait."""

    def start(self, order: Sequence[Any], late: Sequence[Any]) -> Any: ...

    def finish(self, handle: Any) -> set[int]:
        """``id`` of every item some rank got late gradients for."""


class LateFlags:
    """Stages 0-2: one flag per item in the agreed order, on the control channel."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def start(self, order: Sequence[Any], late: Sequence[Any]) -> Any:
        flags = [0.0] * len(order)
        late_ids = {id(item) for item in late}
        for i, item in enumerate(order):
            flags[i] = 1.0 if id(item) in late_ids else 0.0
        handle = self.comm.control_start(tuple(flags), "agreement on late gradients") if flags else None
        return order, handle

    def finish(self, handle: Any) -> set[int]:
        order, started = handle
        if started is None:
            return set()
        seen = self.comm.control_finish(started)
        return {id(item) for i, item in enumerate(order) if any(flags[i] for flags in seen)}


class ReductionSchedule(Generic[T]):
    """Issues reductions of ``items`` in a fixed order and keeps at most ``max_inflight`` pending (None: no bound,
    where a pending reduction holds no memory of its own: [Note: pending reductions] in ``reducer.py``).

    ``launch(item)`` issues the item's collectives and returns their pending records; ``complete(item,
    pending)`` waits for one and stores its result.
    """

    def __init__(
        self, launch: Callable[[T], list], complete: Callable[[T, Any], None], max_inflight: int | None
    ) -> None:
        self._launch = launch
        self._complete = complete
        self.max_inflight = max_inflight
        self.order: list[T] = []
        self._position: dict[int, int] = {}
        self._next = 0  # order[:_next] were issued in this backward
        self._ready: set[int] = set()
        self._inflight: deque = deque()

    def start(self, order: Iterable[T]) -> None:
        """Set the agreed order for the coming backward (between backwards only)."""
        assert not self._inflight and self._next == 0, "reduction order changed during a backward"
        self.order = list(order)
        self._position = {id(item): i for i, item in enumerate(self.order)}
        self._ready.clear()

    def position(self, item: T) -> int | None:
        """``item``'s place in the agreed order (None: not in it)."""
        return self._position.get(id(item))

    def mark_ready(self, item: T) -> None:
        """``item``'s gradients are final on this rank: issue it and every ready item after it, if its
        turn came."""
        self._ready.add(id(item))
        while self._next < len(self.order) and id(self.order[self._next]) in self._ready:
            self._issue(self.order[self._next])
            self._next += 1

    def flush(self) -> None:
        """End of backward: issue every item not yet issued, in order (missing gradients are zeros)."""
        while self._next < len(self.order):
            self._issue(self.order[self._next])
            self._next += 1

    def end_backward(self, late: list[T], agreement: LateAgreement) -> None:
        """Issue what is left in order, re-issue the items any rank got late gradients for, wait for all.
        The agreement's exchange goes out before the wait for the reductions in flight, which every rank
        makes anyway, and is read after it ([Note: rank-agreed reduction order])."""
        self.flush()
        handle = agreement.start(self.order, late)
        self.drain()  # an item's first reduction completes before its second is issued
        again = agreement.finish(handle)
        self.reissue([item for item in self.order if id(item) in again])
        self.finish()

    def reissue(self, items: list[T]) -> None:
        for item in items:
            self._issue(item)

    def drain(self) -> None:
        while self._inflight:
            item, pending = self._inflight.popleft()
            self._complete(item, pending)

    def finish(self) -> None:
        """Wait for everything and get ready for the next backward (same order unless ``start`` again)."""
        self.drain()
        self._next = 0
        self._ready.clear()

    def _issue(self, item: T) -> None:
        self._inflight.extend((item, pending) for pending in self._launch(item))
        bound = self.max_inflight
        while bound is not None and len(self._inflight) > bound:  # free buffers as we go, not all at the end
            done, pending = self._inflight.popleft()
            self._complete(done, pending)
