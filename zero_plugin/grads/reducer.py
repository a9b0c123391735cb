"""Gradient reduction during backward for stages 0-2.

Pipeline per bucket: ``copy_in -> collective (async) -> wait -> copy_out``.
Hooks are ``register_post_accumulate_grad_hook`` on each trainable parameter; a
bucket whose gradients are all final is issued in the bucket order every rank
shares ([Note: rank-agreed reduction order] in ``schedule.py``).  A final
autograd callback (queued from the first hook, or from the model output's grad
hook, so that it belongs to the outermost backward) issues the buckets that did
not complete (unused parameters) and waits for all of them.

[Note: unused parameters]
Each bucket carries one flag per parameter (1 where this rank has a gradient); after the
collective the summed flag tells whether *any* rank had one.  A parameter no rank used keeps
no gradient, so the optimizer skips it exactly as single-process training (and DDP) would;
a parameter used on some ranks only gets the average with zeros from the others.

Stage composition (see ``zero_plugin/stages.py``):
  * stage 0 -> :class:`AllReduceReducer`: every rank keeps the full averaged grad in ``param.grad``;
  * stage 1 -> :class:`ReduceScatterReducer(keep_full_grad=True)`: the averaged owned region
    is written into ``param.grad`` in place (full gradients stay allocated, ZeRO-1; in the in-place layout as
    views of the buckets' persistent buffers: [Note: gradients as bucket views] in ``views.py``);
  * stage 2 -> :class:`ReduceScatterReducer(keep_full_grad=False)`: the averaged owned region
    goes to a shard-sized gradient and ``param.grad`` is freed (ZeRO-2).

[Note: reduced regions and later backwards] Reduced gradients are kept in ``reduce_dtype`` (fp32
reductions of bf16 parameters stay fp32, as at stage 3).  Stage 1 keeps full gradients: after a reduction
``param.grad`` holds the average only in this rank's region, and the sum (in place) or this rank's own
gradient (buffered, or a reduction in another dtype) elsewhere, which differs between ranks.  Whatever a
reduction took in must never be reduced again before the step, and whatever accumulated since must be:
  * ``consumed`` remembers, per parameter, the ``param.grad`` tensor a reduction of this step took in (or
    wrote the average into);
  * a pre-accumulation hook (any backward, synced or under ``no_sync``) detaches ``param.grad`` only when it
    is that tensor, so gradients accumulated under ``no_sync`` since the last reduction are kept and
    reduced by the next synced backward;
  * a bucket launched while a member's ``param.grad`` is still that tensor (the rank did not use the
    parameter in this backward) reduces it as absent (flag 0, zeros), and the tensor is put back at the
    end of backward if no rank had a new gradient for it.
The new average is added to the earlier one (``owned``).  Found by the differential fuzzer: a ``no_sync``
micro-batch between two synced ones was dropped, and a parameter unused on a rank in a second synced
backward had its first average reduced again.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
from torch import nn

from ..comm import layout as comm_layout
from ..comm.collectives import Comm
from ..optim.master import MasterParam
from ..tensors.phases import phase
from ..tensors.weak_hook import WeakHook
from .bucket import Bucket, plan_buckets
from .presence import DeferredStores
from .schedule import LateFlags, ReductionSchedule
from .views import BucketViews, reduce_scatter_keeps_views, store_view

__all__ = ["AllReduceReducer", "ReduceScatterReducer", "GradReducer"]

# [Note: pending reductions]
# A bucket's reduction launched during backward is completed (waited for, averaged, stored) once more than
# MAX_INFLIGHT are pending, so that what a pending reduction holds is let go as backward goes on instead of all
# at its end: stage 0's flat buffer when it reduces in another dtype, the peers' regions that an in-place
# reduce-scatter receives into, a buffered layout's rows, stage 2's full gradients.  A stage-0 bucket whose
# gradients are views of its persistent buffer ([Note: gradients as bucket views] in views.py) holds nothing
# more while pending: a reducer made only of such buckets has no bound, as DDP has none, so backward never
# waits for an earlier all-reduce and every bucket completes in the final callback (with the bound, stage 0's
# backward at 370M on 2 cores idled ~0.4 s more than DDP's for the same CPU time: issue #49,
# benchmarks/results/49-370m-ws2.md).
MAX_INFLIGHT = 2  # buckets whose collective may be pending at once during backward, where they hold memory


def pending_bound(all_reduce_of_views: bool) -> int | None:
    """How many launched buckets may be pending ([Note: pending reductions]): none where every bucket is
    all-reduced in place in its persistent buffer (stage 0's bucket views); the memory planner asks the same."""
    return None if all_reduce_of_views else MAX_INFLIGHT


class GradReducer:
    """Shared hook and bucket bookkeeping; subclasses define launch and completion."""

    sharded = False
    supports_late = False  # a second gradient after the bucket was issued is reduced again (stage 2)

    def __init__(
        self, slots: list[MasterParam], comm: Comm, reduce_dtype: torch.dtype | None, bucket_bytes: int
    ) -> None:
        self.slots = slots
        self.comm = comm
        self.layout = comm_layout.layout_of(comm)  # [Note: collective layouts] in comm/layout.py
        self.reduce_dtype = reduce_dtype
        self.buckets = plan_buckets(slots, bucket_bytes, sharded=self.sharded)
        self._where = {id(s.param): (b, i) for b in self.buckets for i, s in enumerate(b.slots)}
        # [Note: gradients as bucket views] in views.py: the buckets whose gradients are views of a buffer
        self.views = BucketViews(reduce_dtype)
        self._viewed = {id(b) for b in self.buckets if self._keeps_views(b)}
        self.owned: dict[int, torch.Tensor] = {}  # id(param) -> reduced grad of the owned region
        self.require_sync = True
        self._callback_queued = False
        self._handles: list = []
        self.schedule = ReductionSchedule(
            self._launch_bucket, self._complete, pending_bound(self._all_reduce_of_views())
        )
        self.schedule.start(self.buckets)  # fixed at setup: [Note: rank-agreed reduction order]
        if self.supports_late:
            comm.open_control_channel()  # collective: every rank builds the same reducer at setup
            self._late_agreement = LateFlags(comm)
        self._late: list[Bucket] = []
        self.after_backward: Callable[[], None] = lambda: None  # set by register()
        # [Note: deferred has-gradient flags] in presence.py: stages 1-2's buffered completions store what
        # needs the summed flags at the end of backward (no host stall per bucket on CUDA)
        self.deferred = DeferredStores()

    def _all_reduce_of_views(self) -> bool:
        """Every bucket all-reduced in place in its persistent buffer ([Note: pending reductions])."""
        return False

    # -- hooks --------------------------------------------------------------
    def register(self, root: nn.Module, after_backward: Callable[[], None]) -> None:
        """Hook the parameters and ``root``; ``after_backward`` (the engine's: [Note: per-step state] in
        zero_plugin/engines/engine.py) runs once at the end of each backward, after the last reduction."""
        self.after_backward = after_backward
        for slot in self.slots:
            self._handles.append(slot.param.register_post_accumulate_grad_hook(WeakHook(self._post_accumulate)))
        self._handles.append(root.register_forward_hook(self._on_root_output))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _on_root_output(self, module: nn.Module, args, output) -> None:
        # A grad hook on the output runs in the outermost backward, so the final
        # callback it queues is not consumed by a nested (reentrant checkpoint) backward.
        if not torch.is_grad_enabled():
            return
        for t in torch.utils._pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if self.require_sync:
            self._queue_final_callback()

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def _post_accumulate(self, param: torch.Tensor) -> None:
        if not self.require_sync:
            return
        self._queue_final_callback()
        bucket, index = self._where[id(param)]
        if bucket.launched:
            self._late_gradient(bucket, index)
            return
        if id(bucket) in self._viewed:
            self._adopt(bucket, index)
        bucket.ready.add(index)
        if len(bucket.ready) == len(bucket.slots):
            self.schedule.mark_ready(bucket)

    def _late_gradient(self, bucket: Bucket, index: int) -> None:
        raise RuntimeError(
            f"zero_plugin: parameter {bucket.slots[index].name!r} received a gradient after its bucket "
            "was reduced in this backward (a parameter reused across reentrant checkpoint segments?). "
            "Use non-reentrant activation checkpointing (use_reentrant=False) or stage 0/2."
        )

    # -- end of backward ----------------------------------------------------
    @torch.no_grad()
    def finish(self) -> None:
        """Issue the buckets not issued yet, in order (unused parameters count as zeros), re-reduce
        late gradients, wait, copy out."""
        self._callback_queued = False
        if self.supports_late:
            late, self._late = self._late, []
            self.schedule.end_backward(late, self._late_agreement)
        else:
            self.schedule.flush()
            self.schedule.finish()
        self.deferred.run()
        for bucket in self.buckets:
            bucket.reset()
        self.after_backward()

    def _launch_bucket(self, bucket: Bucket) -> list:
        bucket.launched = True
        with phase("reduce_bucket"):  # [Note: profiler phases]
            return [self._launch(bucket)]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self.require_sync
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = previous

    def owned_grad(self, slot: MasterParam) -> torch.Tensor | None:
        return self.owned.get(id(slot.param))

    def consume(self, slots: list[MasterParam] | None = None) -> None:
        """Let go of the reduced gradients of ``slots`` (None: all; a subset: one of several optimizers over the
        model), after their step or with zero_grad."""
        if slots is None:
            self.owned.clear()
        else:
            for slot in slots:
                self.owned.pop(id(slot.param), None)

    def zero_grad(self, set_to_none: bool = True, slots: list[MasterParam] | None = None) -> None:
        """Discard the gradients of ``slots`` (None: all; a subset: one of several optimizers over the model)."""
        self.consume(slots)
        for slot in self.slots if slots is None else slots:
            if set_to_none:
                slot.param.grad = None
            elif slot.param.grad is not None:
                slot.param.grad.zero_()

    def checked_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(inf/NaN flags already taken, gradients still to read) for the step's check: none taken here."""
        return [], [g for g in (self.owned.get(id(s.param)) for s in self.slots) if g is not None]

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every gradient tensor this reducer keeps alive (for memory accounting)."""
        return list(self.owned.values()) + self.views.tensors()

    # -- per-kind -----------------------------------------------------------
    def _keeps_views(self, bucket: Bucket) -> bool:
        """Whether ``bucket``'s gradients are views of a persistent buffer ([Note: gradients as bucket views])."""
        return False

    def _adopt(self, bucket: Bucket, index: int) -> None:
        """From the gradient hook of a viewed bucket: the gradient into its view, while it is warm in cache."""
        self.views.adopt(bucket, index)

    def _launch(self, bucket: Bucket):
        """Copy in and issue the bucket's collective; its record ([Note: collective layouts] in
        ``comm/layout.py``)."""
        raise NotImplementedError

    def _complete(self, bucket: Bucket, pending) -> None:
        """Wait for the bucket's collective and keep the averaged gradients."""
        raise NotImplementedError

    def _buffer_dtype(self, bucket: Bucket) -> torch.dtype:
        return self.reduce_dtype or bucket.slots[0].param.dtype


class AllReduceReducer(GradReducer):
    """Stage 0 (DDP): average full gradients with a bucketed all-reduce; gradients stay views of the
    buckets' buffers where the dtypes allow ([Note: gradients as bucket views] in ``views.py``)."""

    def _keeps_views(self, bucket: Bucket) -> bool:
        return self.views.applies(bucket)

    def _all_reduce_of_views(self) -> bool:
        return len(self._viewed) == len(self.buckets)

    @torch.no_grad()
    def _launch(self, bucket: Bucket) -> comm_layout.FlatAllReduce:
        if id(bucket) in self._viewed:
            buf = self.views.fill(bucket)
            return comm_layout.all_reduce_filled(self.comm, bucket.slots, buf, bucket.width)
        return comm_layout.all_reduce_flat(
            self.comm, bucket.slots, self._buffer_dtype(bucket), bucket.slots[0].param.device
        )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # [Note: finite check in the average] in comm/layout.py: id(bucket) -> (its inf/NaN flag, the version of
        # its buffer the flag describes), for viewed buckets whose last average took the answer
        self._checked: dict[int, tuple[torch.Tensor, int]] = {}

    @torch.no_grad()
    def _complete(self, bucket: Bucket, pending: comm_layout.FlatAllReduce) -> None:
        # Flags read here, not deferred: this store overwrites param.grad, so storing a late re-reduction
        # before an earlier deferred one would keep the stale value ([Note: deferred has-gradient flags]).
        with phase("reduce_bucket_wait"):
            if id(bucket) not in self._viewed:
                pending.complete("gradient reduction", self._store)
                return
            found = torch.zeros(1, dtype=torch.float32, device=pending.buffer.device)
            if pending.complete("gradient reduction", self._store_view, found):
                self._checked[id(bucket)] = (found, pending.buffer._version)
            else:
                self._checked.pop(id(bucket), None)

    def checked_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The reduced gradients split for the step's inf/NaN check: the flags the averages took for buckets
        untouched since ([Note: finite check in the average] in comm/layout.py; a write into any view bumps
        its buffer's version), and every other reduced gradient, for the check to read."""
        flags, unchecked = [], []
        for bucket in self.buckets:
            grads = [g for g in (self.owned.get(id(s.param)) for s in bucket.slots) if g is not None]
            checked = self._checked.get(id(bucket))
            if grads and checked is not None and checked[1] == self.views.buffer(bucket)._version:
                flags.append(checked[0])
            else:
                unchecked += grads
        return flags, unchecked

    def _store_view(self, slot: MasterParam, reduced: torch.Tensor) -> None:
        self.owned[id(slot.param)] = store_view(slot, reduced)

    def _store(self, slot: MasterParam, reduced: torch.Tensor) -> None:
        """The average into ``param.grad``; never called for a parameter unused on every rank, which keeps no
        gradient, so the optimizer skips it (as DDP)."""
        p = slot.param
        src = reduced.view_as(p)
        if p.grad is None:
            p.grad = src.to(p.dtype, copy=True)
        else:
            p.grad.copy_(src)
        # reduce_dtype above param_dtype: the master steps on the reduced precision, as at stages 1-3
        self.owned[id(p)] = p.grad if src.dtype == p.dtype else src


class ReduceScatterReducer(GradReducer):
    """Stages 1-2: each rank receives the average of its owned region only.

    Gradients kept in ``reduce_dtype``; [Note: reduced regions and later backwards] for stage 1.
    """

    sharded = True

    def __init__(self, *args, keep_full_grad: bool, **kwargs) -> None:
        self.supports_late = not keep_full_grad
        self.keep_full_grad = keep_full_grad
        super().__init__(*args, **kwargs)
        # stage 1, [Note: reduced regions and later backwards]: id(param) -> the param.grad a reduction of
        # this step took in; (param, that grad) set aside while a backward reduces the parameter as absent
        self._consumed: dict[int, torch.Tensor] = {}
        self._set_aside: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._batch: _BatchedStores | None = None  # while a bucket completes: [Note: stores batched per bucket]

    def register(self, root: nn.Module, after_backward: Callable[[], None]) -> None:
        super().register(root, after_backward)
        if self.keep_full_grad:
            for slot in self.slots:
                self._handles.append(slot.param.register_hook(WeakHook(self._before_accumulate, slot.param)))

    def _keeps_views(self, bucket: Bucket) -> bool:
        """[Note: gradients as bucket views] in views.py: ``reduce_scatter_keeps_views``, for a bucket the views
        apply to."""
        in_place = self.layout is comm_layout.IN_PLACE  # the one read of which layout: what it costs, not how
        return reduce_scatter_keeps_views(self.keep_full_grad, in_place) and self.views.applies(bucket)

    def _adopt(self, bucket: Bucket, index: int) -> None:
        """Stage 1: not while the view holds an average of this step (a second synced backward): the fresh
        gradient is then reduced where it is ([Note: gradients as bucket views] in views.py).  A gradient
        copied in is fresh, whatever the view held: no reduction has taken it."""
        param = bucket.slots[index].param
        if id(param) not in self.owned:
            self.views.adopt(bucket, index)
            self._consumed.pop(id(param), None)

    def _before_accumulate(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        if param.grad is not None and param.grad is self._consumed.get(id(param)):
            param.grad = None  # [Note: reduced regions and later backwards]
        return grad

    @torch.no_grad()
    def _launch(self, bucket: Bucket) -> comm_layout.InPlaceReduce | comm_layout.BufferedReduce:
        """The full gradients are let go at once (ZeRO-2: the reduction holds them until it completes), or
        kept (ZeRO-1); in place on gloo, each rank then keeps its own region ([Note: collective layouts] in ``comm/layout.py``)."""
        if self.keep_full_grad:
            self._set_aside_consumed(bucket)
        return self.layout.reduce(
            self.comm,
            bucket.slots,
            self._buffer_dtype(bucket),
            bucket.slots[0].param.device,
            release_grads=not self.keep_full_grad,
            deferred=self.deferred,  # buffered: the flags read at the end of backward; in place: a host tensor
        )

    def _set_aside_consumed(self, bucket: Bucket) -> None:
        """Stage 1: a member whose ``param.grad`` an earlier reduction of this step took in is reduced as
        absent; what is fresh is marked as taken ([Note: reduced regions and later backwards])."""
        for slot in bucket.slots:
            p = slot.param
            if p.grad is None:
                continue
            if p.grad is self._consumed.get(id(p)):
                self._set_aside[id(p)] = (p, p.grad)
                p.grad = None
            else:
                self._consumed[id(p)] = p.grad

    def finish(self) -> None:
        super().finish()
        for p, grad in self._set_aside.values():  # no rank had a new gradient: the earlier one stands
            if p.grad is None:
                p.grad = grad
        self._set_aside.clear()

    def zero_grad(self, set_to_none: bool = True, slots: list[MasterParam] | None = None) -> None:
        if slots is None:
            self._consumed.clear()
        else:
            for slot in slots:
                self._consumed.pop(id(slot.param), None)
        super().zero_grad(set_to_none, slots)

    def _free_view(self, slot: MasterParam) -> torch.Tensor | None:
        """The view of ``slot``'s bucket, where it has one (called only where it holds no average)."""
        bucket, index = self._where[id(slot.param)]
        return self.views.view(bucket, index) if id(bucket) in self._viewed else None

    def _late_gradient(self, bucket: Bucket, index: int) -> None:
        if self.keep_full_grad:
            super()._late_gradient(bucket, index)
            return
        # Stage 2: the fresh param.grad holds only the new contribution; it is reduced
        # by a second launch at the end of backward and added to the shard.
        if bucket not in self._late:
            self._late.append(bucket)

    @torch.no_grad()
    def _complete(self, bucket: Bucket, pending: comm_layout.InPlaceReduce | comm_layout.BufferedReduce) -> None:
        temporary = pending.results_in_full_tensors
        store = functools.partial(self._store, region_of_temporary=temporary)
        self._batch = _BatchedStores()  # [Note: stores batched per bucket]
        try:
            with phase("reduce_bucket_wait"):
                pending.complete("gradient reduction", store)
                self._batch.run()
        finally:
            self._batch = None

    def _store(self, slot: MasterParam, reduced: torch.Tensor, region_of_temporary: bool = False) -> None:
        """Keep this rank's averaged region: in ``param.grad`` (stage 1, same dtype), else a view of the
        bucket's output (its storage is exactly the bucket's shards) or a copy of a full-size temporary's
        region.  Copies and additions go through the bucket's batch while it completes."""
        p = slot.param
        batch = self._batch or _UNBATCHED
        previous = self.owned.get(id(p))  # an earlier reduction in this step
        if self.keep_full_grad and reduced.dtype == p.dtype:
            if p.grad is None:  # no gradient on this rank: zeros, in its view where that holds no average
                view = self._free_view(slot) if previous is None else None
                p.grad = view.zero_() if view is not None else torch.zeros_like(p)
                self._consumed[id(p)] = p.grad  # holds a reduction's result: never reduced again
            region = slot.layout.local_view(p.grad)
            if region.data_ptr() != reduced.data_ptr():  # reduced in place into p.grad: already there
                batch.copy(region, reduced)
            reduced = region
        elif region_of_temporary:
            batch.keep(self.owned, id(p), reduced, previous)  # a copy of the region, kept in ``owned``
            return
        if previous is not None and previous.data_ptr() != reduced.data_ptr():
            batch.add(reduced, previous)
        self.owned[id(p)] = reduced


# [Note: stores batched per bucket]
# A step is host-bound on a GPU (issue #39), so the per-parameter work of keeping a bucket's averages is
# batched: while a bucket completes, stage 1's copies of the averaged regions into ``param.grad``, the copies
# of regions of full-size temporaries (in place on gloo: stage 2, or stage 1 in another dtype; one ``cat``
# whose views are the kept gradients) and the additions of an earlier reduction's average (accumulation over
# synced backwards) are collected and run after the completion: the regions' ``cat`` and the
# ``_foreach_copy_`` first, then one ``_foreach_add_``, so each member's addition follows its own copy as
# before.  Nothing reads a kept gradient in between.  Stores deferred to the end of backward
# ([Note: deferred has-gradient flags] in presence.py) run one by one, as before.
class _BatchedStores:
    def __init__(self) -> None:
        self._copies: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._adds: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._keeps: list[tuple[dict, int, torch.Tensor, torch.Tensor | None]] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._copies[0].append(dst)
        self._copies[1].append(src)

    def add(self, dst: torch.Tensor, other: torch.Tensor) -> None:
        self._adds[0].append(dst)
        self._adds[1].append(other)

    def keep(self, owned: dict, key: int, region: torch.Tensor, previous: torch.Tensor | None) -> None:
        """``owned[key]`` becomes a copy of ``region`` (plus ``previous``, where there is one)."""
        self._keeps.append((owned, key, region, previous))

    def run(self) -> None:
        if self._keeps:
            flat = torch.cat([region.reshape(-1) for _, _, region, _ in self._keeps])
            kept = flat.split([region.numel() for _, _, region, _ in self._keeps])
            for (owned, key, region, previous), copy in zip(self._keeps, kept):
                owned[key] = copy = copy.view_as(region)
                if previous is not None:
                    self.add(copy, previous)
        if self._copies[0]:
            torch._foreach_copy_(*self._copies)
        if self._adds[0]:
            torch._foreach_add_(*self._adds)
        self._copies, self._adds, self._keeps = ([], []), ([], []), []


class _Unbatched:
    """Stores outside a bucket's completion (deferred ones): each op at once."""

    @staticmethod
    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    @staticmethod
    def add(dst: torch.Tensor, other: torch.Tensor) -> None:
        dst.add_(other)

    @staticmethod
    def keep(owned: dict, key: int, region: torch.Tensor, previous: torch.Tensor | None) -> None:
        copy = region.clone()
        if previous is not None:
            copy.add_(previous)
        owned[key] = copy


_UNBATCHED = _Unbatched()
