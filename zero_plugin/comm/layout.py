"""The two layouts of the sharded collectives, and one record per kind of collective in flight.

Stages 0-2 (``grads/reducer.py``, ``engines/param_sync.py``) and stage 3 (``stage3/unit.py``) move their
parameters and gradients through the functions here; the collectives themselves are ``Comm``'s.

[Note: collective layouts]
A collective serves a group of *members*: objects with ``.param`` and ``.layout`` (a ``ShardLayout``), a
bucket of ``MasterParam`` at stages 0-2, the parameters of one dtype of a unit at stage 3.  It uses one of
two layouts, chosen by ``Comm.gathers_regions_in_place`` ([Note: in-place region gather] in
``collectives.py``):
  * in place (gloo): a gather broadcasts each rank's region of every flattened tensor straight into the
    tensors (``rank_regions``); a reduction sums each full gradient in place and every rank keeps its own
    region.  The has-gradient flags ([Note: unused parameters] in ``grads/reducer.py``) go in one small
    float32 all-reduce beside it.  No buffer, no copy.
  * buffered (NCCL; ``ZERO_PLUGIN_BUFFERED_COLLECTIVES=1`` forces it on gloo): a rank-major
    ``(world_size, width + k)`` buffer whose row r holds rank r's padded chunk of member i at columns
    ``offsets[i]`` to ``offsets[i] + shard_numel``, then ``k`` trailing columns: the has-gradient flags
    of a reduction, the unit's tag of a stage-3 gather ([Note: gather tag] in ``stage3/unit.py``).  A
    reduce-scatter hands each rank exactly its row; an all-gather gives every rank every row.
Stage 0's all-reduce is the flat variant of the buffered layout: one ``width + k`` buffer, member i whole
at ``offsets[i]``, the flags last.

A launch copies in, issues the collective asynchronously and returns a record of what the collective
needs until it completes: one record type per kind (``InPlaceGather``, ``BufferedGather``,
``InPlaceReduce``, ``BufferedReduce``, ``FlatAllReduce``).  Completing a reduction waits, reads the
summed flags, averages and hands each member that has a gradient on some rank its result; what the
caller keeps (``param.grad``, a shard gradient) is the caller's.  Buffers come from a ``Buffers``
source (stage 3's ``BufferPool``, [Note: buffer reuse] in ``pool.py``; fresh tensors at stages 0-2) and go back to it
only after the completion, and on CUDA after the compute stream waited for the side stream that used
them ([Note: side streams] in ``streams.py``).

[Note: averaging in the collective]
Where the backend averages in its reduce-scatter (NCCL's ``ReduceOp.AVG``: each input scaled by 1/N, then
summed, as DDP's pre-division does) and no replica group follows, a buffered reduction asks the collective
to average and its completion divides nothing: one op less per reduction on the host (issue #39; FSDP2
does the same for fp32 and bf16).  The summed has-gradient flags then arrive as count / N, non-zero exactly
where some rank had the gradient, which is all that is read of them.  gloo has no AVG: in its own layout
a reduction sums and the completion divides by ``Comm.dp_size``; in the NCCL layout (the tests' switch)
its reduce-scatter sums and divides, so that the tests run the averaged path.

[Note: sum across replicas]
With hierarchical sharding ([Note: hierarchical groups] in ``collectives.py``) a reduction's collective
sums over the shard group only.  Its completion then all-reduces what this rank keeps (its regions, or
its row) and the summed flags over the replica group, one flat all-reduce per record, before averaging
over every rank (``Comm.dp_size``): replicas of one shard then hold the same, bit for bit, so anything
computed from the owned gradients over the shard group alone (the clipping norm, the inf/NaN check)
counts each element once and agrees on every rank.  The replica collectives are issued in completion
order, which is the rank-agreed reduction order ([Note: rank-agreed reduction order]), the same on every
rank of the world.  Without a replica group nothing is issued and the divisor is the group's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol, Sequence

import torch

from ..tensors.flat import ShardLayout, copy_padded_rows
from .collectives import Comm
from .streams import NO_STREAMS, StreamSet

if TYPE_CHECKING:
    from ..grads.presence import DeferredStores

__all__ = [
    "Buffers",
    "FreshBuffers",
    "packed_offsets",
    "rank_regions",
    "InPlaceGather",
    "BufferedGather",
    "InPlaceReduce",
    "BufferedReduce",
    "FlatAllReduce",
    "gather_in_place",
    "each",
    "gather_buffered",
    "reduce_in_place",
    "reduce_buffered",
    "all_reduce_flat",
    "all_reduce_filled",
]

Store = Callable[[Any, torch.Tensor], None]  # (member, its averaged result)
# (members, this rank's padded chunk of each, extra (destination, source) pairs to copy along) for a gather
Fill = Callable[[list, list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]], None]


class Buffers(Protocol):
    """Where a buffered collective's buffers come from and go back to (``stage3.pool.BufferPool``)."""

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def give(self, tensor: torch.Tensor | None) -> None: ...


class FreshBuffers:
    """A new tensor per collective, never reused: stages 0-2 keep views of a reduction's output as the
    reduced gradients."""

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, tensor: torch.Tensor | None) -> None:
        pass


FRESH = FreshBuffers()


def packed_offsets(widths: Iterable[int]) -> tuple[list[int], int]:
    """Columns of the given widths side by side: each one's offset, and the total width."""
    offsets, width = [], 0
    for w in widths:
        offsets.append(width)
        width += w
    return offsets, width


def rank_regions(
    flats: Sequence[torch.Tensor], layouts: Sequence[ShardLayout], world_size: int
) -> list[list[torch.Tensor]]:
    """In-place layout: ``regions[r]`` are rank r's regions of the flat tensors, in order."""
    regions: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    for flat, layout in zip(flats, layouts):
        for r, views in enumerate(regions):
            lo, hi = layout.bounds(r)
            views.append(flat[lo:hi])
    return regions


# -- records ------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class InPlaceGather:
    """Every rank's regions broadcast into ``members``' full tensors; they hold the gathered values after
    :meth:`wait`."""

    comm: Comm
    members: list
    work: Any

    def wait(self, what: str) -> None:
        self.comm.wait(self.work, what)


@dataclass(eq=False)
class BufferedGather:
    """An all-gather of rank-major rows: ``output`` holds ``world_size`` rows of ``width + trailer``."""

    comm: Comm
    members: list
    offsets: list[int]
    width: int
    trailer: int
    input: torch.Tensor
    output: torch.Tensor
    work: Any
    buffers: Buffers
    input_taken: bool = True  # False: the caller's laid-out input, not the buffers' (gather_buffered)

    def wait(self, what: str) -> torch.Tensor:
        """Wait for the collective; the gathered ``(world_size, width + trailer)`` rows."""
        self.comm.wait(self.work, what)
        return self.output.view(self.comm.world_size, self.width + self.trailer)

    def columns(self, rows: torch.Tensor) -> Iterator[tuple[Any, torch.Tensor]]:
        """Each member with its ``(world_size, shard_numel)`` columns of ``rows``."""
        for member, off in zip(self.members, self.offsets):
            yield member, rows[:, off : off + member.layout.shard_numel]

    def trailing(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.width :]

    def release(self) -> None:
        """The buffers back to their source: only after the completion (and on CUDA after the compute
        stream waited for it, [Note: side streams])."""
        if self.input_taken:
            self.buffers.give(self.input)
        self.buffers.give(self.output)


@dataclass(eq=False)
class InPlaceReduce:
    """Full gradients (one flat tensor per member, zeros where this rank had none) summed in place, with
    their has-gradient flags."""

    comm: Comm
    members: list
    grads: list[torch.Tensor]
    flags: torch.Tensor
    work: Any
    results_in_full_tensors = True  # a result is a region of a full-size temporary
    sources = None  # no side stream reads the gradients: in place is gloo's layout (BufferedReduce.sources)

    def complete(self, what: str, store: Store) -> None:
        self.comm.wait(self.work, what)
        n = self.comm.dp_size
        regions = [member.layout.local_view(grad) for member, grad in zip(self.members, self.grads)]
        flags = _sum_across_replicas(self.comm, regions, self.flags)  # [Note: sum across replicas]
        for member, region, has_grad in zip(self.members, regions, flags.tolist()):
            if has_grad:
                store(member, region.div_(n) if n != 1 else region)  # world size 1: no op


@dataclass(eq=False)
class BufferedReduce:
    """A reduce-scatter of rank-major rows with the flags in the last ``len(members)`` columns; this rank's
    row lands in ``output``."""

    comm: Comm
    members: list
    offsets: list[int]
    width: int
    input: torch.Tensor
    output: torch.Tensor
    work: Any
    buffers: Buffers
    streams: StreamSet
    # The full gradients a side stream may still read: referenced until the compute stream waited for it,
    # or the allocator could hand their memory to new work ([Note: side streams]); None without side streams.
    sources: list | None
    local: list[bool] | None = None  # whether this rank had each member's gradient (its own flags)
    # Where ``output`` came from, when not ``buffers``: stage 3 keeps its results as the shard gradients
    # ([Note: reduced rows kept] in stage3/unit.py), so its output is fresh and never goes back to a pool.
    out_buffers: Buffers | None = None
    averaged: bool = False  # the collective averaged already ([Note: averaging in the collective])
    results_in_full_tensors = False  # a result is a view of the shard-sized output

    def complete(
        self, what: str, store: Store, deferred: DeferredStores | None = None, results_in: torch.Tensor | None = None
    ) -> None:
        """``deferred``: hand the flags, results and ``store`` over ([Note: deferred has-gradient flags] in
        ``grads/presence.py``) instead of reading the flags here.  ``results_in``: a tensor of the output's
        size the averaged row is copied (cast) into in one op, the results then views of it (stage 3's
        shard gradients in the master dtype)."""
        with self.streams.reduce():  # waiting here makes the reduce stream (not compute) wait for NCCL
            self.comm.wait(self.work, what)
            numel = lambda layout: layout.local_numel  # noqa: E731
            _average_flagged(self, self.output, store, numel, deferred, results_in)
            reduced = self.streams.record()
        self.streams.wait(reduced)  # [Note: side streams]: only now may the memory be reused
        self.sources = None
        self.buffers.give(self.input)
        (self.out_buffers or self.buffers).give(self.output)


@dataclass(eq=False)
class FlatAllReduce:
    """Stage 0: full gradients side by side in one flat buffer, then the flags, all-reduced."""

    comm: Comm
    members: list
    offsets: list[int]
    width: int
    buffer: torch.Tensor
    work: Any
    averaged = False  # an all-reduce that sums: the completion divides

    def complete(self, what: str, store: Store) -> None:
        self.comm.wait(self.work, what)
        _average_flagged(self, self.buffer, store, lambda layout: layout.numel)


def _average_flagged(
    record: BufferedReduce | FlatAllReduce,
    flat: torch.Tensor,
    store: Store,
    numel: Callable[[ShardLayout], int],
    deferred: DeferredStores | None = None,
    results_in: torch.Tensor | None = None,
) -> None:
    """A completed reduction's ``flat`` result, the summed flags after ``record.width``: average, and store
    ``numel(layout)`` elements at its offset for each member that some rank had a gradient for; with
    ``deferred``, hand it the flags, the results and ``store`` (it stores now or later).  ``results_in``:
    the averaged ``flat`` is copied (cast) into it first and the results are its views."""
    if record.comm.replica is not None:  # [Note: sum across replicas]
        _replica_all_reduce(record.comm, flat)
    if deferred is not None:  # [Note: deferred has-gradient flags] in grads/presence.py
        _average(record, flat)  # a summed flag stays non-zero exactly where it was
        if results_in is not None:
            flat = results_in.copy_(flat)  # flags are small integers: exact in any float dtype
        results = [flat[off : off + numel(m.layout)] for m, off in zip(record.members, record.offsets)]
        deferred.take(record.members, flat[record.width :], results, store, record.local)
        return
    present = flat[record.width :].tolist()
    _average(record, flat)
    if results_in is not None:
        flat = results_in.copy_(flat)
    for member, off, has_grad in zip(record.members, record.offsets, present):
        if has_grad:
            store(member, flat[off : off + numel(member.layout)])


def _average(record: BufferedReduce | FlatAllReduce, flat: torch.Tensor) -> None:
    n = record.comm.dp_size
    if n != 1 and not record.averaged:  # dividing by 1 changes nothing: no op at world size 1
        flat.div_(n)


def _sum_across_replicas(comm: Comm, regions: list[torch.Tensor], flags: torch.Tensor) -> torch.Tensor:
    """In-place layout: sum this rank's regions and the flags over the replica group, as one flat tensor
    in the regions' dtype (only whether a summed flag is non-zero is read, which any float dtype keeps);
    the summed flags."""
    if comm.replica is None or not regions:
        return flags
    flat = torch.cat([r.reshape(-1) for r in regions] + [flags.to(regions[0].dtype)])
    _replica_all_reduce(comm, flat)
    offset = 0
    for region in regions:
        region.copy_(flat[offset : offset + region.numel()].view_as(region))
        offset += region.numel()
    return flat[offset:].to(flags.dtype)


def _replica_all_reduce(comm: Comm, flat: torch.Tensor) -> None:
    replica = comm.replica
    replica.wait(replica.all_reduce(flat, async_op=True, tag="sum across replicas"), "gradient sum across replicas")


# -- launches -----------------------------------------------------------------------------------------------
def gather_in_place(comm: Comm, members: list, flats: Sequence[torch.Tensor], tag: str = "") -> InPlaceGather:
    """Gather into ``flats`` (each member's full flat tensor, this rank's region already filled)."""
    regions = rank_regions(flats, [m.layout for m in members], comm.world_size)
    return InPlaceGather(comm, members, comm.gather_regions(regions, async_op=True, tag=tag))


def each(fill: Callable[[Any, torch.Tensor], None]) -> Fill:
    """A :data:`Fill` that writes one member's chunk at a time with ``fill(member, chunk)``, then copies the
    extra pairs."""

    def fill_each(members: list, chunks: list[torch.Tensor], extra: list) -> None:
        for member, chunk in zip(members, chunks):
            fill(member, chunk)
        for dst, src in extra:
            dst.copy_(src)

    return fill_each


def gather_buffered(
    comm: Comm,
    members: list,
    dtype: torch.dtype,
    device: torch.device,
    fill: Fill,
    buffers: Buffers = FRESH,
    trailer: tuple | torch.Tensor = (),
    tag: str = "",
    laid_out: torch.Tensor | None = None,
) -> BufferedGather:
    """``fill(members, chunks, extra)`` writes this rank's padded chunk (``shard_numel`` long) of each member
    and copies the ``extra`` pairs, all at once where it can (stage 3: one batched copy per unit,
    ``ShardedParam.copy_locals_into``), else one by one (:func:`each`); ``trailer``: values appended to this
    rank's input (exact in ``dtype``), or a tensor of them in ``dtype`` on ``device`` (copied by ``fill``
    with the chunks: no op of its own).  ``laid_out``: this rank's input as it is, chunks and trailer in
    place (stage 3's flat shards, [Note: flat shards] in ``stage3/unit.py``): nothing is copied in, and the
    input is not the buffers' to take back."""
    offsets, width = packed_offsets(m.layout.shard_numel for m in members)
    extra = len(trailer)
    if laid_out is not None:
        assert laid_out.numel() == width + extra and laid_out.dtype == dtype, "gather input: layout mismatch"
        inp = laid_out
    else:
        inp = buffers.take(width + extra, dtype, device)
        pairs = [(inp[width:], trailer)] if isinstance(trailer, torch.Tensor) else []
        fill(members, [inp[off : off + m.layout.shard_numel] for m, off in zip(members, offsets)], pairs)
        for j, value in enumerate(() if isinstance(trailer, torch.Tensor) else trailer):
            inp[width + j] = value  # scalar fills: no copy from pageable host memory (a host stall on CUDA)
    out = buffers.take(comm.world_size * (width + extra), dtype, device)
    work = comm.all_gather(out, inp, async_op=True, tag=tag)
    return BufferedGather(comm, members, offsets, width, extra, inp, out, work, buffers, laid_out is None)


def _param_grad(member) -> torch.Tensor | None:
    return member.param.grad


def reduce_in_place(
    comm: Comm,
    members: list,
    dtype: torch.dtype,
    device: torch.device,
    release_grads: bool,
    tag: str = "",
    grad_of: Callable[[Any], torch.Tensor | None] = _param_grad,
) -> InPlaceReduce:
    """Sum every member's full gradient (``grad_of(member)``, by default ``param.grad``; zeros where it has
    none) in ``dtype`` over the ranks, into this rank's region of it.  ``release_grads``: drop ``param.grad``
    (the reduction holds the gradient until it completes)."""
    grads, present = [], []
    for member in members:
        grad = grad_of(member)
        present.append(float(grad is not None))
        if grad is None:
            grad = torch.zeros(member.layout.numel, dtype=dtype, device=device)
        flat = grad.reshape(-1)
        grads.append(flat if flat.dtype == dtype else flat.to(dtype))
        if release_grads:
            member.param.grad = None
    flags = torch.tensor(present, dtype=torch.float32)
    regions = rank_regions(grads, [m.layout for m in members], comm.world_size)
    work = comm.reduce_in_place(regions, flags, async_op=True, tag=tag)
    return InPlaceReduce(comm, members, grads, flags, work)


def reduce_buffered(
    comm: Comm,
    members: list,
    dtype: torch.dtype,
    device: torch.device,
    release_grads: bool,
    buffers: Buffers = FRESH,
    streams: StreamSet = NO_STREAMS,
    tag: str = "",
    grad_of: Callable[[Any], torch.Tensor | None] = _param_grad,
    out_buffers: Buffers | None = None,
) -> BufferedReduce:
    """Copy every member's gradient (``grad_of``, as in :func:`reduce_in_place`; zeros where it has none)
    into rank-major rows with the flags and reduce-scatter them.  Call it on the stream the copies should run on (stage 3: inside
    ``streams.reduce()``); ``streams`` is where the completion runs.  ``out_buffers``: where this rank's
    output row comes from, if not ``buffers`` (stage 3: fresh, its results kept as views)."""
    n = comm.world_size
    offsets, width = packed_offsets(m.layout.shard_numel for m in members)
    k = len(members)
    buf = buffers.take(n * (width + k), dtype, device).view(n, width + k)
    grads = [grad_of(member) for member in members]
    _copy_in_rows(buf, members, offsets, width, grads)
    local = [grad is not None for grad in grads]
    sources = [grad for grad in grads if grad is not None] if streams.overlaps else None
    if release_grads:
        for member in members:
            member.param.grad = None
    out = (out_buffers or buffers).take(width + k, dtype, buf.device)
    averaged = comm.averages_in_reduce_scatter  # [Note: averaging in the collective]
    work = comm.reduce_scatter(out, buf.view(-1), op="avg" if averaged else "sum", async_op=True, tag=tag)
    return BufferedReduce(
        comm, members, offsets, width, buf, out, work, buffers, streams, sources, local, out_buffers, averaged
    )


def _copy_in_rows(
    buf: torch.Tensor, members: list, offsets: list[int], width: int, grads: list[torch.Tensor | None]
) -> None:
    """Reduction copy-in: each member's gradient (zeros where it has none) padded into its columns of the
    rank-major rows ``buf``, then the has-gradient flags ([Note: unused parameters] in grads/reducer.py).
    When the gradients share a dtype and none is empty (``_chunk_cat`` refuses those), one ``_chunk_cat``
    writes it all, as FSDP2's copy-in does: each input split into ``world_size`` chunks of ``shard_numel``,
    zero-padded, row r the r-th chunks side by side; the flags go in as one more input of ``world_size x k``
    elements, one row of k each.  Otherwise one copy per member."""
    n, k = buf.shape[0], len(members)
    present = [grad for grad in grads if grad is not None]
    dtype = present[0].dtype if present else buf.dtype
    if any(grad.dtype != dtype for grad in present) or not all(m.layout.numel for m in members):
        for i, (member, off, grad) in enumerate(zip(members, offsets, grads)):
            columns = buf[:, off : off + member.layout.shard_numel]
            copy_padded_rows(columns, None if grad is None else grad.reshape(-1), member.layout)
            buf[:, width + i] = float(grad is not None)
        return
    flats = [
        grad.reshape(-1) if grad is not None else torch.zeros(m.layout.numel, dtype=dtype, device=buf.device)
        for m, grad in zip(members, grads)
    ]
    if all(grad is not None for grad in grads):
        flags = _all_present(n * k, dtype, buf.device)
    else:
        flags = torch.ones(n, k, dtype=dtype, device=buf.device)  # a fill on the device: no host-to-device copy
        for i, grad in enumerate(grads):
            if grad is None:
                flags[:, i] = 0.0
    torch._chunk_cat(flats + [flags.view(-1)], dim=0, num_chunks=n, out=buf)


_ALL_PRESENT: dict[tuple, torch.Tensor] = {}


def _all_present(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The has-gradient flags of a reduction where every member has its gradient: ``numel`` ones, made once
    per size, dtype, device and CUDA stream (read only; made on the stream that reads it, so no stream
    ever reads it before its fill ran) instead of a fill per reduction (issue #39)."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None
    key = (numel, dtype, device, stream)
    ones = _ALL_PRESENT.get(key)
    if ones is None:
        ones = _ALL_PRESENT[key] = torch.ones(numel, dtype=dtype, device=device)
    return ones


def all_reduce_flat(comm: Comm, members: list, dtype: torch.dtype, device: torch.device) -> FlatAllReduce:
    """Stage 0: every member's full ``param.grad`` (zeros where it has none) and the flags, all-reduced."""
    offsets, width = packed_offsets(m.layout.numel for m in members)
    k = len(members)
    buf = torch.empty(width + k, dtype=dtype, device=device)
    for i, (member, off) in enumerate(zip(members, offsets)):
        dst = buf[off : off + member.layout.numel]
        grad = member.param.grad
        dst.copy_(grad.view(-1)) if grad is not None else dst.zero_()
        buf[width + i] = float(grad is not None)
    return FlatAllReduce(comm, members, offsets, width, buf, comm.all_reduce(buf, async_op=True))


def all_reduce_filled(comm: Comm, members: list, buffer: torch.Tensor, width: int) -> FlatAllReduce:
    """Stage 0 with a buffer the caller filled already in :func:`all_reduce_flat`'s layout (members whole
    at their packed offsets, then the flags): the all-reduce alone ([Note: gradients as bucket views] in
    ``grads/views.py``)."""
    offsets, packed = packed_offsets(m.layout.numel for m in members)
    assert packed == width and buffer.numel() == width + len(members), "all_reduce_filled: layout mismatch"
    return FlatAllReduce(comm, members, offsets, width, buffer, comm.all_reduce(buffer, async_op=True))
