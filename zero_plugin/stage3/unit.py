"""A stage-3 unit: parameters gathered, released and reduced together.

Pipelines (one collective per dtype present in the unit), in the layouts of [Note: collective layouts]
in ``zero_plugin/comm/layout.py``:
  unshard:      copy_in (local shards) -> all_gather (async) -> [wait] -> copy_out (to_unsharded)
  reduce_grads: copy_in (full grads, padded) -> reduce_scatter (async) -> [wait] -> accumulate shard grads
In the buffered layout each copy is one op per unit and dtype, not one per parameter (issue #39: on a GPU
the step is host-bound, so ops per step are step time): the gather's copy-in one ``_foreach_copy_``
(``ShardedParam.copy_locals_into``), its copy-out one ``split_with_sizes_copy`` into the full tensors
(``ShardedParam.all_to_unsharded``), the reduction's copy-in one ``_chunk_cat`` with the has-gradient flags
(``comm/layout.py``), as FSDP2 does.
In the buffered layout (NCCL) each pipeline runs on a side stream ([Note: side streams] in
``zero_plugin/comm/streams.py``); the compute stream waits for it only before the result is used, and buffers
go back to the pool (and full gradients are let go) only after that wait.

[Note: unit record]
A unit is built complete from one frozen ``UnitSpec`` (what this unit is: its index, module, parameters,
groups, reduce dtype and ZeRO++ switches, made by the engine in one place, ``engine.unit_specs``) and the
``UnitServices`` every unit of one engine shares (the order guard, the gather-tag checks, the deferred
stores, the buffer pool, the side streams and, with ``accumulate_full_grads``, the kept full gradients),
made by the engine before the units and handed to the runtime too.  Nothing outside this module assigns a
unit's attributes afterwards; the one knob that changes between steps has a named setter
(``set_streams``).  A gather says what it is with one ``GatherMode``: on demand (checked with the peers
first), in an order the ranks agreed already, a prefetch (not waited for), or exact (the shards' own
values, never qwZ-quantized nor from hpZ's secondary shard).  Which collective layout a gather or a
reduction uses is the ``Layout`` of its ``Comm`` ([Note: collective layouts] in ``comm/layout.py``),
read once here; the unit completes every record the same way.

[Note: reduced rows kept]
In the buffered layout a reduction's output row (this rank's averaged chunks, then the flags) is allocated
fresh by the unit on the compute stream (``Layout.kept_row``) instead of taken from the pool, and the
shard gradients become views of it (``ShardedParam.keep_reduced``): no copy-out per parameter.  Where the
shards are stored in another dtype than the reduction's (fp32 masters of a bf16 reduction) the averaged
row is cast once into a fresh row of that dtype first (``BufferedReduce.results_dtype``).  Not with qgZ
(its sum is not a row of ours) nor for shards on the host (``offload_params``): there each result is
added into the shard gradient (``accumulate_grad``).

[Note: unit transitions]
The runtime's hooks (``hooks.py``) tell a unit where the step is; the unit decides what that means for it:
  * ``pre_forward``: gathered (waiting for a prefetch in flight);
  * ``post_forward``: released, unless a backward follows and either ``reshard_after_forward`` is off or
    backward needs the unit first (the last unit of the forward, [Note: last unit kept] in ``hooks.py``;
    the root, [Note: root unit]);
  * ``pre_backward`` (an output got its gradient): IDLE -> PRE_BACKWARD;
  * ``post_backward`` (its backward ran, the inputs' gradients were computed): -> POST_BACKWARD; released
    at once if its reduction was launched already (or it trains nothing), else ready for its reduction,
    whose launch (``launch_reduce``) releases it; before its backward ran it stays gathered, except
    where no post-backward hook sits on its inputs (nothing would report that backward ran);
  * ``end_backward`` (the final callback): released, back to IDLE;
  * ``forget_forward`` (no backward came for the last forward before the next use: [Note: pending forward]
    in ``hooks.py``): released, hpZ's secondary shard dropped, as after a forward under ``torch.no_grad()``.
``TrainingState`` moves only forward within one backward (``_LEGAL``, asserted); a unit entered twice in
one forward sees ``pre_backward`` and ``post_backward`` twice, which leave a later state as it is.  The
reduction has a state of its own, ``ReduceState`` (``_REDUCE_LEGAL``, asserted), since its turn in the
rank-agreed order can come while the unit is still IDLE or PRE_BACKWARD (its gradients were final before
its backward ended; a unit the backward passed, [Note: units the backward passed] in ``hooks.py``; the end
of backward): PENDING -> LAUNCHED (``launch_reduce``, again for late gradients) or DEFERRED
(``defer_reduce``, under ``zp.no_sync`` with kept gradients); ``end_backward`` returns both to IDLE and
PENDING.  The root unit is never released by a reduction: only in the final callback.

[Note: flat shards]
In the buffered layout a unit's shards of one compute dtype live side by side in one tensor laid out as
that dtype's all-gather input: each parameter's padded chunk at its packed offset (``local`` is a view of
its valid part; the padding stays zero) and the unit's tag last.  A gather then sends that tensor as it is:
no copy-in, one op less per gather than FSDP2's (issue #39), and no pool buffer for the input.  Only where
the shards are stored in the compute dtype on the compute device: a shard kept in a wider master dtype
(mixed precision) or on the host (``offload_params``) is cast or copied in at each gather as before.
Everything that writes a shard (the optimizer step, loads, gathered edits) writes ``local`` in place, so
the view stays the shard.

[Note: gather tag]
In the buffered layout every all-gather also carries its unit's index (``GATHER_TAG`` trailing elements per
rank), a second line of defence behind [Note: collective order] (``order.py``) that costs nothing extra on
the wire: a rank that receives another unit's index raises before any gradient computed on mixed weights
is final.  The tags are read on the host without stalling it (``tag_check.py``, [Note: deferred host
reads] in ``comm/host_reads.py``): on the CPU at once, on CUDA when their copy lands, at the latest at the
end of backward.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch
from torch import nn

from ..comm import layout as comm_layout
from ..comm import quantized
from ..comm.collectives import Comm
from ..comm.streams import StreamSet
from ..grads.presence import DeferredStores
from ..tensors.phases import phase
from .accumulate import FullGradStore
from .order import OrderGuard
from .param import ShardedParam, ShardedState
from .pool import BufferPool
from .secondary import SecondaryShard
from .tag_check import TagChecks, tag_of

__all__ = [
    "GatherMode",
    "ReduceState",
    "TrainingState",
    "Unit",
    "UnitServices",
    "UnitSpec",
    "released_after_forward",
    "released_at_reduce",
]

GATHER_TAG = 2  # elements appended to each rank's all-gather input: the unit's index ([Note: gather tag])


def released_after_forward(grad: bool, reshard_after_forward: bool, needed_first: bool) -> bool:
    """Whether a unit is released at the end of its forward ([Note: unit transitions]); ``needed_first``:
    backward needs it first (``hooks.needed_first``).  The memory planner replays the same rule."""
    return not (grad and (not reshard_after_forward or needed_first))


def released_at_reduce(is_root: bool, backward_ran: bool, inputs_hooked: bool) -> bool:
    """Whether launching a unit's reduction releases it: not the root (the final callback does), and only
    once its backward ran or where nothing reports that it ran ([Note: unit transitions])."""
    return not is_root and (backward_ran or not inputs_hooked)


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitSpec:
    """What one unit is ([Note: unit record]); built by the engine (``engine.unit_specs``)."""

    index: int
    """Position in the engine's unit list, and the unit's gather tag; 0 is the root ([Note: root unit] in
    ``hooks.py``)."""
    name: str
    """The module's qualified name (errors, collective tags)."""
    module: nn.Module
    """The module whose forward gathers the unit."""
    params: list[ShardedParam]
    """The parameters the unit owns (``policy.assign_units``), in the model's order."""
    comm: Comm
    """The group the unit's gathers run on."""
    reduce_comm: Comm
    """The group its reductions run on: a sibling of ``comm`` ([Note: reductions on their own group] in
    ``hooks.py``)."""
    reduce_dtype: torch.dtype | None
    """``ZeroConfig.effective_reduce_dtype``; None: each parameter's compute dtype."""
    weight_block: int | None = None
    """qwZ: int8 block size of the gathers ([Note: qwZ gather] in ``comm/quantized.py``); None: off."""
    grad_block: int | None = None
    """qgZ: int8 block size of the reductions ([Note: qgZ reduction] in ``comm/quantized.py``); None: off."""
    secondary_comm: Comm | None = None
    """hpZ: the node's group the secondary shard is gathered over ([Note: secondary shards] in
    ``secondary.py``); None: off."""
    slice_numel: int = 0
    """Sliced units only: elements of the weight per row-slice ([Note: sliced linear units] in ``sliced.py``)."""
    backward_reads_weights: bool = True
    """False where the unit's backward computes its gradients without its weights' values (a plain
    ``nn.Embedding``): not gathered for backward ([Note: weights unread in backward] in ``policy.py``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitServices:
    """What every unit of one engine shares, made once before the units ([Note: unit record])."""

    guard: OrderGuard
    """Checks each on-demand gather with the peers first ([Note: collective order] in ``order.py``)."""
    tag_checks: TagChecks
    """[Note: gather tag] checks in flight, read on the host without stalling it."""
    deferred: DeferredStores
    """Reductions' stores that wait for the has-gradient flags ([Note: deferred has-gradient flags] in
    ``grads/presence.py``)."""
    pool: BufferPool
    """The flat blocks of the buffered layout's collectives ([Note: buffer reuse] in ``pool.py``)."""
    streams: StreamSet
    """The side streams of the buffered layout ([Note: side streams] in ``comm/streams.py``)."""
    kept: FullGradStore | None = None
    """``ZeroConfig.accumulate_full_grads``: the full gradients kept under ``zp.no_sync``, which a reduction
    sends ([Note: deferred reduction] in ``accumulate.py``); None: off."""


class GatherMode(enum.Enum):
    """How a unit is gathered ([Note: unit record]): who keeps the gather paired with the peers', whether
    the caller waits for it, and which values it moves."""

    ON_DEMAND = "on_demand"  # the ranks compare it before the payload goes out ([Note: collective order]); waited
    AGREED = "agreed"  # in an order every rank agreed already (the backward list: [Note: backward gather order])
    PREFETCH = "prefetch"  # in an agreed order, not waited for: ``wait_unshard`` / ``ensure_unsharded`` later
    EXACT = "exact"  # as ON_DEMAND, of the shards' own values, not qwZ's nor hpZ's (``zp.gathered_parameters``)

    @property
    def checked(self) -> bool:
        return self in (GatherMode.ON_DEMAND, GatherMode.EXACT)

    @property
    def waits(self) -> bool:
        return self is not GatherMode.PREFETCH


class TrainingState(enum.Enum):
    """Where this backward is for one unit ([Note: unit transitions])."""

    IDLE = "idle"  # no backward of this unit in flight
    PRE_BACKWARD = "pre_backward"  # gathered for backward, gradients pending
    POST_BACKWARD = "post_backward"  # the unit's backward ops finished (inputs' grads computed)


# [Note: unit transitions]: a backward reaches a unit's inputs without its outputs' hook where the graph
# leaves the unit through a tensor other than its outputs, hence IDLE -> POST_BACKWARD.
_LEGAL = {
    TrainingState.IDLE: {TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD},
    TrainingState.PRE_BACKWARD: {TrainingState.POST_BACKWARD},
    TrainingState.POST_BACKWARD: set(),
}


class ReduceState(enum.Enum):
    """Where this backward's reduction of one unit is ([Note: unit transitions]): apart from ``TrainingState``,
    since its turn can come before the unit's backward ran."""

    PENDING = "pending"  # its turn has not come in this backward
    LAUNCHED = "launched"  # its reduce-scatter was issued: a gradient now is a late one, reduced again
    # its turn came under zp.no_sync with kept gradients: nothing sent ([Note: deferred reduction] in accumulate.py)
    DEFERRED = "deferred"


# A late gradient's second reduction (the final callback's re-issue) repeats the first turn's kind: zp.no_sync
# holds for the whole backward.
_REDUCE_LEGAL = {
    ReduceState.PENDING: {ReduceState.LAUNCHED, ReduceState.DEFERRED},
    ReduceState.LAUNCHED: {ReduceState.LAUNCHED},
    ReduceState.DEFERRED: {ReduceState.DEFERRED},
}


class Unit:
    """A stage-3 unit, complete from its ``UnitSpec`` and the engine's ``UnitServices`` ([Note: unit record])."""

    def __init__(self, spec: UnitSpec, services: UnitServices) -> None:
        self.spec = spec
        self.trainable = [sp for sp in spec.params if sp.param.requires_grad]
        # [Note: collective layouts] in comm/layout.py: read once, per group
        self.layout = comm_layout.layout_of(spec.comm)
        self.reduce_layout = comm_layout.layout_of(spec.reduce_comm)
        self.guard = services.guard  # [Note: collective order]
        self.tag_checks = services.tag_checks  # [Note: gather tag], shared by the engine's units
        self.deferred = services.deferred  # [Note: deferred has-gradient flags] in grads/presence.py
        self.pool = services.pool  # [Note: buffer reuse]
        self.streams = services.streams  # [Note: side streams] in ``streams.py``
        # What a reduction sends for a parameter: its param.grad, or with kept gradients the engine's
        # FullGradStore.grad_of ([Note: deferred reduction] in accumulate.py)
        self.grad_of = services.kept.grad_of if services.kept is not None else _param_grad
        # ZeRO++ hpZ ([Note: secondary shards] in secondary.py); None = off
        self.secondary = SecondaryShard(spec.secondary_comm, spec.params) if spec.secondary_comm is not None else None
        self._flat = _flat_shards(spec.index, spec.params, self.layout)  # [Note: flat shards]: per compute dtype
        self.state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.reduce_state = ReduceState.PENDING
        self.ready: set[int] = set()  # id(param) of trainable params whose grad is final
        self._inputs_hooked = False  # a post-backward hook sits on this forward's inputs
        self._gather: list = []  # the gather's records in flight ([Note: collective layouts])
        self._gather_streams = self.streams  # the streams the gather in flight runs on
        self._tags: dict[torch.dtype, torch.Tensor] = {}  # [Note: gather tag] per dtype, for the buffered layout
        self._ends = _UnitEnds(self)

    # What the unit is, read from its spec: the one record of it ([Note: unit record]), not copied here.
    @property
    def index(self) -> int:
        """Position in the engine's unit list and gather tag; 0 is the root."""
        return self.spec.index

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def module(self) -> nn.Module:
        return self.spec.module

    @property
    def params(self) -> list[ShardedParam]:
        return self.spec.params

    @property
    def comm(self) -> Comm:
        return self.spec.comm

    @property
    def reduce_comm(self) -> Comm:
        """[Note: reductions on their own group] in hooks.py."""
        return self.spec.reduce_comm

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return self.spec.reduce_dtype

    @property
    def weight_block(self) -> int | None:
        """qwZ ([Note: qwZ gather] in comm/quantized.py); None = off."""
        return self.spec.weight_block

    @property
    def grad_block(self) -> int | None:
        """qgZ ([Note: qgZ reduction] in comm/quantized.py); None = off."""
        return self.spec.grad_block

    @property
    def backward_reads_weights(self) -> bool:
        """[Note: weights unread in backward] in policy.py."""
        return self.spec.backward_reads_weights

    def set_streams(self, streams: StreamSet) -> None:
        """Replace the side streams, between steps ([Note: side streams] in streams.py): tests substitute a
        recording fake, or ``NO_STREAMS`` to run everything on the compute stream."""
        self.streams = streams

    def __repr__(self) -> str:
        return f"Unit({self.index}, {self.name!r}, {self.state.value})"

    def remove(self) -> None:
        """The engine is removed: undo what the unit installed on its module (nothing here;
        ``sliced.SlicedUnit`` replaces the module's forward)."""

    @property
    def is_root(self) -> bool:
        return self.index == 0  # policy.assign_units: [Note: root unit] in hooks.py

    # -- transitions ([Note: unit transitions]) --------------------------------------
    def pre_forward(self) -> None:
        self.ensure_unsharded()

    gathers_on_read = False  # sliced units: gathered whole only when a loss reads the weight directly

    def pre_direct_read(self) -> None:
        """Entered for a read of its weights outside its forward: gathered ([Note: direct reads of the output
        embedding] in ``direct_reads.py``)."""
        self.ensure_unsharded()

    def post_forward(self, grad: bool, reshard_after_forward: bool, needed_first: bool) -> bool:
        """After a forward outside backward; ``grad``: a backward may follow, ``needed_first``: it needs
        this unit first.  True when released."""
        if not released_after_forward(grad, reshard_after_forward, needed_first):
            return False
        if grad and self.secondary is not None and self.state is ShardedState.UNSHARDED:
            self.secondary.keep()  # [Note: secondary shards]: backward gathers inside the node
        self.reshard()
        return True

    def hooked_inputs(self) -> None:
        """A post-backward hook sits on this forward's inputs: its backward will report when it ran."""
        self._inputs_hooked = True

    def pre_backward(self) -> None:
        if self.training_state is TrainingState.IDLE:
            self._to(TrainingState.PRE_BACKWARD)

    def post_backward(self) -> bool:
        """The unit's backward ran.  True when the unit is now ready for its reduction (a param still
        without a gradient gets none on this rank: zeros); released instead if there is nothing to wait
        for."""
        if self.training_state is not TrainingState.POST_BACKWARD:
            self._to(TrainingState.POST_BACKWARD)
        if self.reduce_state is not ReduceState.PENDING or not self.trainable:
            self.reshard()
            return False
        return True

    @property
    def reduce_launched(self) -> bool:
        """This backward's reduction had its turn (launched, or deferred under ``zp.no_sync``): a gradient now
        is a late one."""
        return self.reduce_state is not ReduceState.PENDING

    def launch_reduce(self) -> list:
        """The reduction's turn came (or its second one, for late gradients): launch it, and release the
        parameters unless the unit's backward may still need them."""
        assert self.trainable, f"unit {self.name!r}: a reduction of a unit that trains nothing"
        self._reduce_to(ReduceState.LAUNCHED)
        launched = self.reduce_grads()
        self._release_after_reduce()
        return launched

    def defer_reduce(self) -> list:
        """The reduction's turn under ``no_sync`` with its gradients kept instead ([Note: deferred reduction]
        in accumulate.py): as :meth:`launch_reduce`, with nothing sent."""
        self._reduce_to(ReduceState.DEFERRED)
        self._release_after_reduce()
        return []

    def _release_after_reduce(self) -> None:
        if released_at_reduce(self.is_root, self.training_state is TrainingState.POST_BACKWARD, self._inputs_hooked):
            self.reshard()

    def end_backward(self) -> None:
        """The final callback: every reduction completed; release, forget this backward."""
        self.reshard()
        if self.secondary is not None:
            self.secondary.drop()
        self.ready.clear()
        self._inputs_hooked = False
        self.training_state = TrainingState.IDLE
        self.reduce_state = ReduceState.PENDING

    def forget_forward(self) -> None:
        """The last forward's backward did not come before the next use of the weights ([Note: pending
        forward] in hooks.py): let go of what that forward kept for it.  A backward that still comes
        gathers the primary shards again, as after any release."""
        assert self.training_state is TrainingState.IDLE, (
            f"unit {self.name!r}: forward forgotten in {self.training_state.value}"
        )
        self.reshard()
        if self.secondary is not None:
            self.secondary.drop()
        # _inputs_hooked stays: the forgotten forward's graph still holds its _PostBackward, which reports
        # when a backward of it comes (TRL's KTO / DPO without ref_model: the policy's forward, the reference
        # under no_grad, then the policy's backward); cleared here, that backward released the unit at its
        # reduction, before a frozen weight's grad-input matmul ran (tests/parity/test_fused_head_reference_forward.py)

    def _to(self, state: TrainingState) -> None:
        assert state in _LEGAL[self.training_state], (
            f"unit {self.name!r}: {self.training_state.value} -> {state.value} is not a transition"
        )
        self.training_state = state

    def _reduce_to(self, state: ReduceState) -> None:
        assert state in _REDUCE_LEGAL[self.reduce_state], (
            f"unit {self.name!r}: reduction {self.reduce_state.value} -> {state.value} is not a transition"
        )
        self.reduce_state = state

    # -- gather ---------------------------------------------------------------
    @property
    def gathering(self) -> bool:
        return bool(self._gather)

    @property
    def holds_gathered(self) -> bool:
        """Unsharded, or with a gather in flight (its memory is held either way)."""
        return self.state is ShardedState.UNSHARDED or bool(self._gather)

    def ensure_unsharded(self, mode: GatherMode = GatherMode.ON_DEMAND) -> None:
        assert mode.waits, f"unit {self.name!r}: ensure_unsharded waits; prefetch() does not"
        if self.state is ShardedState.SHARDED:
            self.unshard(mode)
        elif self._gather:
            self.wait_unshard()

    def prefetch(self) -> None:
        """Start this unit's gather without waiting; the caller's order keeps it paired ([Note: collective
        order] in order.py)."""
        if self.state is ShardedState.SHARDED and not self._gather:
            self.unshard(GatherMode.PREFETCH)

    @torch.no_grad()
    def unshard(self, mode: GatherMode = GatherMode.ON_DEMAND) -> None:
        """Gather the unit as ``mode`` says ([Note: unit record]); a gather in flight is waited for unless
        ``mode`` is a prefetch."""
        if self.state is ShardedState.UNSHARDED or self._gather:
            if mode.waits:
                self.wait_unshard()
            return
        if mode.checked:  # [Note: collective order]: nothing sent before ranks agree
            self.guard.before_gather(self)
        exact = mode is GatherMode.EXACT
        self._gather_streams = self.streams
        if self.secondary is not None and self.secondary.kept and not exact:
            self._gather.extend(self.secondary.gather(self._tag(), self.name))  # [Note: secondary shards]
        elif self.weight_block is not None and not exact:
            self._gather_quantized()  # [Note: qwZ gather]
        else:
            self._gather_streams = self.layout.side_streams(self.streams)
            with self._gather_streams.gather(), phase("all_gather"):  # after the compute stream's writes (the step)
                self._gather.extend(self.layout.gather(self.comm, self.params, self._ends, self.pool, self.name))
        if mode.waits:
            self.wait_unshard()

    def _gather_quantized(self) -> None:
        with self.streams.gather():
            for dtype, group in _by_dtype(self.params, lambda sp: sp.unsharded.dtype).items():
                device = group[0].unsharded.device
                self._gather.append(
                    quantized.gather_quantized(
                        self.comm,
                        group,
                        dtype,
                        device,
                        ShardedParam.copy_local_into,
                        self.weight_block,
                        self._tag(),
                        self.name,
                    )
                )

    @torch.no_grad()
    def wait_unshard(self) -> None:
        """The gather's completion: the records' values into the parameters (``_UnitEnds``), on the gather
        stream; the compute stream waits for it before the parameters are used, and buffers return to the
        pool only after that wait ([Note: side streams] in ``streams.py``)."""
        pending, self._gather = self._gather, []
        if pending:
            streams = self._gather_streams
            with streams.gather(), phase("all_gather_copy_out"):
                for p in pending:
                    p.complete(f"all-gather of unit {self.name!r}", self._ends)
                copied = streams.record()
            streams.wait(copied)
            for p in pending:
                p.release()
        for sp in self.params:  # zero-size parameters take part in no collective
            if sp.layout.numel == 0 and sp.state is ShardedState.SHARDED:
                sp.to_unsharded(torch.empty(self.comm.world_size, 0, dtype=sp.unsharded.dtype))
        self.state = ShardedState.UNSHARDED

    def _tag(self) -> tuple[int, int]:
        return tag_of(self.index)

    def _tag_on(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The tag as a tensor kept per dtype: one copy per gather instead of a fill per value, written once
        by scalar fills (no copy from pageable host memory, [Note: deferred host reads])."""
        tag = self._tags.get(dtype)
        if tag is None or tag.device != device:
            tag = torch.empty(GATHER_TAG, dtype=dtype, device=device)
            for j, value in enumerate(self._tag()):
                tag[j] = value
            self._tags[dtype] = tag
        return tag

    def _check_tags(self, tags: torch.Tensor) -> None:
        """[Note: gather tag]: every rank's trailing elements must be this unit's index; checked without
        stalling the host (``tag_check.py``)."""
        if not self.comm.moves_data:
            return  # torch's fake process group (memory planning) moves no data
        self.tag_checks.add(self.index, self.name, tags)

    def reshard(self) -> None:
        if self._gather:
            self.wait_unshard()
        if self.state is ShardedState.SHARDED:
            return
        for sp in self.params:
            sp.to_sharded()
        self.state = ShardedState.SHARDED

    # -- gradients ------------------------------------------------------------
    def mark_ready(self, param: torch.Tensor) -> bool:
        """Record that ``param``'s gradient is final; True when every trainable param is ready."""
        self.ready.add(id(param))
        return len(self.ready) >= len(self.trainable)

    @torch.no_grad()
    def reduce_grads(self) -> list:
        """Launch the reduce-scatter of this unit's full grads (missing ones count as zeros); the full
        gradients are let go (the records hold them until the reductions complete); ``launch_reduce`` is the
        transition."""
        groups = _by_dtype(self.trainable, lambda sp: self.reduce_dtype or sp.unsharded.dtype)
        if self.grad_block is not None:  # [Note: qgZ reduction]
            with self.streams.reduce():  # after the compute stream's backward wrote the gradients
                return [self._reduce_quantized(group, dtype) for dtype, group in groups.items()]
        rows = {dtype: self._kept_row(group, dtype) for dtype, group in groups.items()}
        streams = self.reduce_layout.side_streams(self.streams)
        with streams.reduce(), phase("reduce_scatter"):  # after the compute stream's backward wrote the gradients
            return [
                self.reduce_layout.reduce(
                    self.reduce_comm,
                    group,
                    dtype,
                    group[0].unsharded.device,
                    release_grads=True,
                    grad_of=self.grad_of,
                    tag=self.name,
                    buffers=self.pool,
                    streams=streams,
                    deferred=self.deferred,
                    kept_row=rows[dtype],
                    results_dtype=_results_dtype(group, dtype) if rows[dtype] is not None else None,
                )
                for dtype, group in groups.items()
            ]

    def _reduce_quantized(self, group: list[ShardedParam], dtype: torch.dtype) -> quantized.QuantizedReduce:
        return quantized.reduce_quantized(
            self.reduce_comm,
            group,
            dtype,
            group[0].unsharded.device,
            release_grads=True,
            block=self.grad_block,
            streams=self.streams,
            tag=self.name,
            grad_of=self.grad_of,
        )

    def _kept_row(self, group: list[ShardedParam], dtype: torch.dtype) -> torch.Tensor | None:
        """[Note: reduced rows kept]: a fresh output row for a reduction whose results become the shard
        gradients, allocated here on the compute stream; None where they cannot (shards on the host) or the
        layout has no output row (in place)."""
        device = group[0].unsharded.device
        if any(sp.local.device != device for sp in group):
            return None
        width = sum(sp.layout.shard_numel for sp in group) + len(group)
        return self.reduce_layout.kept_row(width, dtype, device)

    @torch.no_grad()
    def complete_reduce(self, pending) -> None:
        """One completion for every record ([Note: collective layouts]): a result that is a view of the
        record's kept row becomes the shard gradient as it is, any other is added into it ([Note: reduced
        rows kept])."""
        with phase("reduce_scatter_wait"):
            pending.complete(f"reduce-scatter of unit {self.name!r}", functools.partial(_store_reduced, pending))


class _UnitEnds:
    """Both ends of a unit's gather (``comm_layout.GatherEnds``); each layout calls the ones it uses."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit

    @staticmethod
    def open_full(members: list[ShardedParam]) -> list[torch.Tensor]:
        """In place (gloo): every rank's region is broadcast straight into the unsharded tensors."""
        return [sp.open_unsharded() for sp in members]

    def rows(self, members: list[ShardedParam]):
        """Buffered: one all-gather per compute dtype, sent as it is where the shards are its input already
        ([Note: flat shards]), else copied in with the tag."""
        unit = self.unit
        for dtype, group in _by_dtype(members, lambda sp: sp.unsharded.dtype).items():
            device = group[0].unsharded.device
            flat = unit._flat.get(dtype)  # [Note: flat shards]: the input as it is, no copy-in
            trailer = unit._tag() if flat is not None else unit._tag_on(dtype, device)
            yield comm_layout.GatherRow(dtype, device, group, trailer, flat)

    @staticmethod
    def fill(members: list[ShardedParam], chunks: list[torch.Tensor], extra: list) -> None:
        ShardedParam.copy_locals_into(members, chunks, extra)  # one batched copy-in per dtype (no flat shard)

    @staticmethod
    def expose(members: list[ShardedParam]) -> None:
        for sp in members:
            sp.expose()

    def copy_out(self, record, rows: torch.Tensor) -> None:
        params = [getattr(m, "sp", m) for m in record.members]  # hpZ's members wrap the ShardedParam
        layouts = [m.layout for m in record.members]
        self.unit._check_tags(ShardedParam.all_to_unsharded(params, layouts, rows, record.trailer))


def _results_dtype(group: list[ShardedParam], dtype: torch.dtype) -> torch.dtype | None:
    """[Note: reduced rows kept]: the shards' one storage dtype where it is not the reduction's (masters in
    another dtype: one cast per row), else None."""
    dtypes = {sp.local.dtype for sp in group}
    return dtypes.pop() if len(dtypes) == 1 and dtype not in dtypes else None


def _store_reduced(pending, sp: ShardedParam, reduced: torch.Tensor) -> None:
    sp.keep_reduced(reduced, row=pending.results)


def _param_grad(sp: ShardedParam) -> torch.Tensor | None:
    return sp.param.grad


def _flat_shards(index: int, params: list[ShardedParam], layout: comm_layout.Layout) -> dict[torch.dtype, torch.Tensor]:
    """[Note: flat shards]: where the layout gathers from a laid-out input (buffered), the shards of each
    compute dtype whose storage is already that dtype on the compute device, moved side by side into one
    tensor laid out as the all-gather's input (each padded chunk at its packed offset, then the unit's tag);
    ``{dtype: that tensor}``."""
    flats = {}
    for dtype, group in _by_dtype(params, lambda sp: sp.unsharded.dtype).items():
        device = group[0].unsharded.device
        if any(sp.local.dtype != dtype or sp.local.device != device for sp in group):
            continue  # cast or copied from the host at each gather (mixed precision, offload_params)
        offsets, width = comm_layout.packed_offsets(sp.layout.shard_numel for sp in group)
        flat = layout.gather_input(width + GATHER_TAG, dtype, device)
        if flat is None:
            return {}  # in place: each rank's region goes straight into the full tensors
        for j, value in enumerate(tag_of(index)):
            flat[width + j] = value
        for sp, off in zip(group, offsets):
            sp.adopt_local(flat[off : off + sp.local.numel()])
        flats[dtype] = flat
    return flats


def _by_dtype(params: list[ShardedParam], key) -> dict[torch.dtype, list[ShardedParam]]:
    groups: dict[torch.dtype, list[ShardedParam]] = {}
    for sp in params:
        if sp.layout.numel:
            groups.setdefault(key(sp), []).append(sp)
    return groups
