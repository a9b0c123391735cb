"""The two layouts of the sharded collectives, and one record per kind of collective in flight.

Stages 0-2 (``grads/reducer.py``, ``engines/param_sync.py``) and stage 3 (``stage3/unit.py``) move their
parameters and gradients through the functions here; the collectives themselves are ``Comm``'s.

[Note: collective layouts]
A collective serves a group of *members*: objects with ``.param`` and ``.layout`` (a ``ShardLayout``), a
bucket of ``MasterParam`` at stages 0-2, the parameters of one dtype of a unit at stage 3.  It uses one of
two layouts, chosen once per ``Comm`` by ``layout_of(comm)`` (``IN_PLACE`` or ``BUFFERED``, from
``Comm.gathers_regions_in_place``: [Note: in-place region gather] in ``collectives.py``); callers launch
through that object's ``gather`` / ``reduce`` (the stages 1-2 parameter sync through ``gather_all``, which
batches its buckets as the layout does) and never ask which layout it is:
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
``InPlaceReduce``, ``BufferedReduce``, ``FlatAllReduce``; ``quantized.py`` adds ZeRO++'s two).  Every
record owns its completion, with one signature per direction: a gather's ``complete(what, ends)`` waits
and hands the gathered values to the caller's ``GatherEnds`` (``expose`` in place, ``copy_out`` of the
rows when buffered), then ``release()`` returns its buffers; a reduction's ``complete(what, store)`` waits,
reads the summed flags (or hands them to the ``DeferredStores`` given at launch), averages and calls
``store(member, result)`` for each member that has a gradient on some rank; what the caller keeps
(``param.grad``, a shard gradient) is the caller's.  Buffers come from a ``Buffers``
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

[Note: collective footprints]
What a launch takes and a completion lets go is described beside the code that does it, for the memory
planner's replay (``planner/replay.py``), which asks the layout instead of keeping a twin of it: a
``Footprint`` per collective, from ``Layout.gather_footprint``, ``Layout.reduce_footprint``,
``Layout.gather_all_footprints`` and (stage 0, the same on every layout) ``all_reduce_footprint``.  Its steps
are (part, bytes) in the order the replay counts them, + taken, - let go, by part: ``buffers`` (the
collective's own: a ``Buffers`` source's, fresh tensors, or in place the gradients cast to the reduce dtype),
``grads`` (the caller's full gradients, let go when the pipeline drops its last reference), ``gathered``
(the full tensors a gather fills) and ``temp`` (the backend's staging).  ``launch`` is what the launch
holds when it returns, ``complete`` what the completion lets go after the caller took its results.  Where
the bytes become resident on a device type (not where they are allocated) is ``Footprint.resident``: the
[Note: collective buffers] measurements in ``replay.py`` (gloo on CPU stages an all-gather's output until
the wait, and writes a reduce-scatter's output only in our wait).  ``tests/unit/test_layout_footprint.py``
runs the pipelines and checks every description against what they allocate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Protocol, Sequence

import torch

from ..tensors.flat import ShardLayout, copy_padded_rows
from .backends import regions_in_place
from .collectives import Comm
from .streams import NO_STREAMS, StreamSet

__all__ = [
    "Layout",
    "IN_PLACE",
    "BUFFERED",
    "layout_of",
    "layout_for",
    "Footprint",
    "Steps",
    "all_reduce_footprint",
    "GatherEnds",
    "GatherRow",
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
    "finish",
    "reduce_in_place",
    "reduce_buffered",
    "all_reduce_flat",
    "all_reduce_filled",
]

Store = Callable[[Any, torch.Tensor], None]  # (member, its averaged result)


class DeferredStores(Protocol):
    """What a reduction hands its results to when the has-gradient flags are read later: ``grads/presence.py``'s
    ``DeferredStores`` ([Note: deferred has-gradient flags] there), which this layer may not import."""

    def take(
        self, members: list, flags: torch.Tensor, results: list[torch.Tensor], store: Store, local: list | None = None
    ) -> None: ...


# (members, this rank's padded chunk of each, extra (destination, source) pairs to copy along) for a gather
Fill = Callable[[list, list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]], None]


class GatherRow(NamedTuple):
    """One rank-major all-gather of the buffered layout: ``members`` of one ``dtype`` on ``device``, the
    ``trailer`` appended to each rank's input (values, or a tensor of them: ``gather_buffered``) and the input
    as it is where the caller keeps it laid out already (``laid_out``, else None: copied in by ``fill``)."""

    dtype: torch.dtype
    device: torch.device
    members: list
    trailer: tuple | torch.Tensor = ()
    laid_out: torch.Tensor | None = None


class GatherEnds(Protocol):
    """Both ends of a gather, which its caller provides (stage 3's unit); each layout calls the ones it uses."""

    def open_full(self, members: list) -> list[torch.Tensor]:
        """In place: each member's full flat tensor with this rank's region written (the gather fills the rest)."""

    def rows(self, members: list) -> Iterable[GatherRow]:
        """Buffered: the all-gathers that carry ``members``' shards, one per row layout (a dtype)."""

    def fill(self, members: list, chunks: list[torch.Tensor], extra: list) -> None:
        """Buffered copy-in (a :data:`Fill`), for a row whose input is not laid out already."""

    def expose(self, members: list) -> None:
        """In place, after the wait: the full tensors hold every rank's values."""

    def copy_out(self, record: BufferedGather, rows: torch.Tensor) -> None:
        """Buffered, after the wait: the gathered ``(world_size, width + trailer)`` ``rows`` into the members."""


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


# -- footprints ([Note: collective footprints]) -----------------------------------------------------------
Steps = tuple[tuple[str, int], ...]  # (part, bytes): + taken, - let go, in order


def _steps(*steps: tuple[str, int]) -> Steps:
    """The steps that move bytes."""
    return tuple((part, nbytes) for part, nbytes in steps if nbytes)


@dataclass(frozen=True, slots=True)
class Footprint:
    """The bytes one collective's pipeline holds from its launch to its completion ([Note: collective
    footprints]), by part; what the caller keeps of the results (a shard gradient) is the caller's."""

    launch: Steps = ()  # taken (and let go) by the launch, the reduce-scatter output row excepted
    complete: Steps = ()  # let go by the completion, once the caller took its results
    # A reduce-scatter's output row, taken last at the launch; ``complete`` lets it go with the other
    # ``buffers``, and a caller that keeps its results as views of the row (stages 1-2's fresh rows, stage 3's
    # kept rows) holds these bytes instead.
    output: int = 0
    staged: int = 0  # an all-gather's output bytes, which gloo stages in a temporary until the wait

    def resident(self, device_type: str) -> tuple[Steps, Steps, Steps]:
        """(at the launch, at the wait, at the completion): where the bytes become resident on
        ``device_type`` ([Note: collective buffers] in ``planner/replay.py``).  On CUDA where they are
        allocated; on CPU gloo stages an all-gather's output until the wait, and writes a reduce-scatter's
        output (and so makes it resident) only in our wait."""
        out = _steps(("buffers", self.output))
        if device_type == "cpu":
            staged = _steps(("temp", self.staged))
            return self.launch + staged, tuple((p, -b) for p, b in staged) + out, self.complete
        return self.launch + out, (), self.complete

    def held(self) -> tuple[dict[str, int], dict[str, int]]:
        """Net bytes by part taken when the launch returned, and moved by the completion (a test's view)."""
        launch: dict[str, int] = {}
        for part, nbytes in self.launch + _steps(("buffers", self.output)):
            launch[part] = launch.get(part, 0) + nbytes
        done: dict[str, int] = {}
        for part, nbytes in self.complete:
            done[part] = done.get(part, 0) + nbytes
        return launch, done


def all_reduce_footprint(width: int, itemsize: int, filled: bool = False) -> Footprint:
    """Stage 0's :func:`all_reduce_flat`, on every layout: one fresh buffer of ``width`` elements (the members
    whole, then their flags) of ``itemsize`` bytes, all-reduced in place, held until the completion;
    ``filled``: :func:`all_reduce_filled` of a buffer the caller keeps, which takes nothing."""
    nbytes = 0 if filled else width * itemsize
    return Footprint(launch=_steps(("buffers", nbytes)), complete=_steps(("buffers", -nbytes)))


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

    def complete(self, what: str, ends: GatherEnds) -> None:
        self.wait(what)
        ends.expose(self.members)

    def release(self) -> None:
        """Nothing to give back: no buffer."""


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

    def complete(self, what: str, ends: GatherEnds) -> None:
        ends.copy_out(self, self.wait(what))

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
    results = None  # no row of results is the caller's to keep (BufferedReduce.results)

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
    averaged: bool = False  # the collective averaged already ([Note: averaging in the collective])
    # Where the summed flags go instead of being read at completion ([Note: deferred has-gradient flags] in
    # grads/presence.py); None: read here.
    deferred: DeferredStores | None = None
    # ``output`` is the caller's row, not the buffers': stage 3 keeps its results as the shard gradients
    # ([Note: reduced rows kept] in stage3/unit.py), so it never goes back to a pool.
    kept: bool = False
    # With ``kept``: the dtype the averaged row is cast into (one copy into a fresh row) before the results
    # are taken as its views (stage 3's shard gradients in the master dtype); None: the output's own.
    results_dtype: torch.dtype | None = None
    # After a completion with ``kept``: the row whose views the results are, the caller's to keep.
    results: torch.Tensor | None = None
    results_in_full_tensors = False  # a result is a view of the shard-sized output

    def complete(self, what: str, store: Store) -> None:
        results_in = None
        if self.kept and self.results_dtype is not None:  # allocated on the compute stream, as the row was
            results_in = torch.empty(self.output.shape, dtype=self.results_dtype, device=self.output.device)
        if self.kept:
            self.results = results_in if results_in is not None else self.output
        with self.streams.reduce():  # waiting here makes the reduce stream (not compute) wait for NCCL
            self.comm.wait(self.work, what)
            numel = lambda layout: layout.local_numel  # noqa: E731
            _average_flagged(self, self.output, store, numel, self.deferred, results_in)
            reduced = self.streams.record()
        self.streams.wait(reduced)  # [Note: side streams]: only now may the memory be reused
        self.sources = None
        self.buffers.give(self.input)
        if not self.kept:
            self.buffers.give(self.output)


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

    def complete(self, what: str, store: Store, found: torch.Tensor | None = None) -> bool:
        """``found``: a float32 zero set to 1 if the averaged buffer holds an inf/NaN; True if that check was
        made, in the average's own pass ([Note: finite check in the average])."""
        self.comm.wait(self.work, what)
        return _average_flagged(self, self.buffer, store, lambda layout: layout.numel, found=found)


def _average_flagged(
    record: BufferedReduce | FlatAllReduce,
    flat: torch.Tensor,
    store: Store,
    numel: Callable[[ShardLayout], int],
    deferred: DeferredStores | None = None,
    results_in: torch.Tensor | None = None,
    found: torch.Tensor | None = None,
) -> bool:
    """A completed reduction's ``flat`` result, the summed flags after ``record.width``: average, and store
    ``numel(layout)`` elements at its offset for each member that some rank had a gradient for; with
    ``deferred``, hand it the flags, the results and ``store`` (it stores now or later).  ``results_in``:
    the averaged ``flat`` is copied (cast) into it first and the results are its views.  ``found``: whether
    the average checked ``flat`` for inf/NaN on the way ([Note: finite check in the average])."""
    if record.comm.replica is not None:  # [Note: sum across replicas]
        _replica_all_reduce(record.comm, flat)
    if deferred is not None:  # [Note: deferred has-gradient flags] in grads/presence.py
        _average(record, flat)  # a summed flag stays non-zero exactly where it was
        if results_in is not None:
            flat = results_in.copy_(flat)  # flags are small integers: exact in any float dtype
        results = [flat[off : off + numel(m.layout)] for m, off in zip(record.members, record.offsets)]
        deferred.take(record.members, flat[record.width :], results, store, record.local)
        return False
    present = flat[record.width :].tolist()
    checked = _average(record, flat, found)
    if results_in is not None:
        flat = results_in.copy_(flat)
    for member, off, has_grad in zip(record.members, record.offsets, present):
        if has_grad:
            store(member, flat[off : off + numel(member.layout)])
    return checked


# [Note: finite check in the average]
# The step's inf/NaN check ([Note: non-finite gradients] in optim/loss_scale.py) reads every owned gradient
# once: at stage 0, a pass over Ψ that DDP + its optimizer does not make (about 8% of an AdamW step at 117M,
# issue #49).  The average after a summing all-reduce is a pass over the same elements already, so it can
# answer the question on the way: torch's ``_amp_foreach_non_finite_check_and_unscale_`` (what GradScaler
# unscales with) multiplies by 1/N and sets ``found`` where an element is inf/NaN, at the cost of the
# division alone (both about 17 ms per 400 MB on this machine's CPU; the norm 15 ms on top).  Only where
# 1/N is a power of two: x * 2^-k and x / 2^k are the same correctly rounded quotient, so the gradients stay
# bit for bit those of the division (and DDP's); at another N the division stays and the step checks as
# before.  What the answer covers is the caller's to track: the averaged buffer as it was then (its
# autograd version), so a gradient written after the average is read again by the step.
def _average(record: BufferedReduce | FlatAllReduce, flat: torch.Tensor, found: torch.Tensor | None = None) -> bool:
    """Divide ``flat`` by the ranks; True if ``found`` took the inf/NaN answer on the way."""
    n = record.comm.dp_size
    if n == 1 or record.averaged:  # dividing by 1 changes nothing: no op at world size 1
        return False
    if found is None or n & (n - 1) or not flat.is_floating_point():
        flat.div_(n)
        return False
    torch._amp_foreach_non_finite_check_and_unscale_([flat], found, _inverse(n, flat.device))
    return True


def _inverse(n: int, device: torch.device) -> torch.Tensor:
    """1/n as the one-element float32 tensor the check's kernel scales by (cached per device: no op per call)."""
    key = (n, device)
    inv = _INVERSES.get(key)
    if inv is None:
        inv = _INVERSES[key] = torch.full((1,), 1.0 / n, dtype=torch.float32, device=device)
    return inv


_INVERSES: dict[tuple[int, torch.device], torch.Tensor] = {}


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
    deferred: DeferredStores | None = None,
    kept_row: torch.Tensor | None = None,
    results_dtype: torch.dtype | None = None,
) -> BufferedReduce:
    """Copy every member's gradient (``grad_of``, as in :func:`reduce_in_place`; zeros where it has none)
    into rank-major rows with the flags and reduce-scatter them.  Call it on the stream the copies should run
    on (stage 3: inside ``streams.reduce()``); ``streams`` is where the completion runs.  ``deferred``: where
    the completion hands the summed flags ([Note: deferred has-gradient flags]).  ``kept_row``: this rank's
    output row, the caller's (stage 3: fresh, its results kept as views, cast first into ``results_dtype``
    where given), else one from ``buffers``."""
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
    if kept_row is not None:
        assert kept_row.numel() == width + k and kept_row.dtype == dtype, "reduced row: layout mismatch"
        out = kept_row
    else:
        out = buffers.take(width + k, dtype, buf.device)
    averaged = comm.averages_in_reduce_scatter  # [Note: averaging in the collective]
    work = comm.reduce_scatter(out, buf.view(-1), op="avg" if averaged else "sum", async_op=True, tag=tag)
    return BufferedReduce(
        comm,
        members,
        offsets,
        width,
        buf,
        out,
        work,
        buffers,
        streams,
        sources,
        local,
        averaged,
        deferred=deferred,
        kept=kept_row is not None,
        results_dtype=results_dtype if kept_row is not None else None,
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


# -- the layout of one Comm ---------------------------------------------------------------------------------
class Layout:
    """One of the two collective layouts ([Note: collective layouts]), chosen once per ``Comm``
    (:func:`layout_of`): the entry of a unit's gather, of the parameter sync after a stages 1-2 step and of
    every sharded reduction.  Whatever a launch returns completes the same way in both
    (``complete(what, ends)`` / ``complete(what, store)``)."""

    def gather(self, comm: Comm, members: list, ends: GatherEnds, buffers: Buffers = FRESH, tag: str = "") -> list:
        """Gather the members' shards into their full tensors (the members with elements; the zero-size ones
        take part in no collective); the records in flight."""
        raise NotImplementedError

    def reduce(
        self,
        comm: Comm,
        members: list,
        dtype: torch.dtype,
        device: torch.device,
        release_grads: bool,
        grad_of: Callable[[Any], torch.Tensor | None] = _param_grad,
        tag: str = "",
        buffers: Buffers = FRESH,
        streams: StreamSet = NO_STREAMS,
        deferred: DeferredStores | None = None,
        kept_row: torch.Tensor | None = None,
        results_dtype: torch.dtype | None = None,
    ) -> InPlaceReduce | BufferedReduce:
        """Average the members' gradients over the ranks, each rank keeping its own part: the arguments of
        :func:`reduce_buffered`, of which the in-place layout uses the first ones (it needs no buffer, runs on
        no side stream and reads its flags on the host at completion)."""
        raise NotImplementedError

    # Whether a parameter sync after the step may run bucket by bucket behind the optimizer, each bucket's
    # gather in flight while the next one steps ([Note: pipelined step] in ``optim/pipelined_step.py``): in
    # place only, where a gather holds no buffer however many are in flight; a buffered sync runs after
    # the whole step (:meth:`gather_all`).
    gathers_while_stepping: bool

    # Whether a unit's shards can be kept laid out as its all-gather's input, so that a gather copies nothing
    # in ([Note: flat shards] in ``stage3/unit.py``; :meth:`gather_input`): buffered only.
    flat_gather_input: bool

    def gather_all(
        self,
        comm: Comm,
        members: list,
        buckets: Sequence[list],
        ends: GatherEnds,
        what: str,
        max_pending: int,
        tag: str = "",
    ) -> None:
        """Synchronous: every rank's regions of ``members`` (in their order; ``buckets`` partitions them) into
        their full tensors, batched as this layout batches the stages 1-2 parameter sync after the step
        (``engines/param_sync.py``): in place one collective of every member; buffered bucket by bucket, at
        most ``max_pending`` launched buckets waiting when the next is launched (each holds its rows until it
        completes).  Every member takes part, also one without elements: unlike :meth:`gather`, a bucket of
        zero-size members still issues its (empty) all-gather."""
        raise NotImplementedError

    def gather_footprint(
        self, world_size: int, width: int, full_numel: int, itemsize: int, laid_out: bool = False
    ) -> Footprint:
        """[Note: collective footprints] of one collective of :meth:`gather` (buffered: one ``GatherRow``):
        members whose padded chunks and trailer take ``width`` elements per rank and whose full tensors
        ``full_numel`` elements (0: the full tensors exist already, the stages 1-2 sync), ``itemsize`` bytes
        each; ``laid_out``: the input is the caller's (``GatherRow.laid_out``), not taken from the buffers."""
        raise NotImplementedError

    def gather_all_footprints(self, world_size: int, widths: Sequence[int], itemsize: int) -> list[Footprint]:
        """[Note: collective footprints] of :meth:`gather_all` over buckets of ``widths`` elements per rank, in
        launch order; a caller replaying it keeps at most ``max_pending`` launched ones waiting when the next
        is launched, as :meth:`gather_all` does.  Empty where the sync holds nothing."""
        raise NotImplementedError

    def reduce_footprint(
        self,
        world_size: int,
        width: int,
        numel: int,
        itemsize: int,
        reduce_itemsize: int,
        release_grads: bool,
        side_streams: bool = False,
    ) -> Footprint:
        """[Note: collective footprints] of :meth:`reduce`: members whose full gradients (``itemsize`` bytes
        an element) take ``numel`` elements, reduced in ``reduce_itemsize`` bytes an element (a cast where
        the two differ), ``width`` elements per rank in the buffered rows (padded chunks, then the flags);
        ``release_grads`` as :meth:`reduce` takes it.  ``side_streams``: ``streams.overlaps`` of the call (stage
        3 on CUDA): a buffered reduction then holds the released gradients until its completion
        (``BufferedReduce.sources``, step 3 of [Note: side streams] in ``streams.py``)."""
        raise NotImplementedError

    def side_streams(self, streams: StreamSet) -> StreamSet:
        """The side streams this layout's collectives and copies run on ([Note: side streams] in
        ``streams.py``): ``streams`` when buffered, none in place (gloo: CPU tensors, nothing to overlap)."""
        raise NotImplementedError

    def gather_input(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A zeroed tensor of ``numel`` elements to keep shards in, laid out as this layout's gather input
        (stage 3's flat shards: [Note: flat shards] in ``stage3/unit.py``); None where the layout gathers
        from each member's own region (in place)."""
        raise NotImplementedError

    def gather_spans(self, comm: Comm, flat: torch.Tensor, spans: Sequence[tuple[int, int]], tag: str = "") -> None:
        """Synchronous: ``spans[r]`` is the ``[a, b)`` of ``flat`` that rank r holds up to date (this rank's is
        written already; the same spans on every rank); afterwards every rank's ``flat`` holds all of them
        (stage 3's row-slices, [Note: sliced linear units] in ``stage3/sliced.py``)."""
        raise NotImplementedError

    def gather_shards(
        self, comm: Comm, local: torch.Tensor, layout: ShardLayout, device: torch.device, tag: str = ""
    ) -> torch.Tensor:
        """Synchronous: every rank's ``local`` region (flat) of one tensor sharded as ``layout``, as one flat
        tensor on ``device`` of at least ``layout.numel`` elements, the values first (state dicts)."""
        raise NotImplementedError

    def kept_row(self, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A fresh output row of ``width`` elements for a reduction whose results the caller keeps as views
        ([Note: reduced rows kept] in ``stage3/unit.py``), allocated on the current stream; None where the
        layout has no output row (in place: a result is a region of a full gradient)."""
        raise NotImplementedError


class _InPlace(Layout):
    """gloo: regions broadcast into the full tensors, gradients summed in place."""

    gathers_while_stepping = True
    flat_gather_input = False

    def gather(self, comm, members, ends, buffers=FRESH, tag=""):
        opened = [m for m in members if m.layout.numel]
        return [gather_in_place(comm, opened, ends.open_full(opened), tag=tag)]

    def gather_all(self, comm, members, buckets, ends, what, max_pending, tag=""):
        """One collective: it holds no buffer, so nothing bounds it, and its point-to-point transfers all go
        at once ([Note: point-to-point exchange] in ``collectives.py``)."""
        finish(gather_in_place(comm, members, ends.open_full(members), tag=tag), what, ends)

    def reduce(self, comm, members, dtype, device, release_grads, grad_of=_param_grad, tag="", **_buffered):
        return reduce_in_place(comm, members, dtype, device, release_grads, tag=tag, grad_of=grad_of)

    def gather_spans(self, comm, flat, spans, tag=""):
        comm.gather_regions([[flat[a:b]] for a, b in spans], tag=tag)

    def gather_shards(self, comm, local, layout, device, tag=""):
        """Each rank's region broadcast straight into the result, so nothing but the result is allocated:
        gloo's worker thread may drop its reference to a collective's tensors after ``wait`` returns, and a
        temporary it still holds would outlive the call."""
        full = torch.empty(layout.numel, dtype=local.dtype, device=device)
        lo, hi = layout.bounds()
        full[lo:hi].copy_(local[: hi - lo])
        comm.gather_regions(
            [[full.narrow(0, a, b - a)] for a, b in map(layout.bounds, range(comm.world_size))], tag=tag
        )
        return full

    def gather_footprint(self, world_size, width, full_numel, itemsize, laid_out=False):
        """The full tensors, opened at the launch (``GatherEnds.open_full``); no buffer."""
        return Footprint(launch=_steps(("gathered", full_numel * itemsize)))

    def gather_all_footprints(self, world_size, widths, itemsize):
        """One collective into the parameters themselves: nothing held."""
        return []

    def reduce_footprint(self, world_size, width, numel, itemsize, reduce_itemsize, release_grads, side_streams=False):
        """The gradients summed where they are, or a copy in the reduce dtype (a released gradient then goes
        at the launch: the copy is what the record holds).  No side streams (``side_streams`` does not apply).
        Left out: the temporary of ``world_size - 1`` times this rank's regions that the peers' contributions
        arrive in (``Comm.reduce_in_place``), until the wait; the planner's measurements ([Note: collective
        buffers]) do not count it either, and ``tests/unit/test_layout_footprint.py`` checks its size apart."""
        cast = numel * reduce_itemsize if reduce_itemsize != itemsize else 0
        grads = numel * itemsize if release_grads else 0
        return Footprint(
            launch=_steps(("buffers", cast), ("grads", -grads if cast else 0)),
            complete=_steps(("grads", 0 if cast else -grads), ("buffers", -cast)),
        )

    def side_streams(self, streams):
        return NO_STREAMS

    def gather_input(self, numel, dtype, device):
        return None

    def kept_row(self, width, dtype, device):
        return None


class _Buffered(Layout):
    """NCCL (and the fake group; gloo under ``ZERO_PLUGIN_BUFFERED_COLLECTIVES=1``): rank-major rows."""

    gathers_while_stepping = False
    flat_gather_input = True

    def gather(self, comm, members, ends, buffers=FRESH, tag=""):
        return [_gather_row(comm, row, ends, buffers, tag) for row in ends.rows([m for m in members if m.layout.numel])]

    def gather_all(self, comm, members, buckets, ends, what, max_pending, tag=""):
        """Bucket by bucket: the copy-in of one overlaps the collectives of those before it, while the rows
        alive stay bounded."""
        pending: list[BufferedGather] = []
        for bucket in buckets:
            for row in ends.rows(bucket):
                pending.append(_gather_row(comm, row, ends, FRESH, tag))
                if len(pending) > max_pending:
                    finish(pending.pop(0), what, ends)
        for record in pending:
            finish(record, what, ends)

    def reduce(self, comm, members, dtype, device, release_grads, grad_of=_param_grad, tag="", **buffered):
        return reduce_buffered(comm, members, dtype, device, release_grads, tag=tag, grad_of=grad_of, **buffered)

    def gather_spans(self, comm, flat, spans, tag=""):
        """Each rank's span padded to the longest, all-gathered as rows, copied out span by span."""
        own_a, own_b = spans[comm.rank]
        width = max(b - a for a, b in spans)
        inp = flat.new_zeros(width)
        inp[: own_b - own_a].copy_(flat[own_a:own_b])
        rows = flat.new_empty(comm.world_size, width)
        comm.all_gather(rows.view(-1), inp, tag=tag)
        for r, (a, b) in enumerate(spans):
            flat[a:b].copy_(rows[r, : b - a])

    def gather_shards(self, comm, local, layout, device, tag=""):
        """The padded chunks all-gathered rank-major on ``device``: the full tensor, then the padding."""
        padded = torch.zeros(layout.shard_numel, dtype=local.dtype, device=device)
        padded[: local.numel()].copy_(local)
        out = torch.empty(layout.padded_numel, dtype=local.dtype, device=device)
        comm.all_gather(out, padded, tag=tag)
        return out

    def gather_footprint(self, world_size, width, full_numel, itemsize, laid_out=False):
        """Input (unless laid out) and output rows at the launch; the full tensors written by ``copy_out``
        while the rows are alive, then the rows go back."""
        inp = width * itemsize
        rows = world_size * inp + (0 if laid_out else inp)
        return Footprint(
            launch=_steps(("buffers", rows)),
            complete=_steps(("gathered", full_numel * itemsize), ("buffers", -rows)),
            staged=world_size * inp,
        )

    def gather_all_footprints(self, world_size, widths, itemsize):
        return [self.gather_footprint(world_size, width, 0, itemsize) for width in widths]

    def reduce_footprint(self, world_size, width, numel, itemsize, reduce_itemsize, release_grads, side_streams=False):
        """The rank-major input rows, the released gradients (at the completion where a side stream reads
        them), then this rank's output row; both rows go at the completion."""
        row = width * reduce_itemsize
        released = -numel * itemsize if release_grads else 0
        return Footprint(
            launch=_steps(("buffers", world_size * row), ("grads", 0 if side_streams else released)),
            complete=_steps(("grads", released if side_streams else 0), ("buffers", -(world_size * row + row))),
            output=row,
        )

    def side_streams(self, streams):
        return streams

    def gather_input(self, numel, dtype, device):
        return torch.zeros(numel, dtype=dtype, device=device)

    def kept_row(self, width, dtype, device):
        return torch.empty(width, dtype=dtype, device=device)


def _gather_row(comm: Comm, row: GatherRow, ends: GatherEnds, buffers: Buffers, tag: str) -> BufferedGather:
    return gather_buffered(comm, row.members, row.dtype, row.device, ends.fill, buffers, row.trailer, tag, row.laid_out)


def finish(record: InPlaceGather | BufferedGather, what: str, ends: GatherEnds) -> None:
    """A gather launched off any side stream, completed and its buffers let go."""
    record.complete(what, ends)
    record.release()


IN_PLACE: Layout = _InPlace()
BUFFERED: Layout = _Buffered()


def layout_for(backend: str) -> Layout:
    """The layout a ``Comm`` on ``backend`` chooses ([Note: in-place region gather] in ``collectives.py``),
    for those that plan without one (``planner/replay.py``)."""
    return IN_PLACE if regions_in_place(backend) else BUFFERED


def layout_of(comm: Comm) -> Layout:
    """The layout of ``comm``'s sharded collectives: the one place the choice is read
    (``Comm.gathers_regions_in_place``, [Note: in-place region gather] in ``collectives.py``)."""
    return IN_PLACE if comm.gathers_regions_in_place else BUFFERED
