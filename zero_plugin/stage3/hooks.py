"""Stage-3 runtime: module and autograd hooks that drive each unit's transitions.

The runtime owns what spans units: the hooks (registered here, handles kept), the order recorded in each
forward and checked with the peers, prefetch, the backward gather list, the reduction schedule and the
final callback.  What one unit does at each point, and when it releases its parameters, is the unit's own
([Note: unit transitions] in ``unit.py``).

Forward:  pre_forward  -> Unit.pre_forward (unshard, waiting for a prefetch), prefetch the next units,
                          hook inputs
          post_forward -> Unit.post_forward (reshard unless backward needs it at once; not when
                          recomputing in backward), hook outputs
Backward: output grad hook (pre_backward) -> Unit.pre_backward, unshard again in the agreed backward
                                             order, prefetch the previous units
          input grad hook (post_backward) -> Unit.post_backward: the unit is ready (params without a
                                             gradient stay without); its reduce-scatter is issued when its
                                             turn in the rank-agreed order comes ([Note: rank-agreed
                                             reduction order] in ``schedule.py``); reshard once its grads
                                             were reduced
          param pre-accumulate hook -> shard-shaped gradients refused, late gradients noted
          param post-accumulate hook -> only where no input hook reports the unit's backward ([Note: one
                                        post-backward per unit]): ready when every trainable param is
          final callback (finalize_backward) -> reduce units whose turn did not come, in order,
                                                wait for every reduction, Unit.end_backward for every unit
No backward: the next forward, step or write to the shards -> forget_forward -> Unit.forget_forward for
                                                              every unit ([Note: pending forward])

Each ``[Note: ...]`` sits next to the code it explains: [Note: reductions on their own group] at
``_launch_reduce``, [Note: root unit] and [Note: last unit kept] at ``needed_first``, [Note: pending forward] at
``Phase``, [Note: one post-backward per unit] at ``_PostBackward``, [Note: backward gather order] and [Note:
units the backward passed] at ``BackwardWalk``, [Note: root entries] at ``Stage3Runtime._root_entries``.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree

from ..engines.hostmem import HeapTrim, trim_host_heap
from ..grads.schedule import ReductionSchedule
from ..tensors.weak_hook import WeakHook
from .direct_reads import DirectReads, output_embedding_backbones, watch_reads
from .param import ShardedParam, ShardedState
from .storage_pool import StoragePool
from .unit import GatherMode, TrainingState, Unit, UnitServices

__all__ = ["BackwardWalk", "Phase", "Stage3Runtime", "needed_first", "prefetch_span", "reduction_order"]

MAX_INFLIGHT_REDUCES = 2


def prefetch_span(order: list, unit, depth: int) -> list:
    """The units gathered ahead when ``unit`` is entered: the ``depth`` after it in ``order`` (the memory
    planner replays the same span)."""
    if not depth or unit not in order:
        return []
    i = order.index(unit)
    return order[i + 1 : i + 1 + depth]


# [Note: root unit]
# The root unit (index 0) holds the parameters outside every block and every leaf unit ([Note: leaf units] in
# ``policy.py``): final norm, small leftovers, tied embeddings and heads, an embedding or head below the leaf size or
# under a custom ``unit_policy``, and with ``persistence_threshold`` the small parameters of every block ([Note:
# persistent parameters]).  It is gathered for the whole forward, kept gathered after a forward with grad (backward
# needs it first) and released in the final callback; its reduction goes last.  A leaf unit (an untied
# ``embed_tokens`` or ``lm_head``) is gathered only around its own forward and backward, like a block.
#
# [Note: last unit kept]
# The last unit of the recorded forward order (an LM head) is the first one backward needs: releasing it after forward
# and gathering it again right away would only add a gather; it stays unsharded, as the root does, until its gradients
# are reduced.
def needed_first(forward_order: list, unit, root) -> bool:
    """Whether backward needs ``unit`` first, so that it stays gathered after a forward with grad: the root
    ([Note: root unit]) and the last unit of the recorded forward order ([Note: last unit kept]).  The memory
    planner replays the same rule."""
    return unit == root or (bool(forward_order) and unit == forward_order[-1])


def reduction_order(forward_order: list, units: list, root, trainable: Callable[[Any], bool]) -> list:
    """[Note: rank-agreed reduction order] in ``schedule.py`` at stage 3: the reverse of the (agreed) forward
    order, then units not run in it, the root last (its embeddings are the last gradients of a backward);
    units that train nothing have no reduction.  The memory planner replays the same order."""
    ran = [u for u in reversed(forward_order) if trainable(u) and u != root]
    rest = [u for u in units if trainable(u) and u != root and u not in ran]
    return ran + rest + ([root] if trainable(root) else [])


# [Note: pending forward]
# A forward with grad ends keeping what the backward expected next needs first: the root and the last unit stay
# gathered ([Note: root unit], [Note: last unit kept]) and, with hpZ, every unit it released keeps its secondary
# shard, a copy of that forward's weights ([Note: secondary shards] in ``secondary.py``); the backward's final
# callback lets go of it all.  A forward that gets no backward (an evaluation without ``torch.no_grad()``, a skipped
# micro-batch) would leave that behind: the step would hand 1-D shard gradients to full-size parameters,
# ``zp.load_checkpoint`` would find units gathered, and after a write to the shards the secondary shards would serve
# the old weights to every later gather.  Autograd does not say when a graph is dropped, so ``Phase`` tracks it and it
# is resolved lazily: from the end of a forward with grad (``PENDING``) to the first backward hook (``BACKWARD``) the
# kept state is the forward's; the next forward, the optimizer step and every write to the shards (a module's
# ``load_state_dict``, ``zp.load_full_state_dict``, ``zp.load_checkpoint``, the exit of ``zp.gathered_parameters``
# with a ``modifier_rank``) call ``forget_forward`` first, which releases every unit and drops its secondary shard
# (``Unit.forget_forward``): what the forward under ``torch.no_grad()`` would have left, bit for bit afterwards
# (``tests/parity/test_parity_stage3.py``, ``test_zeropp.py``).  So outside a forward a secondary shard exists only in
# ``PENDING`` and ``BACKWARD``, and never across a write to the shards.  A backward of that forward that does come
# later still runs: the root is gathered again by its output hook, the other units in the agreed backward order and an
# LM head read directly at the root's pre-backward (``_regather_direct_reads``), from the primary shards, so it
# computes on the weights as written, as plain stage 3 does; what it loses is hpZ's intra-node gathers (and two
# forwards before one backward gather the root and last unit once more).  Forgetting moves no collective: every rank
# forgets at the same point of its program.  Inside ``zp.gathered_parameters`` blocks the units a block gathered are in
# use: a forget asked for there (the step, a load) waits for the outermost block's exit (``open_block`` /
# ``close_block``), and a block with a ``modifier_rank`` forgets at its exit, since its edits are writes to the
# shards.  The root's next forward forgets at once, inside a block as outside.
class Phase(enum.Enum):
    """Whose the state kept between forwards and backwards is ([Note: pending forward])."""

    IDLE = "idle"  # nothing kept: every unit released (outside zp.gathered_parameters), no secondary shard
    PENDING = "pending"  # a forward with grad ended; what its backward needs first is kept for it
    BACKWARD = "backward"  # a backward reached the hooks; its final callback returns to IDLE


_PHASES = {
    Phase.IDLE: {Phase.PENDING, Phase.BACKWARD},
    Phase.PENDING: {Phase.IDLE, Phase.BACKWARD},
    Phase.BACKWARD: {Phase.IDLE},
}


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# [Note: one post-backward per unit]
# A unit's backward is reported once, by the identity ``_PostBackward`` on its inputs (FSDP2's
# ``RegisterPostBackwardFunction``): autograd runs it after the unit's own backward ops, and every ``AccumulateGrad``
# ready by then runs before it (the engine runs ready nodes highest sequence number first, and accumulators carry the
# highest), so the unit's gradients are in ``param.grad`` when it becomes ready.  A gradient that comes later anyway
# (a parameter also used outside the unit inside ``zp.gathered_parameters``, a unit entered twice) reaches the
# parameter's pre-accumulate hook after the reduction launched and is a late one, re-reduced in the final callback;
# one before the launch is sent with the rest.  So trainable parameters carry one hook each, the pre-accumulate one
# ([Note: uses outside the unit] in ``param.py``; it also queues the final callback and notes late gradients), not a
# post-accumulate hook as well (issue #39: two hooks per parameter were most of the Python run per backward).
# Post-accumulate hooks remain where nothing else tells when the unit's gradients are final: on the root (its inputs
# are the user's), on a unit whose forward had no input that needs a gradient (an embedding, the first block under
# frozen embeddings) -- registered at that forward and removed at the end of its backward (or when it is forgotten,
# [Note: pending forward]) -- and, for one accumulation, on a parameter lent the full shape.  Such a unit is ready
# when all its trainable parameters have their gradients, as before; a unit whose hooked inputs get no gradient (its
# output does not depend on them) is ready at the end of backward.
class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward signals that the unit's backward is done."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


# [Note: backward gather order]
# Backward reaches a unit only where its output got a gradient, so a rank that ignored a block's output (legal, as
# under DDP) would skip that block's gather while its peers gather it, and the gathers would pair across units.  So
# backward gathers follow one list every rank agreed on at the end of the forward: the reverse forward order,
# restricted to the units whose outputs needed a gradient on any rank.  Before gathering a unit every unit before it
# in that list is gathered too (at the end of backward, every unit left), and stays gathered until the end of backward
# if this rank never reaches it (its reduction then carries zeros); prefetches follow the same list.  Gathers in that
# list need no order check; a unit gathered again in the same backward (entered twice) is checked.  In the usual case
# backward arrives in list order and nothing extra happens.
#
# [Note: units the backward passed]
# A unit whose outputs this rank computed but did not use (DDP allows it) gets no backward here, so its reduction
# would wait for the end of backward while its peers' goes out in its turn ([Note: rank-agreed reduction order] in
# grads/schedule.py).  The peers then block on it once MAX_INFLIGHT_REDUCES more are in flight, before issuing the
# backward gathers this rank waits for: a deadlock (found by the fuzzer: the last of four blocks discarded on one of
# two ranks).  So when a unit's backward starts, every unit before it in the reduction order that this backward never
# reached (IDLE) is ready now, its missing gradients zeros, as at the end of backward; and a rank whose backward
# reached none of them (it used no block's output, seed 271828) issues them in the same steps while it gathers what
# its peers gathered (``gather_the_rest``).  Gathers and these reductions interleave as on a peer whose backward
# reached every unit: ``catch_up`` walks the agreed backward list up to the unit, gathering each skipped unit after
# the units passed before it are ready (marking three passed units ready at once and gathering them only then blocked
# this rank on the first reduction, which its peer issues after a gather this rank had not issued: seeds 77777 and
# 300301).  In a chain of blocks nothing reaches it later; where something does (a block reused further back in the
# forward), its gradient is a late one, reduced again at the end of backward and added, so the result is the same.
# The root's pre-backward opens the backward: excluded.
class BackwardWalk:
    """One backward's walk of the agreed backward list ([Note: backward gather order]) and of the units in the
    reduction order it passed ([Note: units the backward passed]).  Built at the end of each forward with grad
    from that list, and again for the next backward of the same forward after the final callback."""

    def __init__(self, order: list[Unit], schedule: ReductionSchedule) -> None:
        self.order = order  # the agreed backward list; prefetches in backward follow it too
        self.schedule = schedule
        self._cursor = 0  # order[:cursor] were gathered in this backward
        self._passed = 0  # schedule.order[:passed] were looked at ([Note: units the backward passed])

    def restarted(self) -> BackwardWalk:
        """The same list walked from its start: the next backward of the same forward (``retain_graph``)."""
        return BackwardWalk(self.order, self.schedule)

    def catch_up(self, unit: Unit) -> None:
        """Gather ``unit`` for its backward, after walking the agreed backward list up to it as the peers
        walked it: each unit this backward skipped is gathered, and the units passed before it are ready,
        in the same steps as on a rank whose backward reached every one of them ([Note: units the backward
        passed])."""
        if unit in self.order[self._cursor :]:
            self._walk_to(self.order.index(unit))
        self._reduce_units_passed(unit)
        self.gather(unit)

    def gather_the_rest(self) -> None:
        """End of backward: the units of the agreed backward list this rank's backward did not reach are
        gathered as its peers gathered them, each after the reductions its peers issued before that gather
        ([Note: units the backward passed]: a rank that used none of them must not hold its reductions back
        behind these gathers while its peers wait for the reductions)."""
        self._walk_to(len(self.order))
        self.gather(None)

    def gather(self, unit: Unit | None) -> None:
        """Gather ``unit`` and every unit before it in the agreed backward list (``None``: the end of
        backward, every unit left): [Note: backward gather order]."""
        order = self.order
        position = len(order) if unit is None else order.index(unit) if unit in order else -1
        if position < self._cursor:  # outside the list, or a second gather in this backward
            if unit is not None and unit.backward_reads_weights:  # [Note: weights unread in backward]
                unit.ensure_unsharded()
            return
        for listed in order[self._cursor : position + 1]:
            listed.ensure_unsharded(GatherMode.AGREED)
        self._cursor = position + 1

    def _walk_to(self, stop: int) -> None:
        """The agreed backward list from the cursor up to ``stop``: each unit after the reductions of the units
        passed before it, as a peer whose backward reached every one of them issues them."""
        for listed in self.order[self._cursor : stop]:
            self._reduce_units_passed(listed)
            self.gather(listed)

    def _reduce_units_passed(self, unit: Unit) -> None:
        order = self.schedule.order
        position = self.schedule.position(unit)
        if position is None:  # a unit that trains nothing: not in the order, says nothing about the others
            return
        for earlier in order[self._passed : position]:
            if earlier.training_state is TrainingState.IDLE and not earlier.reduce_launched:
                self.schedule.mark_ready(earlier)
        self._passed = max(self._passed, position)


class Stage3Runtime:
    """The hooks of one stage-3 engine and the lifecycle they share: ``phase`` ([Note: pending forward]), the
    ``zp.gathered_parameters`` blocks open, the recorded forward order, the backward's walk and the reduction
    schedule.  Read top to bottom: registration, forward, the lifecycle between forward and backward,
    backward, reductions, the final callback."""

    def __init__(
        self,
        units: list[Unit],
        services: UnitServices,
        prefetch_depth: int,
        reshard_after_forward: bool,
        trim_heap: HeapTrim = HeapTrim.OFF,
        storage_pool: StoragePool | None = None,
        after_backward: Callable[[], None] = lambda: None,
    ) -> None:
        """``services``: what the units share ([Note: unit record] in unit.py), the runtime's too;
        ``storage_pool``: the units' lent storage ([Note: lent storage] in storage_pool.py), None where storage
        is resized; ``after_backward``: the engine's, run by the final callback ([Note: per-step state] in
        engine.py)."""
        self.units = units
        self.trim_heap = trim_heap  # [Note: heap trimming] in hostmem.py (CPU only)
        self.root = units[0]
        self.prefetch_depth = prefetch_depth
        self.reshard_after_forward = reshard_after_forward
        self.forward_order: list[Unit] = []
        self._recording: list[Unit] = []
        self.guard = services.guard  # [Note: collective order]
        # [Note: deferred host reads] in comm/host_reads.py: gather tags and has-gradient flags read on the
        # host once per forward / backward, not after every collective
        self.tag_checks = services.tag_checks
        self.deferred = services.deferred
        self.schedule = ReductionSchedule(self._launch_reduce, self._complete_reduce, MAX_INFLIGHT_REDUCES)
        self.schedule.start(self._reduce_order())
        self.walk = BackwardWalk([], self.schedule)  # [Note: backward gather order]
        self._outputs_need_grad: set[Unit] = set()
        self._late: list[Unit] = []
        self.after_backward = after_backward
        self._callback_queued = False
        self.phase = Phase.IDLE  # [Note: pending forward]
        self._open_blocks = 0  # zp.gathered_parameters blocks open: forgetting waits ([Note: pending forward])
        self._forget_at_exit = False  # a forget asked for inside them, done at the outermost exit
        self.require_sync = True  # False inside zp.no_sync
        # [Note: deferred reduction] in accumulate.py: under no_sync, full gradients kept instead of reduced
        self.kept = services.kept
        self._root_depth = 0
        self.direct_reads = DirectReads()  # [Note: direct reads of the output embedding] in direct_reads.py
        self._armed: Unit | None = None  # a sliced head whose backbone returned, read whole if read directly
        self._held_for_read: list[Unit] = []  # [Note: reads after a forward without grad] in direct_reads.py
        self._handles: list = []
        self._param_hooks: dict[Unit, list] = {}  # [Note: one post-backward per unit]: until the backward ends
        self.storage_pool = storage_pool

    # -- registration -----------------------------------------------------------
    def register(self) -> None:
        for m in self._root_entries():
            self._handles.append(m.register_forward_pre_hook(self._root_pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._root_post, always_call=True))
        for unit in self.units:
            m = unit.module
            if unit is not self.root:
                self._handles.append(
                    m.register_forward_pre_hook(functools.partial(self.pre_forward, unit), with_kwargs=True)
                )
                self._handles.append(m.register_forward_hook(functools.partial(self.post_forward, unit)))
            for sp in unit.trainable:
                self._handles.append(sp.param.register_hook(WeakHook(self.pre_accumulate, unit, sp)))
        self._hook_params(self.root, self._handles)  # [Note: one post-backward per unit]
        self._register_direct_reads()

    def _hook_params(self, unit: Unit, handles: list) -> None:
        """Post-accumulate hooks on ``unit``'s trainable parameters: the unit is ready once all of them have
        their gradients ([Note: one post-backward per unit])."""
        for sp in unit.trainable:
            handles.append(sp.param.register_post_accumulate_grad_hook(WeakHook(self.post_accumulate, unit, sp)))

    def _hook_params_for_this_forward(self, unit: Unit) -> None:
        """[Note: one post-backward per unit]: nothing reports when this forward's backward of ``unit`` ran."""
        if unit is not self.root and unit not in self._param_hooks:
            self._hook_params(unit, self._param_hooks.setdefault(unit, []))

    def _unhook_params(self) -> None:
        for handles in self._param_hooks.values():
            for h in handles:
                h.remove()
        self._param_hooks.clear()

    def _register_direct_reads(self) -> None:
        """[Note: direct reads of the output embedding] in direct_reads.py: the backbone's end enters the head."""
        for backbone, unit in output_embedding_backbones(self.root.module, self.units):
            self._handles.append(backbone.register_forward_hook(functools.partial(self.pre_direct_read, unit)))
            if unit.gathers_on_read:
                self._handles.append(watch_reads(unit.module, functools.partial(self._read_armed, unit)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._unhook_params()

    # -- root entry points ----------------------------------------------------------
    # [Note: root entries]
    # The root's hooks sit on the set-up module, plus every inner module a caller may enter directly (transformers
    # models with ``generate``: a PEFT or Lightning wrapper's ``generate`` calls the inner model's forward,
    # bypassing the wrapper's hooks).  Nested entries count once (``_root_depth``).
    def _root_entries(self) -> list:
        """The modules the root's hooks sit on ([Note: root entries])."""
        top = self.root.module
        return [top] + [m for m in top.modules() if m is not top and callable(getattr(m, "generate", None))]

    def _root_pre(self, module, args, kwargs):
        self._root_depth += 1
        if self._root_depth == 1:
            self._release_held_for_read()
            return self.pre_forward(self.root, module, args, kwargs)
        self.root.ensure_unsharded()  # a nested entry: the root is gathered already
        return args, kwargs

    def _root_post(self, module, args, output):
        self._root_depth = max(0, self._root_depth - 1)
        if self._root_depth == 0:
            if torch.is_grad_enabled():  # [Note: reads after a forward without grad] in direct_reads.py
                self._armed = None
            return self.post_forward(self.root, module, args, output)
        if torch.is_grad_enabled():
            self._hook_outputs(self.root, output)
        return None

    # -- forward ------------------------------------------------------------------
    def pre_forward(self, unit: Unit, module, args, kwargs, hook_inputs: bool = True):
        in_backward = _in_backward()
        if unit is self._armed:
            self._armed = None  # its own forward came: computed as usual ([Note: direct reads of the output embedding])
        if not in_backward:
            if unit is self.root:
                self._forget_pending_forward()  # [Note: pending forward]: the last forward got no backward
                self.tag_checks.flush()  # the last forward's gathers: landed long ago, no wait in practice
                self._recording = self.guard.recording = []
                self._outputs_need_grad = set()
            elif unit not in self._recording:
                self._recording.append(unit)
            if unit.holds_gathered:
                self.guard.entered(unit)  # [Note: collective order]: checked at the next entry
            else:
                self.guard.settle()
        if self.trim_heap is HeapTrim.EACH_UNIT:  # [Note: eager trimming when memory is tight] in hostmem.py
            trim_host_heap()
        unit.pre_forward()
        if not in_backward:
            self._prefetch(unit, +1)
        if hook_inputs and unit is not self.root and torch.is_grad_enabled():
            args, kwargs, hooked = self._hook_inputs(unit, args, kwargs)
            if not hooked:
                self._hook_params_for_this_forward(unit)
        return args, kwargs

    def pre_direct_read(self, unit: Unit, module, args, output):
        """The backbone feeding the output embedding ``unit`` returned: the head is entered as if its forward
        began, for a loss that reads its weight directly ([Note: direct reads of the output embedding])."""
        if _in_backward():
            return None  # the backbone recomputed (activation checkpointing): the head is gathered still
        if unit.gathers_on_read:
            self._armed = unit  # gathered whole at the read, if one comes before the head's own forward
        else:
            self.pre_forward(unit, module, (), {}, hook_inputs=False)
        if not torch.is_grad_enabled():
            if not unit.gathers_on_read:
                self._held_for_read.append(unit)  # [Note: reads after a forward without grad] in direct_reads.py
            return output
        self.direct_reads.open(unit)
        (output,), _, hooked = self._hook_inputs(unit, (output,), {}, functools.partial(self._direct_read_done, unit))
        if not hooked:
            self._hook_params_for_this_forward(unit)
        return output

    def _read_armed(self, unit: Unit) -> None:
        """The weight of a sliced head was read after its backbone's forward and before its own."""
        if self._armed is unit:
            self._armed = None
            if self._root_depth == 0:  # after a forward without grad: held until the next entry
                unit.pre_direct_read()
                self._held_for_read.append(unit)
                return
            self.pre_forward(unit, unit.module, (), {}, hook_inputs=False)
            unit.pre_direct_read()

    def _direct_read_done(self, unit: Unit) -> None:
        if self.direct_reads.close(unit):
            self.post_backward(unit)

    def post_forward(self, unit: Unit, module, args, output):
        grad = torch.is_grad_enabled()
        if grad:
            self._hook_outputs(unit, output)
        if _in_backward():
            return None  # recomputation (activation checkpointing): backward needs the unit
        if unit is self.root:
            self.forward_order = list(self._recording)
            if grad:  # the reverse of this order is the order of the reductions: every rank must agree
                needed = self.guard.end_of_forward(self.forward_order, self._outputs_need_grad)
                self.schedule.start(self._reduce_order())
                self.walk = BackwardWalk(
                    [u for u in reversed(self.forward_order) if u in needed and u.backward_reads_weights],
                    self.schedule,
                )  # [Note: weights unread in backward] in policy.py: not gathered for backward
            else:
                self.guard.settle()  # [Note: collective order]: every entry of this forward compared
            for other in self.units[1:]:
                if other.holds_gathered and other not in self._held_for_read:
                    other.post_forward(grad, self.reshard_after_forward, self._needed_first(other))
            self.root.post_forward(grad, self.reshard_after_forward, self._needed_first(self.root))
            self._end_forward(grad)
            if self.storage_pool is not None:  # the released units' memory: back to the allocator before the trim
                self.storage_pool.clear()
            if self.trim_heap is not HeapTrim.OFF:  # at least once per forward: [Note: heap trimming] in hostmem.py
                trim_host_heap()
        else:
            unit.post_forward(grad, self.reshard_after_forward, self._needed_first(unit))
        return None

    def _needed_first(self, unit: Unit) -> bool:
        return needed_first(self.forward_order, unit, self.root) or self.direct_reads.is_open(unit)

    def _hook_inputs(self, unit: Unit, args, kwargs, done: Callable[[], None] | None = None):
        """Wrap the inputs that need grad in ``_PostBackward``, whose backward calls ``done`` (default: the unit's
        post-backward); and whether any did."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        picks = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not picks:
            return args, kwargs, False
        done = done or functools.partial(self.post_backward, unit)
        outs = _PostBackward.apply(done, *[leaves[i] for i in picks])
        for i, t in zip(picks, outs):
            leaves[i] = t
        unit.hooked_inputs()
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return args, kwargs, True

    def _hook_outputs(self, unit: Unit, output) -> None:
        for t in pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(functools.partial(self._on_output_grad, unit))
                self._outputs_need_grad.add(unit)

    # -- between forward and backward ([Note: pending forward]) -------------------------
    def _end_forward(self, grad: bool) -> None:
        """[Note: pending forward]: a forward with grad keeps state for its backward.  Only from IDLE (the
        forward began by forgetting any earlier one); in BACKWARD a backward ran inside this forward or the
        last one never reached its final callback (autograd drops it when a backward raises), and the state
        stays that backward's."""
        if grad and self.phase is Phase.IDLE:
            self._to_phase(Phase.PENDING)

    def forget_forward(self) -> None:
        """Before the step or a write to the shards ([Note: pending forward]); inside ``zp.gathered_parameters``
        blocks, at the outermost exit instead: the blocks' units are in use."""
        if self._open_blocks:
            self._forget_at_exit = True
            return
        self._forget_at_exit = False
        self._forget_pending_forward()

    @property
    def open_blocks(self) -> int:
        """The ``zp.gathered_parameters`` blocks open now."""
        return self._open_blocks

    def open_block(self) -> None:
        """A ``zp.gathered_parameters`` block opened: forgetting waits for the outermost exit."""
        self._open_blocks += 1

    def close_block(self, wrote: bool) -> None:
        """A block's exit, after it resharded what it gathered; ``wrote``: it had a ``modifier_rank``, so its
        edits are writes to the shards ([Note: pending forward])."""
        assert self._open_blocks > 0, "stage-3 runtime: a zp.gathered_parameters block closed that was not open"
        self._open_blocks -= 1
        if wrote or self._forget_at_exit:
            self.forget_forward()

    def _forget_pending_forward(self) -> None:
        """[Note: pending forward]: the last forward with grad got no backward before this point (the next
        forward, the step, a write to the shards); release what it kept, as a forward under no_grad would
        have.  Nothing to do in IDLE, and nothing may be let go during a backward."""
        self._release_held_for_read()
        if self.phase is not Phase.PENDING:
            return
        for unit in self.units:
            unit.forget_forward()
        self._unhook_params()
        self._to_phase(Phase.IDLE)

    def _release_held_for_read(self) -> None:
        """[Note: reads after a forward without grad] in direct_reads.py: the next entry, step or write ends
        the read; local (no collective), every rank alike."""
        self._armed = None
        held, self._held_for_read = self._held_for_read, []
        for unit in held:
            unit.reshard()

    def _to_phase(self, phase: Phase) -> None:
        assert phase in _PHASES[self.phase], f"stage-3 runtime: {self.phase.value} -> {phase.value} is not a transition"
        self.phase = phase

    # -- backward -----------------------------------------------------------------
    def _on_output_grad(self, unit: Unit, grad: torch.Tensor) -> None:
        self.pre_backward(unit)

    def pre_backward(self, unit: Unit) -> None:
        self._queue_final_callback()
        if self.trim_heap is HeapTrim.EACH_UNIT:  # [Note: eager trimming when memory is tight] in hostmem.py
            trim_host_heap()
        unit.pre_backward()
        if unit is self.root:
            self._regather_direct_reads()
            self.walk.gather(unit)
        else:
            self.walk.catch_up(unit)
        self._prefetch(unit, -1)

    def _regather_direct_reads(self) -> None:
        """A head with an open direct read was kept gathered into backward; if its forward was forgotten
        since (a write to the shards before this backward: [Note: pending forward]), the read's backward
        needs it again.  Gathered at the root's pre-backward, before any kernel's backward runs; otherwise a
        no-op ([Note: direct reads of the output embedding] in direct_reads.py)."""
        for unit in self.units:
            if self.direct_reads.is_open(unit):
                unit.ensure_unsharded()

    def pre_accumulate(self, unit: Unit, sp: ShardedParam, grad: torch.Tensor) -> None:
        """[Note: uses outside the unit]: a gradient of the shard's shape came from a use of the shard."""
        if tuple(grad.shape) != sp.shape:
            raise RuntimeError(
                f"zero_plugin: stage-3 parameter {sp.name!r} (shape {list(sp.shape)}) was used outside the forward "
                f"of its unit {unit.name!r}, where it holds only this rank's 1-D shard (its gradient has shape "
                f"{list(grad.shape)}); wrap that use in `with zp.gathered_parameters([param], model=model):` to "
                f"compute on the full parameter"
            )
        self._queue_final_callback()
        if sp.state is ShardedState.SHARDED:  # gathered_parameters after the unit resharded; an unread weight
            sp.lend_full_shape()
            if not self._reports_accumulation(unit):
                self._after_this_accumulation(unit, sp)
        elif unit.reduce_launched and unit not in self._late:  # a second gradient for a param in one backward
            self._late.append(unit)

    def _reports_accumulation(self, unit: Unit) -> bool:
        """Whether post-accumulate hooks sit on ``unit``'s parameters already (the root's, and this forward's on a
        unit whose inputs could not be hooked: [Note: one post-backward per unit]): they end a lent shape and
        count the gradient; a second hook for the same accumulation would report it again, after the first had
        launched the reduction as a late gradient, re-reduced at the end of backward for nothing."""
        return unit is self.root or unit in self._param_hooks

    def _after_this_accumulation(self, unit: Unit, sp: ShardedParam) -> None:
        """A post-accumulate hook for the accumulation about to run, removed once it ran: the lent shape
        back, and the gradient counted as a late one or towards the unit's readiness."""
        handle = None

        def once(param: torch.Tensor) -> None:
            handle.remove()
            self.post_accumulate(unit, sp, param)

        handle = sp.param.register_post_accumulate_grad_hook(once)

    def post_accumulate(self, unit: Unit, sp: ShardedParam, param: torch.Tensor) -> None:
        sp.end_lend()
        self._queue_final_callback()
        if unit.reduce_launched:
            if unit not in self._late:  # a second gradient for a param in one backward
                self._late.append(unit)
        elif unit.mark_ready(param):
            self.schedule.mark_ready(unit)

    def post_backward(self, unit: Unit) -> None:
        self._queue_final_callback()  # a backward that reached no output hook and no parameter hook
        if unit.post_backward():
            self.schedule.mark_ready(unit)

    # -- reductions ----------------------------------------------------------------
    def _reduce_order(self) -> list[Unit]:
        return reduction_order(self.forward_order, self.units, self.root, lambda u: u.trainable)

    # [Note: reductions on their own group]
    # Backward issues gathers (where outputs got gradients) and reductions (in the rank-agreed order, [Note:
    # rank-agreed reduction order]); each sequence is the same on every rank, but when ranks use parameters
    # unevenly a reduction waits for its turn longer on one rank than on another, so the two sequences interleave
    # differently.  Collectives on one group pair up by position, so stage 3 reduces on a second group of the same
    # ranks (``Comm.sibling``), and each group sees one agreed sequence.
    def _launch_reduce(self, unit: Unit) -> list:
        if self.kept is not None and not self.require_sync:
            return self.kept.defer(unit)
        return unit.launch_reduce()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """``zp.no_sync``: with kept gradients, reductions are deferred to the next synced backward; without,
        every backward still reduce-scatters into the shard gradients (the sum is the same)."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    @staticmethod
    def _complete_reduce(unit: Unit, pending) -> None:
        unit.complete_reduce(pending)

    # -- the final callback --------------------------------------------------------
    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self._to_phase(Phase.BACKWARD)  # [Note: pending forward]: the kept state is this backward's now
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize_backward)

    @torch.no_grad()
    def finalize_backward(self) -> None:
        self._callback_queued = False
        self.walk.gather_the_rest()
        late, self._late = self._late, []
        self.schedule.end_backward(late, self.guard)
        self.tag_checks.flush()  # before any gradient is final: [Note: gather tag] in unit.py
        self.deferred.run()  # [Note: deferred has-gradient flags] in grads/presence.py
        self.after_backward()
        self.walk = self.walk.restarted()
        self.direct_reads.clear()
        for unit in self.units:
            unit.end_backward()
        self._unhook_params()
        self._to_phase(Phase.IDLE)

    def drain(self) -> None:
        self.schedule.drain()

    # -- helpers ------------------------------------------------------------------
    def _prefetch(self, unit: Unit, direction: int) -> None:
        """The next units in the forward order, or in backward in the agreed backward list ([Note: backward
        gather order])."""
        order = self.forward_order if direction > 0 else self.walk.order
        for nxt in prefetch_span(order, unit, self.prefetch_depth):
            nxt.prefetch()
