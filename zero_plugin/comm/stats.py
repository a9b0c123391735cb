"""Counters behind :func:`zero_plugin.comm_stats`: calls and logical bytes per collective kind and per
labelled group, and the torch.distributed calls issued by function name.

Only ``Comm`` (``collectives.py``) records here; what it counts is [Note: logical bytes] and the per-group
entries [Note: hierarchical groups], both in ``collectives.py``.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

__all__ = ["comm_stats", "issued", "physical_calls", "record", "reset_comm_stats"]


@dataclass(slots=True)
class Counter:
    calls: int = 0
    bytes: int = 0


_LOCK = threading.Lock()
_STATS: dict[str, Counter] = defaultdict(Counter)
_GROUP_STATS: dict[str, Counter] = defaultdict(Counter)  # by Comm.label: [Note: hierarchical groups]
_PHYSICAL: dict[str, int] = defaultdict(int)


def issued(name: str) -> None:
    """Count one torch.distributed call by the function's name (tests compare with spies on torch)."""
    with _LOCK:
        _PHYSICAL[name] += 1


def record(kind: str, nbytes: int, label: str | None = None) -> None:
    """Count one logical collective of ``kind`` moving ``nbytes``, also under the group ``label`` if any."""
    with _LOCK:
        for counter in (_STATS[kind], _GROUP_STATS[label]) if label is not None else (_STATS[kind],):
            counter.calls += 1
            counter.bytes += int(nbytes)


def physical_calls() -> dict[str, int]:
    """torch.distributed calls issued since the last :func:`reset_comm_stats`, by function name.
    Logical collectives (``comm_stats``) may be issued as several calls, e.g. an in-place region
    gather as one broadcast per region."""
    with _LOCK:
        return dict(_PHYSICAL)


def comm_stats() -> dict[str, dict[str, int]]:
    """Calls and logical bytes ([Note: logical bytes] in ``collectives.py``) per collective kind since the last
    reset, plus a ``total``; with hierarchical sharding also ``shard_group`` and ``replica_group`` ([Note:
    hierarchical groups]), not in the total."""
    with _LOCK:
        out = {k: {"calls": c.calls, "bytes": c.bytes} for k, c in _STATS.items()}
        groups = {f"{k}_group": {"calls": c.calls, "bytes": c.bytes} for k, c in _GROUP_STATS.items()}
    out["total"] = {
        "calls": sum(v["calls"] for v in out.values()),
        "bytes": sum(v["bytes"] for v in out.values()),
    }
    out.update(groups)
    return out


def reset_comm_stats() -> None:
    """Zero every counter: the per-kind and per-group counts and the physical calls."""
    with _LOCK:
        _STATS.clear()
        _GROUP_STATS.clear()
        _PHYSICAL.clear()
