"""The only module that talks to torch.distributed.

Every collective the engine issues goes through :class:`Comm`, which counts
calls and *logical* bytes per collective kind for :func:`zero_plugin.comm_stats`.

[Note: logical bytes]
We count what the ZeRO paper (arXiv 1910.02054, section 7) counts as the
per-rank volume of each primitive, measured on the full buffer:
  * all_reduce of n elements          -> 2n elements (reduce-scatter + all-gather)
  * reduce_scatter with n inputs      -> n elements
  * all_gather with n outputs         -> n elements
  * broadcast of n elements           -> n elements
So DDP moves 2Ψ per step, ZeRO-1/2 move Ψ (reduce-scatter) + Ψ (all-gather)
= 2Ψ, and ZeRO-3 moves 3Ψ.  gloo sends a reduce-scatter as an all-reduce on the
wire; the logical count is what we hold against theory.

[Note: in-place region gather]
On gloo an all-gather copies twice (into gloo's own flat temporary, then into the output) and needs a
rank-major buffer filled and emptied by the caller; sending each rank's region straight into the
destination tensors moves the same bytes with no copy and no temporary (``Comm.gather_regions``), and
gradients are summed in place with each rank keeping its region (``Comm.reduce_in_place``).  NCCL keeps
the all-gather and the reduce-scatter (one launch instead of N per tensor, and real wire savings).
``ZERO_PLUGIN_BUFFERED_COLLECTIVES=1`` forces the buffered (NCCL) layout on gloo, which is how the CPU
tests cover it; ``regions_in_place`` is the one place that decides, and the memory planner asks it too.
Both layouts are laid out in ``comm/layout.py`` ([Note: collective layouts]).

[Note: point-to-point exchange]
The in-place layout moves its regions with ``isend``/``irecv`` pairs between every two ranks, not with
gloo's collectives.  gloo runs a group's collectives one after another on one worker thread, and sends a
reduce-scatter as a whole all-reduce; point-to-point transfers run on its transport threads, in both
directions at once.  So a gather sends each region once to each peer while receiving theirs (instead of
one broadcast per rank and region, in turn), and a reduce-scatter sends each peer only that peer's region
of the gradients and adds what the peers sent for its own (``works.SumWork``, in rank order; at two ranks
bit for bit gloo's all-reduce, since addition commutes): half the bytes of the all-reduce it replaces.
Measured on one decoder layer of ``blocks34m`` (12 MiB, 9 tensors, 2 ranks, 1 thread each): gather 4.0-6.4
ms against 7.6-12.5 ms as broadcasts, reduce-scatter 6.5-6.8 ms against 13.0-13.5 ms as an all-reduce.
Messages between two ranks of a group are matched in the order they were issued, so every rank issues
its sends and receives peer by peer in rank order and, per peer, in the order of the region lists, which
are the same on every rank; the logical counts are those of the collective replaced ([Note: logical
bytes]).

[Note: control channel]
A second gloo group over the same ranks (``Comm.open_control_channel``), for small blocking exchanges
that must not queue behind the payload collectives in flight on the main group (gloo runs a group's
collectives in order), e.g. stage 3's check that every rank gathers the same unit before any payload is
sent.  Host-only, so on NCCL it costs no device synchronisation.  Collective: every rank of the group
opens it at the same point (setup).  One channel per group, shared by engines; like the sibling groups
(``Comm.sibling``) it is cached per (ranks, purpose) while the default group lives, and
:func:`release_groups` drops the cache when the default group is destroyed.  A shard group's channel
([Note: hierarchical groups]) spans the whole world: what ranks agree on there (stage 3's unit order, late
gradients, state-dict calls) must hold across replicas too, whose reductions pair up with each other.

[Note: hierarchical groups]
``ZeroConfig.shard_group_size=k`` (HSDP, MiCS): ``Comm.split(k)`` makes the shard groups (k consecutive
ranks) and the replica groups (the ranks with the same index in every shard group) and returns this
rank's shard group as a Comm that the engine uses exactly as it uses the whole world otherwise (its rank
and world_size are the shard group's).  The shard Comm carries ``replica`` (the replica group's Comm, used
only to sum reduced shards across replicas: ``comm_layout``'s completions) and ``world`` (the whole
group, for what every rank must share: setup broadcasts, edits from a ``modifier_rank``, rank-0-only
results).  Without a split ``replica`` is None and ``world`` is the Comm itself.  Each Comm made by a
split has a ``label`` ("shard" / "replica"): besides the per-kind counts (every group together, as
before), ``comm_stats`` then has ``shard_group`` and ``replica_group`` entries, the calls and logical
bytes of each (intra- and inter-group traffic; control traffic in neither); ``total`` sums the kinds only.
"""

from __future__ import annotations

from collections import deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# The counters, the group cache and the work handles live in their own modules (stats, groups, works), which
# Comm's methods name as modules.  comm_stats, reset_comm_stats, physical_calls and release_groups are
# re-exported for code that imports them from here.
from . import groups, stats, works
from .backends import backend_uses_cuda, moves_data, reduce_scatter_averages, regions_in_place
from .groups import release_groups
from .stats import comm_stats, physical_calls, reset_comm_stats

__all__ = [
    "Comm",
    "backend_uses_cuda",
    "comm_stats",
    "physical_calls",
    "regions_in_place",
    "release_groups",
    "reset_comm_stats",
]


# torch >= 2.13 renamed the tensor collectives; older releases only have the old names.
_ALL_GATHER_NAME = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_REDUCE_SCATTER_NAME = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
_ALL_GATHER = getattr(dist, _ALL_GATHER_NAME)
_REDUCE_SCATTER = getattr(dist, _REDUCE_SCATTER_NAME)


# [Note: point-to-point exchange]: a tag of our own, so that a user's sends and receives on the same group (tag 0
# by default) never pair with ours.
_P2P_TAG = 0x5A50


def _peer_rows(mine: list[torch.Tensor], peers: int) -> list[list[torch.Tensor]]:
    """For each of ``peers`` peers, tensors shaped like ``mine``: views of one fresh buffer, freed with them."""
    if not mine:
        return [[] for _ in range(peers)]
    scratch = torch.empty(peers * sum(t.numel() for t in mine), dtype=mine[0].dtype, device=mine[0].device)
    rows, offset = [], 0
    for _ in range(peers):
        row = []
        for t in mine:
            row.append(scratch[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        rows.append(row)
    return rows


class Comm:
    """Collectives over one process group.  ``group=None`` means the default group.

    Works without an initialised process group as a one-rank world, so that a
    single-process script can run ``zp.setup`` unchanged.
    """

    def __init__(
        self, group: Any = None, timeout_s: float | None = None, debug: bool = False, label: str | None = None
    ) -> None:
        # Held weakly, like every group of ours: [Note: cached groups at exit] in groups.py.
        self._group = None if group is None else groups.weak(group)
        self.label = label  # "shard" / "replica" after a split: [Note: hierarchical groups]
        self.world: Comm = self  # the whole group: itself unless made by split()
        self.replica: Comm | None = None  # the replica group of a shard group
        self.timeout_s = timeout_s
        # debug_collectives: the last collectives this rank issued, quoted when one fails.
        self.history: deque | None = deque(maxlen=32) if debug else None
        self.initialized = dist.is_available() and dist.is_initialized()
        if self.initialized:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.backend = dist.get_backend(group)
            if self.world_size > 1:
                groups.release_groups_at_exit()  # [Note: cached groups at exit]
        else:
            self.rank, self.world_size, self.backend = 0, 1, "none"
        self._in_place = regions_in_place(self.backend)  # [Note: in-place region gather]
        self._control: Any = None  # a weak reference to the control channel: [Note: control channel]

    @property
    def group(self) -> Any:
        """The process group; None is the default group, which torch looks up at each call."""
        return None if self._group is None else groups.live(self._group, "process group")

    @property
    def device(self) -> torch.device:
        """Where this group's collectives run, and so where stage 3 gathers and computes: the current CUDA
        device where the backend moves CUDA tensors (``backend_uses_cuda``), else the CPU."""
        if backend_uses_cuda(self.backend):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def averages_in_reduce_scatter(self) -> bool:
        """Whether a reduction's reduce-scatter averages by itself ([Note: averaging in the collective] in
        ``layout.py``): NCCL's ``ReduceOp.AVG`` (and the fake group that stands in for it; gloo in the NCCL
        layout emulates it, so that the tests run that path), over the whole data-parallel group (no replica
        group to sum over after it)."""
        emulated = self.backend == "gloo" and not self._in_place  # the NCCL layout on gloo, for tests
        return (reduce_scatter_averages(self.backend) or emulated) and self.replica is None

    @property
    def moves_data(self) -> bool:
        """False on torch's fake process group, whose collectives move nothing (``backends.moves_data``)."""
        return moves_data(self.backend)

    # -- hierarchical groups --------------------------------------------------
    @property
    def dp_size(self) -> int:
        """Ranks whose gradients a reduction averages: this group's, times the replicas' (HSDP)."""
        return self.world_size * (self.replica.world_size if self.replica is not None else 1)

    @property
    def control_size(self) -> int:
        """Ranks the control channel spans ([Note: control channel]): the whole world, also for a shard group."""
        return self.world.world_size

    def split(self, shard_size: int) -> Comm:
        """This rank's shard group of ``shard_size`` consecutive ranks, with its replica group
        ([Note: hierarchical groups]).  Collective over the default group at setup: every rank makes every
        group, in the same order; cached like the control channel."""
        assert self._group is None and self.world_size % shard_size == 0, "split: default group, k | N"
        n, k = self.world_size, shard_size
        shards = [tuple(range(g * k, (g + 1) * k)) for g in range(n // k)]
        replicas = [tuple(range(i, n, k)) for i in range(k)]
        mine = []  # this rank's shard group, then its replica group
        for ranks in shards + replicas:
            group = self._cached_group(ranks, "split", self.backend, local=False)
            if self.rank in ranks:
                mine.append(group)
        shard = Comm(mine[0], timeout_s=self.timeout_s, label="shard")
        shard.replica = Comm(mine[1], timeout_s=self.timeout_s, label="replica")
        shard.world = self
        shard.history = shard.replica.history = self.history
        shard._in_place = shard.replica._in_place = self._in_place
        return shard

    def node_group(self, k: int, label: str = "secondary") -> Comm:
        """This rank's group of ``k`` consecutive ranks (hpZ's secondary shards: [Note: secondary shards] in
        stage3/secondary.py; ``label="sequence"``: Ulysses' sequence-parallel groups, [Note: sequence-parallel
        groups] in sequence/parallel.py), one group per ``label``, which also names it in ``comm_stats``.
        Collective over the default group at setup, like :meth:`split`: every rank makes every group, in the same
        order; cached."""
        assert self._group is None and self.world_size % k == 0, "node_group: default group, k | N"
        mine = None
        for g in range(self.world_size // k):
            ranks = tuple(range(g * k, (g + 1) * k))
            group = self._cached_group(ranks, label, self.backend, local=False)
            if self.rank in ranks:
                mine = group
        comm = Comm(mine, timeout_s=self.timeout_s, label=label)
        comm.history, comm._in_place = self.history, self._in_place
        return comm

    # -- control channel ------------------------------------------------------
    def open_control_channel(self) -> None:
        """Open this group's control channel ([Note: control channel]); collective, at setup."""
        if self.world is not self:  # a shard group agrees with the whole world
            self.world.open_control_channel()
            self._control = self.world._control
            return
        if self.world_size == 1 or not self.moves_data or self._control is not None:
            return
        self._control = groups.weak(self._group_of_same_ranks("control", "gloo"))

    def sibling(self, purpose: str) -> Comm:
        """A Comm over a second group of the same ranks and backend, for collectives whose order is agreed
        separately from this group's (stage 3's reductions: [Note: reductions on their own group] in
        stage3/hooks.py).  Collective at setup, like :meth:`open_control_channel`; one per group and purpose."""
        if self.world_size == 1 or not self.moves_data:
            return self
        comm = Comm(self._group_of_same_ranks(purpose, self.backend), timeout_s=self.timeout_s, label=self.label)
        comm.history, comm._in_place = self.history, self._in_place
        comm.world, comm.replica, comm._control = self.world, self.replica, self._control
        return comm

    def _group_of_same_ranks(self, purpose: str, backend: str) -> Any:
        """A new group over this group's ranks, made once per (ranks, purpose) while the default group lives
        (the test harness reuses processes across many setups); collective the first time."""
        ranks = tuple(self.global_rank(r) for r in range(self.world_size))
        return self._cached_group(ranks, purpose, backend, local=self._group is not None)

    @staticmethod
    def _cached_group(ranks: tuple, purpose: str, backend: str, local: bool) -> Any:
        world = dist.GroupMember.WORLD
        cached = groups.SAME_RANKS.get((ranks, purpose))
        group = cached[1]() if cached is not None and cached[0]() is world else None
        if group is None:
            group = dist.new_group(ranks=list(ranks), backend=backend, use_local_synchronization=local)
            groups.SAME_RANKS[(ranks, purpose)] = (groups.weak(world), groups.weak(group))
        return group

    def control_exchange(self, message: tuple[float, ...], what: str) -> list[tuple[float, ...]]:
        """Every rank's ``message`` (a few exact small numbers, the same length on every rank), blocking,
        over the control channel; counted under ``control``."""
        return self.control_finish(self.control_start(message, what))

    def control_start(self, message: tuple[float, ...], what: str) -> tuple:
        """Issue :meth:`control_exchange` without waiting; :meth:`control_finish` gives its result."""
        if self._control is None:
            return None, [tuple(message)] * self.control_size, what
        mine = torch.tensor(message, dtype=torch.float64)
        out = torch.empty(self.control_size * mine.numel(), dtype=torch.float64)
        stats.record("control", out.numel() * out.element_size())
        stats.issued(_ALL_GATHER_NAME)
        control = groups.live(self._control, "control channel")
        return _ALL_GATHER(out, mine, group=control, async_op=True), out, what

    def control_finish(self, handle: tuple) -> list[tuple[float, ...]]:
        work, out, what = handle
        if work is None:
            return out
        self._wait(work, what)  # host-only: no stream
        return [tuple(row) for row in out.view(self.control_size, -1).tolist()]

    def control_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj`` over the control channel (error paths only)."""
        if self._control is None:
            return [obj] * self.control_size
        out: list[Any] = [None] * self.control_size
        stats.issued("all_gather_object")
        dist.all_gather_object(out, obj, group=groups.live(self._control, "control channel"))
        return out

    # -- waiting ------------------------------------------------------------
    def wait(self, work, what: str = "collective") -> None:
        """Wait for an async collective, turning a timeout or a dead peer into an error that says why.
        For NCCL work this makes the *current stream* wait ([Note: side streams] in streams.py)."""
        self._wait(work, what)

    def _wait(self, work, what: str) -> None:
        try:
            if self.timeout_s is not None and not isinstance(work, works.DoneWork):
                work.wait(timeout=timedelta(seconds=self.timeout_s))
            else:
                work.wait()
        except Exception as exc:  # gloo/NCCL raise RuntimeError (timeout, connection closed by a dead peer)
            raise RuntimeError(
                f"zero_plugin: rank {self.rank}: {what} did not complete ({type(exc).__name__}: {exc}). Another "
                "rank died or is stuck, or ranks issued collectives in a different order. "
                + (
                    f"Last collectives on this rank: {list(self.history)}"
                    if self.history is not None
                    else "Set ZeroConfig(debug_collectives=True) to list the last collectives of each rank."
                )
            ) from exc

    def _record(self, kind: str, nbytes: int) -> None:
        stats.record(kind, nbytes, self.label)

    def _note(self, kind: str, tag: str, numel: int) -> None:
        if self.history is not None:
            self.history.append((kind, tag, numel))

    # -- tensor collectives -------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False, tag: str = ""):
        self._record("all_reduce", 2 * tensor.numel() * tensor.element_size())
        self._note("all_reduce", tag, tensor.numel())
        if self.world_size == 1:
            return works.DoneWork() if async_op else None
        stats.issued("all_reduce")
        return dist.all_reduce(tensor, op=_reduce_op(op, self.backend), group=self.group, async_op=async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", async_op: bool = False, tag: str = ""
    ):
        """``input`` holds ``world_size`` equal chunks, rank-major; this rank's reduced chunk lands in ``output``."""
        assert input.numel() == output.numel() * self.world_size, "reduce_scatter: size mismatch"
        self._record("reduce_scatter", input.numel() * input.element_size())
        self._note("reduce_scatter", tag, input.numel())
        if self.world_size == 1:
            output.copy_(input)
            return works.DoneWork() if async_op else None
        if self.backend == "gloo" and op in ("sum", "avg"):
            # gloo sends a reduce-scatter as a full all-reduce anyway, and issuing its reduce-scatter costs
            # far more CPU than an in-place all-reduce (benchmarks/collectives.py): reduce in place, keep our row
            # (divided by the world size for "avg", which gloo lacks: sum, then divide).
            stats.issued("all_reduce")
            work = dist.all_reduce(input, group=self.group, async_op=True)
            row = input.view(self.world_size, -1)[self.rank]
            pending = works.RowWork(work, output, row, self.world_size if op == "avg" else 1)
            if async_op:
                return pending
            pending.wait()
            return None
        stats.issued(_REDUCE_SCATTER_NAME)
        return _REDUCE_SCATTER(output, input, op=_reduce_op(op, self.backend), group=self.group, async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, tag: str = ""):
        """Concatenate every rank's ``input`` (equal sizes) into ``output``, rank-major."""
        assert output.numel() == input.numel() * self.world_size, "all_gather: size mismatch"
        self._record("all_gather", output.numel() * output.element_size())
        self._note("all_gather", tag, output.numel())
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return works.DoneWork() if async_op else None
        stats.issued(_ALL_GATHER_NAME)
        return _ALL_GATHER(output, input, group=self.group, async_op=async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, tag: str = ""):
        """Row r of ``input`` (``world_size`` equal rows, rank-major) goes to rank r; ``output``'s row r comes
        from rank r (qgZ: [Note: qgZ reduction] in ``quantized.py``).  Counted as its input's bytes, like a
        reduce-scatter ([Note: logical bytes])."""
        assert input.numel() == output.numel() and input.numel() % self.world_size == 0, "all_to_all: sizes"
        self._record("all_to_all", input.numel() * input.element_size())
        self._note("all_to_all", tag, input.numel())
        if self.world_size == 1:
            output.copy_(input)
            return works.DoneWork() if async_op else None
        stats.issued("all_to_all_single")
        return dist.all_to_all_single(output, input, group=self.group, async_op=async_op)

    @property
    def gathers_regions_in_place(self) -> bool:
        """Whether this group's collectives use the in-place layout ([Note: in-place region gather])."""
        return self._in_place

    def gather_regions(self, regions: list[list[torch.Tensor]], async_op: bool = False, tag: str = ""):
        """All-gather in place: ``regions[r]`` are contiguous views (the same shapes on every rank) that
        rank ``r`` holds up to date; afterwards every rank's views hold rank r's values.  Counted as an
        all-gather of the regions' total size.  Only where :attr:`gathers_regions_in_place`; sent point to
        point ([Note: point-to-point exchange])."""
        assert len(regions) == self.world_size, "gather_regions: one list of regions per rank"
        numel = sum(t.numel() for views in regions for t in views)
        nbytes = sum(t.numel() * t.element_size() for views in regions for t in views)
        self._record("all_gather", nbytes)
        self._note("all_gather", tag, numel)
        pending = works.Works(self._exchange(lambda peer: regions[self.rank], lambda peer: regions[peer]))
        if async_op:
            return pending
        pending.wait()
        return None

    def reduce_in_place(
        self,
        regions: list[list[torch.Tensor]],
        flags: torch.Tensor | None = None,
        async_op: bool = False,
        tag: str = "",
    ):
        """Reduce-scatter in place: ``regions[r]`` are rank r's regions of this rank's tensors (contiguous
        views, the same shapes on every rank); afterwards this rank's own regions hold the sums over the
        ranks, and the other regions are unchanged ([Note: point-to-point exchange]); the peers' contributions
        land in a temporary of ``world_size - 1`` times this rank's regions.  Counted as a reduce-scatter of the tensors' total size;
        ``flags`` (small, e.g. "has a gradient" per tensor) is all-reduced along and counted as an all-reduce.
        Only where :attr:`gathers_regions_in_place`."""
        assert len(regions) == self.world_size, "reduce_in_place: one list of regions per rank"
        mine = regions[self.rank]
        self._record("reduce_scatter", sum(t.numel() * t.element_size() for views in regions for t in views))
        self._note("reduce_scatter", tag, sum(t.numel() for views in regions for t in views))
        if flags is not None:
            self._record("all_reduce", 2 * flags.numel() * flags.element_size())
        if self.world_size == 1:
            return works.DoneWork() if async_op else None
        received = _peer_rows(mine, self.world_size - 1)  # the peers in rank order, this rank left out
        handles = self._exchange(lambda peer: regions[peer], lambda peer: received[peer - (peer > self.rank)])
        if flags is not None:
            stats.issued("all_reduce")
            handles.append(dist.all_reduce(flags, group=self.group, async_op=True))
        pending = works.SumWork(handles, mine, received)
        if async_op:
            return pending
        pending.wait()
        return None

    def exchange(
        self, sends: dict[int, list[torch.Tensor]], receives: dict[int, list[torch.Tensor]], tag: str = ""
    ) -> None:
        """Blocking point-to-point exchange ([Note: point-to-point exchange]): ``sends[peer]`` go to ``peer``,
        ``receives[peer]`` are filled from it (contiguous tensors; a peer missing from either dict exchanges
        nothing that way).  Both sides must list the same sizes in the same order.  Counted under
        ``"exchange"`` as the bytes this rank sends (the parameter partition's gathers to owners and scatters
        back: [Note: optimizer partitions] in ``optim/partition.py``)."""
        self._record("exchange", sum(t.numel() * t.element_size() for ts in sends.values() for t in ts))
        self._note("exchange", tag, sum(t.numel() for ts in sends.values() for t in ts))
        if self.world_size == 1:
            return
        handles = self._exchange(lambda peer: sends.get(peer, []), lambda peer: receives.get(peer, []))
        self.wait(works.Works(handles), f"point-to-point exchange {tag!r}")

    def _exchange(self, sends_to, receives_from) -> list:
        """[Note: point-to-point exchange]: for each peer in rank order, send it ``sends_to(peer)`` and receive
        ``receives_from(peer)`` (lists of contiguous tensors), asynchronously; the handles in issue order."""
        handles, group = [], self.group
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            other = self.global_rank(peer)
            for t in sends_to(peer):
                if t.numel():
                    stats.issued("isend")
                    handles.append(dist.isend(t, dst=other, group=group, tag=_P2P_TAG))
            for t in receives_from(peer):
                if t.numel():
                    stats.issued("irecv")
                    handles.append(dist.irecv(t, src=other, group=group, tag=_P2P_TAG))
        return handles

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._record("broadcast", tensor.numel() * tensor.element_size())
        if self.world_size > 1:
            stats.issued("broadcast")
            dist.broadcast(tensor, src=self.global_rank(src), group=self.group)

    @torch.no_grad()
    def coalesced(self, tensors: list[torch.Tensor], op) -> None:
        """Run ``op(flat)`` (an in-place collective) once per dtype over the concatenation of ``tensors``,
        then copy the result back; writes go through ``.data`` so autograd's version counters stay put."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            op(flat)
            offset = 0
            for t in group:
                t.data.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    # -- object collectives (setup-time checks, not per step) -------------
    def all_gather_object(self, obj: Any) -> list[Any]:
        self._record("all_gather_object", 0)
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        stats.issued("all_gather_object")
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self._record("broadcast_object", 0)
        if self.world_size == 1:
            return obj
        box = [obj]
        stats.issued("broadcast_object_list")
        dist.broadcast_object_list(box, src=self.global_rank(src), group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            stats.issued("barrier")
            dist.barrier(group=self.group)

    def global_rank(self, group_rank: int) -> int:
        if self._group is None or not self.initialized:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)


def _reduce_op(op: str, backend: str):
    if op == "sum":
        return dist.ReduceOp.SUM
    if op == "max":
        return dist.ReduceOp.MAX
    if op == "avg":
        # gloo has no AVG; callers divide instead (Comm.averages_in_reduce_scatter).
        assert reduce_scatter_averages(backend), f"ReduceOp.AVG is not supported by {backend}; divide explicitly"
        return dist.ReduceOp.AVG
    raise ValueError(f"unknown reduce op {op!r}")
