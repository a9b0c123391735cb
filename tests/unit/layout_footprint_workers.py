"""Workers for test_layout_footprint.py: each collective layout's pipelines run on a gloo group, and what they
allocate compared with the ``Footprint`` the layout describes ([Note: collective footprints] in
zero_plugin/comm/layout.py).

What a pipeline holds is read from the live tensors (every ``torch.Tensor`` the garbage collector tracks, one
entry per storage) before the launch, when it returned, and after the completion with its record dropped:
the storages that appeared or went, by part: ``gathered`` (the members' full tensors), ``grads`` (the
members' gradients), ``temp`` (the peers' rows ``Comm.reduce_in_place`` receives into), ``flags`` (the
in-place reduction's host flags, which no footprint counts: a few bytes) and ``buffers`` (the rest).  Each
pipeline runs once before it is measured, so that the caches it fills once (``_all_present``) are there."""

from __future__ import annotations

import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tests.unit.memory_comm_workers import all_live_tensors
from zero_plugin.comm.collectives import Comm
from zero_plugin.comm.layout import (
    BUFFERED,
    IN_PLACE,
    GatherRow,
    all_reduce_filled,
    all_reduce_flat,
    all_reduce_footprint,
)
from zero_plugin.comm.streams import NO_STREAMS, StreamSet
from zero_plugin.tensors.flat import ShardLayout

SIZES = (105, 7 * 15, 5, 64)  # odd sizes: padded shards, a region empty on the last ranks at 4 ranks
LAYOUTS = {"in_place": IN_PLACE, "buffered": BUFFERED}


class _Member:
    """What a collective serves: ``.param`` and ``.layout``; ``local`` is this rank's region, ``full`` the
    gathered tensor."""

    def __init__(self, numel: int, comm: Comm, dtype: torch.dtype) -> None:
        self.layout = ShardLayout(numel, comm.world_size, comm.rank)
        self.param = torch.nn.Parameter(torch.zeros(numel, dtype=dtype))
        self.local = torch.full((self.layout.local_numel,), float(comm.rank + 1), dtype=dtype)
        self.full: torch.Tensor | None = None


class _Ends:
    """A gather's ends as stage 3's unit has them: full tensors opened at the launch (in place) or written
    from the rows at the completion (buffered); ``existing``: the full tensors are there already (the stages
    1-2 sync), nothing is allocated for them.  ``probe`` runs before each completion hands its values over;
    ``laid_out``: the buffered input as the caller keeps it (stage 3's flat shards)."""

    def __init__(self, dtype: torch.dtype, existing: bool = False, probe=lambda: None, laid_out=None) -> None:
        self.dtype, self.existing, self.probe, self.laid_out = dtype, existing, probe, laid_out

    def _open(self, member: _Member) -> torch.Tensor:
        if member.full is None or not self.existing:
            member.full = torch.empty(member.layout.numel, dtype=self.dtype)
        return member.full

    def open_full(self, members):
        fulls = [self._open(m) for m in members]
        for m, full in zip(members, fulls):
            lo, hi = m.layout.bounds()
            full[lo:hi].copy_(m.local)
        return fulls

    def rows(self, members):
        yield GatherRow(self.dtype, torch.device("cpu"), members, (), self.laid_out)

    def fill(self, members, chunks, extra):
        for m, chunk in zip(members, chunks):
            chunk.zero_()[: m.local.numel()].copy_(m.local)
        for dst, src in extra:
            dst.copy_(src)

    def expose(self, members):
        self.probe()

    def copy_out(self, record, rows):
        self.probe()
        for m, columns in record.columns(rows):
            full = self._open(m)
            full.copy_(columns.reshape(-1)[: m.layout.numel])


def _id(tensor: torch.Tensor) -> int:
    """A storage's identity: its ``StorageImpl``, which a weak reference keeps from being reused."""
    return tensor.untyped_storage()._cdata


# [Note: views repeated until they agree]
# A tensor can go a few milliseconds after the call that let it go returned: a gloo thread drops the last
# reference to a finished work's tensors and frees them once it gets the GIL.  A view used to take ~0.3 s (a
# walk of every object of the preloaded modules, now frozen: [Note: the preloaded heap frozen in each worker]
# in tests/harness.py) and always came after that; a fast one is taken again after ``_SETTLE_S`` until two
# views agree (without it the cases failed at random, a freed buffer counted in the next phase).
_SETTLE_S, _SETTLE_TRIES = 0.01, 100


def _view() -> dict[int, tuple[int, StorageWeakRef]]:
    out = {}
    for tensor in all_live_tensors():
        storage = tensor.untyped_storage()
        if storage.nbytes():
            out[storage._cdata] = (storage.nbytes(), StorageWeakRef(storage))
    return out


def _live() -> dict[int, tuple[int, StorageWeakRef]]:
    """Every storage a live tensor holds: its identity -> (bytes, a weak reference to it); taken again
    ``_SETTLE_S`` later until two views agree ([Note: views repeated until they agree])."""
    view = _view()
    for _ in range(_SETTLE_TRIES):
        time.sleep(_SETTLE_S)
        again = _view()
        if again.keys() == view.keys():
            return again
        view = again
    raise AssertionError(f"the live tensors still changed after {_SETTLE_TRIES} views {_SETTLE_S} s apart")


def _delta(before: dict, after: dict, part_of) -> dict[str, int]:
    """Bytes by part of the storages that appeared (+) or went (-) between two views of the live tensors
    (their weak references hold each ``StorageImpl``: an identity is never another storage's)."""
    out: dict[str, int] = {}
    for key, (nbytes, _) in after.items():
        if key not in before:
            out[part_of(key)] = out.get(part_of(key), 0) + nbytes
    for key, (nbytes, _) in before.items():
        if key not in after:
            out[part_of(key)] = out.get(part_of(key), 0) - nbytes
    return {part: nbytes for part, nbytes in out.items() if nbytes}


def _parts(members: list[_Member], grads: dict[int, int], flags: set[int], temps: set[int]):
    def part_of(ptr: int) -> str:
        if any(m.full is not None and _id(m.full) == ptr for m in members):
            return "gathered"
        if ptr in grads:
            return "grads"
        return "flags" if ptr in flags else "temp" if ptr in temps else "buffers"

    return part_of


# -- the pipelines ----------------------------------------------------------------------------------------
def _twice(run, *args):
    """The second of two runs, each in its own frame (nothing of the first is alive in the second): the
    first fills the caches."""
    run(*args)
    return run(*args)


def gather_worker(layout_name: str, dtype_name: str, laid_out: bool = False) -> list[tuple]:
    """A stage-3 gather (``Layout.gather``): (measured, described) at the launch and at the completion;
    ``laid_out``: from the caller's flat shards ([Note: flat shards] in stage3/unit.py; buffered only)."""
    return _twice(_gather, Comm(), LAYOUTS[layout_name], getattr(torch, dtype_name), laid_out)


def _gather(comm: Comm, layout, dtype: torch.dtype, laid_out: bool) -> list[tuple]:
    members = [_Member(numel, comm, dtype) for numel in SIZES]
    width = sum(m.layout.shard_numel for m in members)
    flat = layout.gather_input(width, dtype, torch.device("cpu")) if laid_out else None
    if flat is not None:
        _Ends(dtype).fill(members, [flat[off : off + m.layout.shard_numel] for m, off in _offsets(members)], [])
    ends = _Ends(dtype, laid_out=flat)
    part_of = _parts(members, {}, set(), set())
    before = _live()
    records = layout.gather(comm, members, ends)
    launched = _live()
    for record in records:
        record.complete("footprint test", ends)
        record.release()
    del records, record
    done = _live()
    assert all(
        torch.equal(m.full[m.layout.bounds(r)[0] : m.layout.bounds(r)[1]], _filled(m, r))
        for m in members
        for r in range(comm.world_size)
    )
    fp = layout.gather_footprint(comm.world_size, width, sum(SIZES), dtype.itemsize, laid_out=laid_out)
    return [(_delta(before, launched, part_of), _delta(launched, done, part_of)), fp.held()]


def _packed(sizes) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def _offsets(members: list[_Member]):
    off = 0
    for m in members:
        yield m, off
        off += m.layout.shard_numel


def _filled(member: _Member, rank: int) -> torch.Tensor:
    lo, hi = member.layout.bounds(rank)
    return torch.full((hi - lo,), float(rank + 1), dtype=member.local.dtype)


class _SideStreams(StreamSet):
    """Side streams as CUDA has them, for what a reduction holds (``overlaps``: the gradients a side stream
    reads are kept until the completion); the streams themselves are the no-op ones of the CPU."""

    overlaps = True


def reduce_worker(
    layout_name: str, dtype_name: str, reduce_dtype_name: str, release: bool, side_streams: bool = False
) -> list[tuple]:
    """A reduction (``Layout.reduce``) of every member's gradient: (measured, described)."""
    dtype, reduce_dtype = getattr(torch, dtype_name), getattr(torch, reduce_dtype_name)
    return _twice(_reduce, Comm(), LAYOUTS[layout_name], dtype, reduce_dtype, release, side_streams)


def _reduce(
    comm: Comm, layout, dtype: torch.dtype, reduce_dtype: torch.dtype, release: bool, side_streams: bool
) -> list[tuple]:
    members = [_Member(numel, comm, dtype) for numel in SIZES]
    for m in members:
        m.param.grad = torch.ones(m.layout.numel, dtype=dtype)
    grads = {_id(m.param.grad): m.layout.numel for m in members}
    streams = _SideStreams() if side_streams else NO_STREAMS
    before = _live()
    record = layout.reduce(comm, members, reduce_dtype, torch.device("cpu"), release_grads=release, streams=streams)
    launched = _live()
    flags = {_id(record.flags)} if layout is IN_PLACE else set()
    temps, received = set(), 0
    if layout is IN_PLACE and comm.world_size > 1:
        # The peers' contributions to this rank's regions (``Comm.reduce_in_place``), held until the
        # wait: not in the footprint, as the replay's measurements ([Note: collective buffers]) have it.
        cast = {_id(g) for g in record.grads}
        temps = {ptr for ptr in launched if ptr not in before and ptr not in flags and ptr not in cast}
        received = (comm.world_size - 1) * sum(m.layout.local_numel for m in members) * reduce_dtype.itemsize
    part_of = _parts(members, grads, flags, temps)
    record.complete("footprint test", lambda member, reduced: None)
    del record
    done = _live()
    width = sum(m.layout.shard_numel for m in members) + len(members)
    fp = layout.reduce_footprint(
        comm.world_size, width, sum(SIZES), dtype.itemsize, reduce_dtype.itemsize, release, side_streams
    )
    launch, complete = fp.held()
    if received:
        launch["temp"], complete["temp"] = received, -received
    if layout is IN_PLACE:  # the host flags, one float32 per member
        launch["flags"], complete["flags"] = 4 * len(members), -4 * len(members)
    return [(_delta(before, launched, part_of), _delta(launched, done, part_of)), (launch, complete)]


def all_reduce_worker(dtype_name: str, filled: bool = False) -> list[tuple]:
    """Stage 0's flat all-reduce on every layout (``all_reduce_flat``; ``filled``: ``all_reduce_filled`` of
    the bucket's persistent buffer, its gradients' views): (measured, described)."""
    return _twice(_all_reduce, Comm(), getattr(torch, dtype_name), filled)


def _all_reduce(comm: Comm, dtype: torch.dtype, filled: bool) -> list[tuple]:
    members = [_Member(numel, comm, dtype) for numel in SIZES]
    width = sum(SIZES)
    buffer = torch.ones(width + len(members), dtype=dtype) if filled else None
    offsets = _packed(SIZES)
    for m, off in zip(members, offsets):
        m.layout = ShardLayout(m.layout.numel, 1, 0)  # stage 0: members whole
        m.param.grad = buffer[off : off + m.layout.numel] if filled else torch.ones(m.layout.numel, dtype=dtype)
    grads = {_id(m.param.grad): 0 for m in members}
    part_of = _parts(members, grads, set(), set())
    before = _live()
    if filled:
        record = all_reduce_filled(comm, members, buffer, width)
    else:
        record = all_reduce_flat(comm, members, dtype, torch.device("cpu"))
    launched = _live()
    record.complete("footprint test", lambda member, reduced: None)
    del record
    done = _live()
    fp = all_reduce_footprint(width + len(SIZES), dtype.itemsize, filled=filled)
    return [(_delta(before, launched, part_of), _delta(launched, done, part_of)), fp.held()]


def gather_all_worker(layout_name: str, dtype_name: str, max_pending: int) -> tuple[list, list]:
    """The stages 1-2 sync (``Layout.gather_all``), one bucket per member: the buffers alive at each
    completion, measured and as its footprints with the pending bound replayed."""
    comm, layout, dtype = Comm(), LAYOUTS[layout_name], getattr(torch, dtype_name)
    members = [_Member(numel, comm, dtype) for numel in SIZES]
    measured: list[int] = []
    ends = _Ends(dtype, existing=True)
    ends.open_full(members)  # the parameters: there before the sync
    before: dict[int, int] = {}
    ends.probe = lambda: measured.append(sum(_delta(before, _live(), lambda ptr: "buffers").values()))
    layout.gather_all(comm, members, [[m] for m in members], ends, "footprint test", max_pending)  # warm
    measured.clear()
    before.update(_live())
    layout.gather_all(comm, members, [[m] for m in members], ends, "footprint test", max_pending)
    widths = [m.layout.shard_numel for m in members]
    described, pending = [], []
    for fp in layout.gather_all_footprints(comm.world_size, widths, dtype.itemsize):
        pending.append(fp)
        if len(pending) > max_pending:
            described.append(sum(sum(f.held()[0].values()) for f in pending))
            pending.pop(0)
    for _ in pending:  # the last ones complete in a loop over the list: every one alive until the end
        described.append(sum(sum(f.held()[0].values()) for f in pending))
    if layout is IN_PLACE:  # one collective, exposed once
        described = [0]
    return measured, described
