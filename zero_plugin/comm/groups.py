"""The cache of process groups that ``Comm`` makes once per (ranks, purpose) — the control channel, the
sibling groups, the shard and replica groups of a split ([Note: control channel], [Note: hierarchical
groups] in ``collectives.py``) — and its release after the default group is destroyed and at exit.

[Note: cached groups at exit]
The control channel and the stage-3 reduction group are made once per (ranks, purpose) and cached here;
the cache (and any engine still alive) keeps their gloo worker threads running after a script's own
``dist.destroy_process_group()``.  A thread still alive when the interpreter finalises now and then aborts
a run that succeeded ("terminate called without an active exception", exit -6: seen with
``examples/full_finetune.py`` under torchrun); engines the script no longer references but that sit in
reference cycles (a model and its engine) also keep the default group's threads alive through the
collectives' work handles they hold, until finalisation.  So the first Comm over more than one rank
registers an exit handler (:func:`release_groups_at_exit`) that drops the cache and collects those engines
while the interpreter is still whole, so that torch joins the threads.  :func:`release_groups` is the
same, on demand (the Lightning exit handler, ``run.py``'s teardown).
"""

from __future__ import annotations

import atexit
import gc
from typing import Any

__all__ = ["SAME_RANKS", "release_groups", "release_groups_at_exit"]

SAME_RANKS: dict[tuple, tuple[Any, Any]] = {}  # (ranks, purpose) -> (default group it was made in, group)
_EXIT_HANDLER = [False]


def release_groups() -> None:
    """Forget the cached control and sibling groups ([Note: control channel] in ``collectives.py``), whose
    cache entries also hold the default group: call it after ``destroy_process_group()``, so that the last
    references to the groups go and torch joins their threads (``zero_plugin/integrations/lightning/exit.py``,
    ``run.py``)."""
    SAME_RANKS.clear()


def _release_at_exit() -> None:
    release_groups()
    gc.collect()


def release_groups_at_exit() -> None:
    """Register, once per process, the exit handler of [Note: cached groups at exit]."""
    if not _EXIT_HANDLER[0]:
        _EXIT_HANDLER[0] = True
        atexit.register(_release_at_exit)
