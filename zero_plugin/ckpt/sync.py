"""Every rank fails together: a check or write that raises on one rank raises on all.

Without this a rank that found a corrupt file would leave its peers blocked in
the next collective.  Each phase of a save or load runs through
:func:`on_every_rank`, which exchanges one small status object per rank.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from .format import CheckpointError

__all__ = ["on_every_rank"]

T = TypeVar("T")


def on_every_rank(comm: Any, fn: Callable[[], T]) -> T:
    """Run ``fn`` here; if it raised on any rank, raise on every rank (the local exception where it happened)."""
    try:
        result, error = fn(), None
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then re-raised
        result, error = None, exc
    status = None if error is None else _describe(error)
    statuses = comm.all_gather_object(status)
    if error is not None:
        raise error
    failed = [(rank, s) for rank, s in enumerate(statuses) if s is not None]
    if failed:
        rank, (is_checkpoint_error, message) = failed[0]
        raise CheckpointError(message if is_checkpoint_error else f"rank {rank} failed: {message}")
    return result


def _describe(error: Exception) -> tuple[bool, str]:
    if isinstance(error, CheckpointError):
        return True, str(error)
    return False, f"{type(error).__name__}: {error}"
