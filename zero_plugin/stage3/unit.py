"""A stage-3 unit: parameters gathered, released and reduced together.

Pipelines (one collective per dtype present in the unit):
  unshard:      copy_in (local shards) -> all_gather (async) -> [wait] -> copy_out (to_unsharded)
  reduce_grads: copy_in (full grads, padded) -> reduce_scatter (async) -> [wait] -> accumulate shard grads
In the buffered layout (NCCL) each pipeline runs on a side stream ([Note: side streams] in
``zero_plugin/streams.py``); the compute stream waits for it only before the result is used, and buffers
go back to the pool (and full gradients are let go) only after that wait.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._flat import copy_padded_rows
from ..collectives import Comm
from ..streams import NO_STREAMS, StreamSet
from .order import OrderGuard
from .param import ShardedParam, ShardedState
from .pool import BufferPool

__all__ = ["Unit", "BackwardState"]

_TAG = 2   # elements appended to each rank's all-gather input: the unit's index (see _check_tags)


class BackwardState(enum.Enum):
    IDLE = "idle"                  # no backward of this unit in flight
    PRE_BACKWARD = "pre_backward"  # gathered for backward, gradients pending
    POST_BACKWARD = "post_backward"  # the unit's backward ops finished (inputs' grads computed)


@dataclass(eq=False)
class _Pending:
    """One in-flight collective with the buffers it needs until completion."""

    params: list[ShardedParam]
    offsets: list[int]
    width: int
    output: torch.Tensor
    work: Any
    buffer: Any = None   # input buffer, or the full gradients reduced in place
    sources: list | None = None   # full gradients a side stream reads: alive until the compute stream waited


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
        self._gather: list[_Pending] = []
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
        """gloo: every rank's region is broadcast straight into the unsharded tensors ([Note: in-place
        region gather] in collectives.py)."""
        regions: list[list[torch.Tensor]] = [[] for _ in range(self.comm.world_size)]
        opened = []
        for sp in self.params:
            if sp.layout.numel:
                flat = sp.open_unsharded()
                opened.append(sp)
                for r, views in enumerate(regions):
                    lo, hi = sp.layout.bounds(r)
                    views.append(flat[lo:hi])
        work = self.comm.gather_regions(regions, async_op=True, tag=self.name)
        self._gather.append(_Pending(opened, [], 0, None, work))

    def _gather_buffered(self) -> None:
        n = self.comm.world_size
        with self.streams.gather():   # after the compute stream's writes to the shards (the last step)
            for dtype, group in _by_dtype(self.params, lambda sp: sp.unsharded.dtype).items():
                offsets, width = _offsets(group)
                device = group[0].unsharded.device
                inp = self.pool.take(width + _TAG, dtype, device)
                for sp, off in zip(group, offsets):
                    sp.copy_local_into(inp[off: off + sp.layout.shard_numel])
                inp[width:] = torch.tensor(self._tag(), dtype=dtype)
                out = self.pool.take(n * (width + _TAG), dtype, device)
                work = self.comm.all_gather(out, inp, async_op=True, tag=self.name)
                self._gather.append(_Pending(group, offsets, width, out, work, inp))

    @torch.no_grad()
    def wait_unshard(self) -> None:
        pending, self._gather = self._gather, []
        if pending and pending[0].output is None:
            self._expose_in_place(pending[0])
        elif pending:
            self._copy_out(pending)
        for sp in self.params:   # zero-size parameters take part in no collective
            if sp.layout.numel == 0 and sp.state is ShardedState.SHARDED:
                sp.to_unsharded(torch.empty(self.comm.world_size, 0, dtype=sp.unsharded.dtype))
        self.state = ShardedState.UNSHARDED

    def _expose_in_place(self, p: _Pending) -> None:
        self.comm.wait(p.work, f"all-gather of unit {self.name!r}")
        for sp in p.params:
            sp.expose()

    def _copy_out(self, pending: list[_Pending]) -> None:
        """Buffered layout: copy-out on the gather stream, then the compute stream waits for it before the
        parameters are used; buffers return to the pool only after that wait ([Note: side streams])."""
        with self.streams.gather():
            for p in pending:
                self.comm.wait(p.work, f"all-gather of unit {self.name!r}")
                rows = p.output.view(self.comm.world_size, p.width + _TAG)
                self._check_tags(rows[:, p.width:])
                for sp, off in zip(p.params, p.offsets):
                    sp.to_unsharded(rows[:, off: off + sp.layout.shard_numel])
            copied = self.streams.record()
        self.streams.wait(copied)
        for p in pending:
            self.pool.give(p.buffer)
            self.pool.give(p.output)

    def _tag(self) -> tuple[int, int]:
        # Exact in every float dtype (values <= 129), unique per unit index.
        return (self.index // 128 + 1, self.index % 128 + 1)

    def _check_tags(self, tags: torch.Tensor) -> None:
        """Buffered layout: every gather also carries its unit's index, a second line of defence behind
        [Note: collective order] (order.py) that costs nothing extra on the wire."""
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
    def reduce_grads(self) -> list[_Pending]:
        """Launch the reduce-scatter of this unit's full grads (missing ones count as zeros)."""
        self.reduced = True
        if self.reduce_comm.gathers_regions_in_place:
            return self._reduce_in_place()
        launched = []
        grad_dtype = lambda sp: self.reduce_dtype or sp.unsharded.dtype  # noqa: E731
        with self.streams.reduce():   # after the compute stream's backward wrote the gradients
            for dtype, group in _by_dtype(self.trainable, grad_dtype).items():
                launched.append(self._launch_reduce_scatter(dtype, group))
        return launched

    def _launch_reduce_scatter(self, dtype: torch.dtype, group: list[ShardedParam]) -> _Pending:
        n = self.reduce_comm.world_size
        offsets, width = _offsets(group)
        k = len(group)
        buf = self.pool.take(n * (width + k), dtype, group[0].unsharded.device).view(n, width + k)
        sources = []
        for i, (sp, off) in enumerate(zip(group, offsets)):
            grad = sp.param.grad
            copy_padded_rows(buf[:, off: off + sp.layout.shard_numel],
                             None if grad is None else grad.reshape(-1), sp.layout)
            buf[:, width + i] = float(grad is not None)   # see [Note: unused parameters] in grads/reducer.py
            if grad is not None:
                sources.append(grad)
            sp.param.grad = None
        out = self.pool.take(width + k, dtype, buf.device)
        work = self.reduce_comm.reduce_scatter(out, buf.view(-1), async_op=True, tag=self.name)
        # The reduce stream may still be reading the gradients: they stay referenced until the compute
        # stream waited for it (complete_reduce), or the allocator could hand their memory to new work.
        return _Pending(group, offsets, width, out, work, buf, sources if self.streams.overlaps else None)

    def _reduce_in_place(self) -> list[_Pending]:
        """gloo: sum every full gradient in place (no rank-major buffer) and keep this rank's region;
        one small all-reduce carries the "has a gradient" flags."""
        launched = []
        grad_dtype = lambda sp: self.reduce_dtype or sp.unsharded.dtype  # noqa: E731
        for dtype, group in _by_dtype(self.trainable, grad_dtype).items():
            grads, present = [], []
            for sp in group:
                grad = sp.param.grad
                present.append(float(grad is not None))
                if grad is None:
                    grad = torch.zeros(sp.layout.numel, dtype=dtype, device=sp.unsharded.device)
                grads.append(grad.reshape(-1).to(dtype))
                sp.param.grad = None
            flags = torch.tensor(present, dtype=torch.float32)
            work = self.reduce_comm.reduce_in_place(grads, flags, async_op=True, tag=self.name)
            launched.append(_Pending(group, [], 0, flags, work, grads))
        return launched

    @torch.no_grad()
    def complete_reduce(self, pending: _Pending) -> None:
        what = f"reduce-scatter of unit {self.name!r}"
        if isinstance(pending.buffer, list):   # reduced in place: pending.output holds the flags
            self.reduce_comm.wait(pending.work, what)
            n = self.reduce_comm.world_size
            for sp, grad, has_grad in zip(pending.params, pending.buffer, pending.output.tolist()):
                if has_grad:
                    region = sp.layout.local_view(grad)
                    sp.accumulate_grad(region.div_(n))
            return
        with self.streams.reduce():   # waiting here makes the reduce stream (not compute) wait for NCCL
            self.reduce_comm.wait(pending.work, what)
            present = pending.output[pending.width:].tolist()
            pending.output.div_(self.reduce_comm.world_size)
            for sp, off, has_grad in zip(pending.params, pending.offsets, present):
                if has_grad:
                    sp.accumulate_grad(pending.output[off: off + sp.layout.local_numel])
            reduced = self.streams.record()
        self.streams.wait(reduced)   # [Note: side streams]: only now may the memory be reused
        pending.sources = None
        self.pool.give(pending.buffer)
        self.pool.give(pending.output)

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


def _offsets(group: list[ShardedParam]) -> tuple[list[int], int]:
    offsets, width = [], 0
    for sp in group:
        offsets.append(width)
        width += sp.layout.shard_numel
    return offsets, width
