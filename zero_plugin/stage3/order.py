"""Stage 3: every rank runs the same units in the same order, or every rank raises.

[Note: collective order]
Stage-3 collectives pair up by position, like all collectives on a group.  A block called on some ranks
only (a branch that skips it) would pair one rank's gather of unit A with another's gather of unit B:
same sizes and the weights mix silently; different sizes and gloo aborts the process.  So the ranks
compare, on the control channel ([Note: control channel] in ``collectives.py``: a separate group, host
only), every unit they enter in a forward, and no payload goes out before every earlier comparison
agreed:
  * a unit entered already gathered (prefetched): its index is exchanged asynchronously and checked at
    the next unit's entry, a whole unit of compute later, so nobody waits; its prefetches go out at once,
    which is safe: prefetches follow the previous forward's agreed order from the first unit not yet
    gathered, which every rank shares once the earlier checks agreed, so ranks that entered different
    units issue two prefixes of one sequence (never two different sizes) and the pending check fails;
  * a unit gathered on entry, and any gather outside the hooks (``gathered_parameters``, state dicts):
    a blocking check before the payload;
  * backward gathers follow one list every rank agreed at the end of the forward ([Note: backward gather
    order] in hooks.py), so they need no check, except a unit gathered a second time in one backward;
  * at the end of each forward with gradients every rank sends a fingerprint of the order it ran its
    units in: the reverse of that order is the order of the reductions ([Note: rank-agreed reduction
    order] in ``grads/schedule.py``).
On any mismatch every rank sees the same messages, so all of them take the error path together: they
exchange the names of the units they ran and raise one error naming the units not run on every rank.
Cost: host-only exchanges of (3 + units) float64, one per unit entered, one per forward and one per
backward (``benchmarks/results/ab-blocks34m.md`` for the measured effect on step time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..comm.collectives import Comm

if TYPE_CHECKING:
    from .unit import Unit

__all__ = ["OrderGuard"]

_GATHER, _FORWARD_END, _LATE = 1.0, 2.0, 3.0
STATE_DICT, LOAD_STATE_DICT = 11.0, 12.0  # sent by stage3/state_dict_hooks.py in the guard's message format
_HEAD = 3  # kind, value, fingerprint; then one element per unit
_MODULUS, _BASE = 2_147_483_647, 1_000_003  # fingerprint mod a prime < 2**31: exact in float64


class OrderGuard:
    """Checks, with the peers, each gather and each forward's unit order before they matter.

    Every message has the same length (3 + one element per unit), so a rank at another point of the
    protocol is reported, not paired with a collective of another size."""

    def __init__(self, comm: Comm, names: Sequence[str]) -> None:
        """``names``: every unit's name by index (made before the units: [Note: unit record] in unit.py)."""
        self.comm = comm
        self.names = list(names)
        self.active = comm.control_size > 1 and comm.moves_data  # replicas too: [Note: control channel]
        self.recording: list[Unit] = []  # the units this rank ran in the current forward (runtime's list)
        self._pending: list = []  # asynchronous comparisons not checked yet
        comm.open_control_channel()

    def before_gather(self, unit: Unit) -> None:
        """Blocking: ``unit`` is about to be gathered on demand."""
        if self.active:
            self.settle()
            self._agree(self._message(_GATHER, unit.index), f"order check before gathering unit {unit.name!r}")

    def entered(self, unit: Unit) -> None:
        """``unit`` was entered already gathered: compare asynchronously, checked by :meth:`settle`."""
        if self.active:
            self.settle()  # at most one comparison in flight: an error path finds no other one pending
            self._pending.append(
                self.comm.control_start(self._message(_GATHER, unit.index), f"order check of unit {unit.name!r}")
            )

    def settle(self) -> None:
        """Check every asynchronous comparison issued so far (each rank calls it at the same points)."""
        while self._pending:
            self._check(self.comm.control_finish(self._pending.pop(0)))

    def end_of_forward(self, order: Sequence[Unit], backward: set[Unit]) -> set[Unit]:
        """Check the forward's order; returns the units whose outputs need a gradient on *any* rank
        ([Note: backward gather order] in hooks.py)."""
        if not self.active:
            return set(backward)
        self.settle()
        seen = self._agree(
            self._message(_FORWARD_END, len(order), _fingerprint(order), backward), "order check after the forward"
        )
        return {u for u in order if any(m[_HEAD + u.index] for m in seen)}  # every rank's order is this one

    # -- late gradients: a LateAgreement ([Note: rank-agreed reduction order] in grads/schedule.py) ----------
    def start(self, order: Sequence[Unit], late: Sequence[Unit]):
        """Issue the agreement on the units any rank got late gradients for; read by :meth:`finish`."""
        if not self.active:
            return order, set(late)
        self.settle()
        return order, self.comm.control_start(self._message(_LATE, 0, 0.0, late), "agreement on late gradients")

    def finish(self, handle) -> set[int]:
        order, started = handle
        if not self.active:
            return {id(u) for u in started}
        seen = self._check(self.comm.control_finish(started))
        return {id(u) for u in order if any(m[_HEAD + u.index] for m in seen)}

    def _message(self, kind: float, value: int, fingerprint: float = 0.0, marked=()) -> tuple[float, ...]:
        mask = [0.0] * len(self.names)
        for unit in marked:
            mask[unit.index] = 1.0
        return (kind, float(value), fingerprint, *mask)

    def _agree(self, message: tuple[float, ...], what: str) -> list[tuple[float, ...]]:
        return self._check(self.comm.control_exchange(message, what))

    def _check(self, seen: list[tuple[float, ...]]) -> list[tuple[float, ...]]:
        """The heads (kind, value, fingerprint) must match; the unit masks may differ."""
        if any(m[:_HEAD] != seen[0][:_HEAD] for m in seen):
            self._pending.clear()
            self._raise(seen)
        return seen

    def _raise(self, seen: list[tuple[float, ...]]) -> None:
        ran = [
            [self.names[i] for i in indices]  # every rank is here: the same list told them all
            for indices in self.comm.control_objects([u.index for u in self.recording])
        ]
        everywhere = set.intersection(*(set(r) for r in ran))
        uneven = sorted({name for r in ran for name in r} - everywhere)
        doing = "; ".join(f"rank {r} {self._describe(m)}" for r, m in enumerate(seen))
        runs = "; ".join(f"rank {r}: {names}" for r, names in enumerate(ran))
        raise RuntimeError(
            "zero_plugin stage 3: collective order diverged: ranks ran different blocks in this forward. "
            f"Not run on every rank: {uneven or 'none (the same blocks in a different order)'}. At this point {doing}. "
            f"Blocks run so far: {runs}. Every rank must call the same blocks in the same order (a branch that "
            "skips a block on some ranks?): call the block on every rank (it may ignore its weights or its "
            "output may go unused there) or leave it out of the units (ZeroConfig.unit_classes)."
        )

    def _describe(self, message: tuple[float, ...]) -> str:
        kind, value = message[0], int(message[1])
        if kind == _GATHER:
            return f"enters unit {value} ({self.names[value]!r})"
        if kind == _FORWARD_END:
            return f"ends its forward after {value} blocks"
        if kind == STATE_DICT:
            return "is in state_dict()"
        if kind == LOAD_STATE_DICT:
            return "is in load_state_dict()"
        return "ends its backward"


def _fingerprint(order: Sequence[Unit]) -> float:
    value = 0
    for unit in order:
        value = (value * _BASE + unit.index + 1) % _MODULUS
    return float(value)
