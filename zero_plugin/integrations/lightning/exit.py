"""Leaving the process cleanly after a Lightning / Fabric run under the ZeRO strategies.

[Note: gloo at interpreter exit]
A gloo worker thread that has run a collective drops its reference to the work object *after* the
Python caller's ``wait()`` returned.  When that is the last reference to a tensor whose Python object is
already gone (``all_gather_object``'s temporaries, an async op's inputs), releasing it takes the GIL.  If
the interpreter has started finalising by then, CPython ends the thread with ``pthread_exit``, whose forced
unwind through the work's (noexcept) destructor calls ``std::terminate``: "terminate called without an
active exception", exit code 134 / -6, after a run that succeeded.  Seen in 1 of 30-50 short zero3 runs
(core dump: a default-group worker in ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` ->
``pthread_exit`` while the main thread was in ``Py_FinalizeEx``; the run's last collectives were
``zp.save_checkpoint``'s ``all_gather_object`` calls and two barriers, 4-15 ms before the end).  Any
collective shortly before exit can do it; on a loaded machine the worker may get no CPU until then.

torch joins a group's worker threads only when its last Python reference goes, not in
``destroy_process_group`` (which only unregisters it); zero_plugin holds its groups weakly ([Note: cached
groups at exit] in ``comm/groups.py``), but work handles in reference cycles still hold theirs.  So a strategy
that initialised the default group registers, once per process, :func:`_release_groups`, an ``atexit`` handler
that runs while the interpreter is fully alive: a barrier (every rank leaves together; skipped after an
uncaught exception), then ``destroy_process_group()``, zero_plugin's cached references dropped and a gc pass,
so that the default group is destroyed there -- torch releases the GIL while it joins the threads, which
finish their last releases first.  ``zero_plugin/run.py`` (Accelerate, HF Trainer) leaves with ``os._exit``
instead, which a strategy cannot do: the script decides how the process ends.  Not in ``teardown``: a script
may call ``trainer.test`` after ``trainer.fit`` with the same sharded module, and ``DDPStrategy.teardown``
keeps the group too.
"""

from __future__ import annotations

import atexit
import gc
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["release_groups_at_exit"]

_REGISTERED = False


def release_groups_at_exit(timeout: timedelta | None) -> None:
    """Register :func:`_release_groups` once per process ([Note: gloo at interpreter exit]); ``timeout``
    bounds the exit barrier (a peer still working, e.g. rank 0 writing a file, is waited for)."""
    global _REGISTERED
    if not _REGISTERED:
        _REGISTERED = True
        atexit.register(_release_groups, timeout)


def _release_groups(timeout: timedelta | None) -> None:
    if dist.is_available() and dist.is_initialized():
        if not _exiting_on_error():
            _barrier(timeout)
        dist.destroy_process_group()
    from zero_plugin.comm.groups import release_groups

    release_groups()  # empty zero_plugin's cache of groups (held weakly)
    gc.collect()  # the default group's last references are gone: its threads are joined here


def _exiting_on_error() -> bool:
    """An uncaught exception is ending the process: a peer may never reach the barrier."""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _barrier(timeout: timedelta | None) -> None:
    try:
        # NCCL needs the device, as Lightning's own barrier passes it (the root device is the current one).
        device_ids = [torch.cuda.current_device()] if dist.get_backend() == "nccl" else None
        work = dist.barrier(async_op=True, device_ids=device_ids)
        work.wait() if timeout is None else work.wait(timeout=timeout)
    except Exception:  # noqa: BLE001 - a peer that failed has gone; destroy anyway
        pass
