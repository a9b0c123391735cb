"""The cache of process groups that ``Comm`` makes once per (ranks, purpose) — the control channel, the
sibling groups, the shard and replica groups of a split ([Note: control channel], [Note: hierarchical
groups] in ``collectives.py``) — and the weak references through which zero_plugin holds every group.

[Note: cached groups at exit]
torch joins a gloo group's worker threads only when its last reference goes; ``destroy_process_group()``
drops torch's own (its registry) and shuts the groups down, but the threads stay until then.  A thread
still alive when the interpreter finalises now and then aborts a run that succeeded ("terminate called
without an active exception", exit -6: seen with ``examples/full_finetune.py`` under torchrun).  So
zero_plugin never holds a group longer than torch does: the cache and every ``Comm`` hold their groups
through :func:`weak` references (the default group itself is looked up by torch at each call), and a
collective on a destroyed group raises (:func:`live`).  A plain script's ``destroy_process_group()`` then
joins the default group's threads and those of the groups zero_plugin made, at every stage, whether or not
its model and engines are still referenced (``tests/integrations/test_plain_exit.py``).  Measured on rank
0 of a two-rank stage-3 script, right after ``destroy_process_group()``: 11 threads before (the main
thread, the store's, 3 each for the default group, the control channel and the reduction group), 1 after.

Two more holders of the default group are not ours.  torch's ``torch.distributed.nn.functional`` binds
``group=group.WORLD`` as default arguments when it is first imported, which creating the first optimizer
does (``torch._dynamo`` -> ``torch.distributed.fsdp`` -> ``_shard`` -> ``distributed.nn``): imported after
``init_process_group``, its ten functions keep the default group alive to the end, also in a plain torch
DDP script.  This module imports it first, so that its defaults are None wherever zero_plugin is imported
before the process group is initialised.  And a work handle holds its group's threads after
``destroy_process_group()`` (measured with torch's own collectives) until it goes: for handles that a
reference cycle keeps, :func:`release_groups_at_exit` runs a gc pass at exit while the interpreter is still
whole, after emptying the cache (:func:`release_groups`, also called by the Lightning exit handler and
``run.py``'s teardown); none of the stages' engines needed it in the test's script.
"""

from __future__ import annotations

import atexit
import gc
import weakref
from typing import Any, Callable

import torch.distributed as dist

if dist.is_available():  # torch.distributed.nn needs it
    import torch.distributed.nn  # noqa: F401 - before any init_process_group: [Note: cached groups at exit]

__all__ = ["SAME_RANKS", "live", "release_groups", "release_groups_at_exit", "weak"]

# (ranks, purpose) -> (the default group it was made in, the group), both weak: [Note: cached groups at exit]
SAME_RANKS: dict[tuple, tuple[Callable[[], Any], Callable[[], Any]]] = {}
_EXIT_HANDLER = [False]


def weak(group: Any) -> Callable[[], Any]:
    """A reference to ``group`` that does not keep it alive ([Note: cached groups at exit]): called, it gives
    the group while torch holds it and None once it is destroyed.  What ``new_group`` gives a rank outside
    the group (``GroupMember.NON_GROUP_MEMBER``, not a group) is held as it is."""
    if isinstance(group, dist.ProcessGroup):
        return weakref.ref(group)
    return lambda: group


def live(ref: Callable[[], Any], what: str) -> Any:
    """The group behind ``ref``; a clear error when it was destroyed and zero_plugin is still asked to use it."""
    group = ref()
    if group is None:
        raise RuntimeError(
            f"zero_plugin: the {what} was destroyed (dist.destroy_process_group()) but a sharded model or "
            "optimizer still uses it: call zp.setup again after init_process_group"
        )
    return group


def release_groups() -> None:
    """Forget the cached control and sibling groups ([Note: control channel] in ``collectives.py``); they are
    held weakly ([Note: cached groups at exit]), so this only empties the cache (the Lightning exit handler,
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
