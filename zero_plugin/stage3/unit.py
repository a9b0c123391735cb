"""A stage-3 unit: parameters gathered, released and reduced together.

Pipelines (one collective per dtype present in the unit), in the layouts of [Note: collective layouts]
in ``zero_plugin/comm_layout.py``:
  unshard:      copy_in (local shards) -> all_gather (async) -> [wait] -> copy_out (to_unsharded)
  reduce_grads: copy_in (full grads, padded) -> reduce_scatter (async) -> [wait] -> accumulate shard grads
In the buffered layout (NCCL) each pipeline runs on a side stream ([Note: side streams] in
``zero_plugin/streams.py``); the compute stream waits for it only before the result is used, and buffers
go back to the pool (and full gradients are let go) only after that wait.

[Note: gather tag]
In the buffered layout every all-gather also carries its unit's index (``_TAG`` trailing elements per
rank), a second line of defence behind [Note: collective order] (``order.py``) that costs nothing extra on
the wire: a rank that receives another unit's index raises instead of computing on mixed weights.
"""
from __future__ import annotations

import enum

import torch
from torch import nn

from .. import comm_layout
from ..collectives import Comm
from ..streams import NO_STREAMS, StreamSet
from .order import OrderGuard
from .param import ShardedParam, ShardedState
from .pool import BufferPool

__all__ = ["Unit", "BackwardState"]

_TAG = 2   # elements appended to each rank's all-gather input: the unit's index ([Note: gather tag])


class BackwardState(enum.Enum):
    IDLE = "idle"                  # no backward of this unit in flight
    PRE_BACKWARD = "pre_backward"  # gathered for backward, gradients pending
    POST_BACKWARD = "post_backward"  # the unit's backward ops finished (inputs' grads computed)


class Unit:
    def __init__(self, index: int, name: str, module: nn.Module, params: list[ShardedParam],
                 comm: Comm, reduce_dtype: torch.dtype | None, pool: BufferPool | None = None,
                 streams: StreamSet = NO_STREAMS) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.params = params
        self.trainable = [sp for sp in params if sp.param.requires_grad]
        self.comm = comm
        # [Note: reductions on their own group]: set by the engine; the gathers' group until then
        self.reduce_comm = comm
        self.reduce_dtype = reduce_dtype
        self.pool = pool if pool is not None else BufferPool()   # [Note: buffer reuse]
        self.streams = streams   # [Note: side streams]
        self.state = ShardedState.SHARDED
        self.backward_state = BackwardState.IDLE
        self.ready: set[int] = set()          # id(param) of trainable params whose grad is final
        self.reduced = False                  # this backward's reduce-scatter was launched
        self.wrapped_inputs = False           # a post-backward hook sits on this forward's inputs
        self._gather: list[comm_layout.InPlaceGather | comm_layout.BufferedGather] = []
        self.guard: OrderGuard | None = None   # set by the runtime: [Note: collective order]

    def __repr__(self) -> str:
        return f"Unit({self.index}, {self.name!r}, {self.state.value})"

    # -- gather ---------------------------------------------------------------
    @property
    def gathering(self) -> bool:
        return bool(self._gather)

    @torch.no_grad()
    def unshard(self, async_op: bool = False, checked: bool = True) -> None:
        """``checked=False``: the caller's protocol already keeps this gather paired ([Note: collective
        order] in order.py); otherwise the ranks compare it before the payload goes out."""
        if self.state is ShardedState.UNSHARDED or self._gather:
            if not async_op:
                self.wait_unshard()
            return
        if checked and self.guard is not None:   # [Note: collective order]: nothing sent before ranks agree
            self.guard.before_gather(self)
        if self.comm.gathers_regions_in_place:
            self._gather_in_place()
        else:
            self._gather_buffered()
        if not async_op:
            self.wait_unshard()

    def _gather_in_place(self) -> None:
        """gloo: every rank's region is broadcast straight into the unsharded tensors."""
        opened = [sp for sp in self.params if sp.layout.numel]
        flats = [sp.open_unsharded() for sp in opened]
        self._gather.append(comm_layout.gather_in_place(self.comm, opened, flats, tag=self.name))

    def _gather_buffered(self) -> None:
        with self.streams.gather():   # after the compute stream's writes to the shards (the last step)
            for dtype, group in _by_dtype(self.params, lambda sp: sp.unsharded.dtype).items():
                self._gather.append(comm_layout.gather_buffered(
                    self.comm, group, dtype, group[0].unsharded.device, ShardedParam.copy_local_into,
                    self.pool, trailer=self._tag(), tag=self.name))

    @torch.no_grad()
    def wait_unshard(self) -> None:
        pending, self._gather = self._gather, []
        if pending and isinstance(pending[0], comm_layout.InPlaceGather):
            self._expose_in_place(pending[0])
        elif pending:
            self._copy_out(pending)
        for sp in self.params:   # zero-size parameters take part in no collective
            if sp.layout.numel == 0 and sp.state is ShardedState.SHARDED:
                sp.to_unsharded(torch.empty(self.comm.world_size, 0, dtype=sp.unsharded.dtype))
        self.state = ShardedState.UNSHARDED

    def _expose_in_place(self, pending: comm_layout.InPlaceGather) -> None:
        pending.wait(f"all-gather of unit {self.name!r}")
        for sp in pending.members:
            sp.expose()

    def _copy_out(self, pending: list[comm_layout.BufferedGather]) -> None:
        """Buffered layout: copy-out on the gather stream, then the compute stream waits for it before the
        parameters are used; buffers return to the pool only after that wait ([Note: side streams])."""
        with self.streams.gather():
            for p in pending:
                rows = p.wait(f"all-gather of unit {self.name!r}")
                self._check_tags(p.trailing(rows))
                for sp, columns in p.columns(rows):
                    sp.to_unsharded(columns)
            copied = self.streams.record()
        self.streams.wait(copied)
        for p in pending:
            p.release()

    def _tag(self) -> tuple[int, int]:
        # Exact in every float dtype (values <= 129), unique per unit index.
        return (self.index // 128 + 1, self.index % 128 + 1)

    def _check_tags(self, tags: torch.Tensor) -> None:
        """[Note: gather tag]: every rank's trailing elements must be this unit's index."""
        if self.comm.backend == "fake":
            return   # torch's fake process group (memory planning) moves no data
        expected = torch.tensor(self._tag(), dtype=tags.dtype, device=tags.device)
        bad = [r for r in range(tags.shape[0]) if not torch.equal(tags[r], expected)]
        if bad:
            got = [int((tags[r, 0].item() - 1) * 128 + tags[r, 1].item() - 1) for r in bad]
            raise RuntimeError(
                f"zero_plugin stage 3: collective order diverged. This rank gathered unit {self.index} "
                f"({self.name!r}) while rank(s) {bad} gathered unit(s) {got} at the same point. Every rank must "
                "run the same blocks in the same order (a conditional branch that skips a block on some ranks?). "
                "Run the block on every rank (e.g. multiply its output by 0) or exclude it from sharding.")

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
    def reduce_grads(self) -> list[comm_layout.InPlaceReduce | comm_layout.BufferedReduce]:
        """Launch the reduce-scatter of this unit's full grads (missing ones count as zeros); the full
        gradients are let go (the records hold them until the reductions complete)."""
        self.reduced = True
        groups = _by_dtype(self.trainable, lambda sp: self.reduce_dtype or sp.unsharded.dtype)
        if self.reduce_comm.gathers_regions_in_place:
            return [comm_layout.reduce_in_place(self.reduce_comm, group, dtype, group[0].unsharded.device,
                                                release_grads=True, tag=self.name)
                    for dtype, group in groups.items()]
        with self.streams.reduce():   # after the compute stream's backward wrote the gradients
            return [comm_layout.reduce_buffered(self.reduce_comm, group, dtype, group[0].unsharded.device,
                                                release_grads=True, buffers=self.pool, streams=self.streams,
                                                tag=self.name)
                    for dtype, group in groups.items()]

    @torch.no_grad()
    def complete_reduce(self, pending: comm_layout.InPlaceReduce | comm_layout.BufferedReduce) -> None:
        pending.complete(f"reduce-scatter of unit {self.name!r}", ShardedParam.accumulate_grad)

    def reset_backward(self) -> None:
        self.ready.clear()
        self.reduced = False
        self.wrapped_inputs = False
        self.backward_state = BackwardState.IDLE


def _by_dtype(params: list[ShardedParam], key) -> dict[torch.dtype, list[ShardedParam]]:
    groups: dict[torch.dtype, list[ShardedParam]] = {}
    for sp in params:
        if sp.layout.numel:
            groups.setdefault(key(sp), []).append(sp)
    return groups

