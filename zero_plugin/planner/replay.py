"""The memory planner's replay of one training step: what the engine allocates and frees, event by event.

``plan.py`` traces the model and builds a :class:`Setting` per row; :class:`ReplicatedReplay`
(stages 0-2) and :class:`Stage3Replay` walk the trace's events and allocate exactly what
``grads/``, ``optim/`` and ``stage3/`` allocate at those points, in the collective layout of the
planned backend; :class:`Memory` keeps the running totals and their peaks.  What each part counts
is described in ``plan.py``'s module docstring.

What a collective holds from its launch to its completion is not written here: the replay asks the
``Layout`` the engine would use (``comm.layout.layout_for`` of the planned backend) for its ``Footprint``
([Note: collective footprints] in ``comm/layout.py``, checked against the pipelines themselves by
``tests/unit/test_layout_footprint.py``), and counts its steps where they become resident on the planned
device (``Footprint.resident``, from the measurements below).

The schedule is the engine's own: reductions are issued by the engine's ``ReductionSchedule`` in the
rank-agreed order (buckets in their setup order; at stage 3 ``hooks.reduction_order``), how many
collectives may be pending at once, the extra elements of a stage-3 gather, which units a prefetch
gathers, which stay gathered after forward (``hooks.needed_first``, ``unit.released_after_forward``) and
when a launched reduction releases its unit (``unit.released_at_reduce``) are imported from the modules
that run them, so the replay follows a change there instead of keeping a copy of it.

[Note: collective buffers]
When the bytes of a collective count (measured with the RSS of 2 and 4 gloo ranks, torch 2.13;
``Footprint.resident`` applies it):
  * all-gather: input and output at the launch; on CPU gloo also stages the output in a temporary of
    its size until the collective completes (counted until our wait);
  * reduce-scatter: the input at the launch; the output when written: on CUDA at the launch (the
    allocation), on CPU at our wait (``Comm`` issues it on gloo as an in-place all-reduce and copies
    this rank's row out in the wait);
  * all-reduce: in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ..comm.layout import IN_PLACE, Footprint, Layout, Steps, all_reduce_footprint, layout_for
from ..config import ZeroConfig
from ..engines import param_sync
from ..grads import reducer
from ..grads.bucket import plan_buckets
from ..grads.schedule import ReductionSchedule
from ..grads.views import reduce_scatter_keeps_views
from ..optim import blocked_step
from ..stage3 import hooks, unit
from ..stage3.hooks import needed_first, prefetch_span, reduction_order
from ..stage3.unit import released_after_forward, released_at_reduce
from ..stages import REPLICATED_STAGES
from ..tensors.flat import ShardLayout

__all__ = ["Memory", "ReplicatedReplay", "Replay", "Setting", "Stage3Replay"]


# -- timeline -----------------------------------------------------------------------------------------
class Memory:
    """Bytes by (place, category) as the step proceeds; keeps the device, host and combined peaks."""

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], float] = {}
        self.acts = 0.0
        self.phase = "forward"
        self.peaks: dict[str, tuple[float, dict]] = {}

    def add(self, place: str, category: str, nbytes: float) -> None:
        self.bytes[(place, category)] = self.bytes.get((place, category), 0.0) + nbytes
        self.check()

    def check(self, acts: float | None = None) -> None:
        acts = self.acts if acts is None else acts
        device = acts + sum(v for (p, _), v in self.bytes.items() if p == "device")
        host = sum(v for (p, _), v in self.bytes.items() if p == "host")
        for name, value in (("device", device), ("host", host), ("total", device + host)):
            if value > self.peaks.get(name, (-1.0, None))[0]:
                self.peaks[name] = (value, {"phase": self.phase, "activations": acts, "bytes": dict(self.bytes)})

    @staticmethod
    def by_category(snapshot: dict, places: tuple[str, ...]) -> dict[str, float]:
        out: dict[str, float] = {}
        for (place, cat), v in snapshot["bytes"].items():
            if place in places:
                out[cat] = out.get(cat, 0.0) + v
        return out


@dataclass(frozen=True, slots=True)
class Setting:
    stage: int
    world_size: int
    offload: bool
    offload_params: bool
    device: str
    config: ZeroConfig
    # regions gathered and reduced in place (gloo, [Note: in-place region gather] in ``collectives.py``): what
    # plan.py passes; the replay reads :attr:`layout`, which must agree
    in_place: bool
    # ranks the states are sharded over: the shard group's k with ZeroConfig.shard_group_size, else the
    # world; the collectives replayed here run over the shard group ([Note: hierarchical groups])
    shard_world: int = 0

    def __post_init__(self) -> None:
        if not self.shard_world:
            object.__setattr__(self, "shard_world", self.world_size)

    @property
    def layout(self) -> Layout:
        """The collective layout the engine would use: a CPU run plans gloo, a CUDA run NCCL."""
        return layout_for("gloo" if self.device == "cpu" else "nccl")


class Replay:
    """Walks a trace's events, allocating and freeing what the engine would (see the module docstring)."""

    def __init__(self, plan: Any, s: Setting, theory: dict[str, float]) -> None:
        self.plan, self.s, self.mem = plan, s, Memory()
        self.n = s.shard_world
        self.layout = s.layout
        assert s.in_place == (self.layout is IN_PLACE), "Setting.in_place disagrees with the planned backend"
        self.pb, self.rb, self.mb = plan.param_bytes, plan.reduce_bytes(s.config), plan.master_bytes
        self.shard_is_master = plan.shard_is_master(s)
        self.trainable = [i for i, p in enumerate(plan.params) if p.requires_grad and p.numel]
        self.mem.add(self.place("params"), "params", theory["params"])
        self.mem.add(self.place("optimizer"), "optimizer", theory["optimizer"])
        if self.blocked_step():  # its one-block fp32 gradient scratch, kept from the first step on
            scratch = blocked_step.block_elements(self.local(i) for i in self.trainable)
            self.mem.add(self.place("master_grads"), "master_grads", scratch * self.mb)

    def place(self, category: str) -> str:
        s = self.s
        if category == "params":
            return "host" if s.offload_params else "device"
        if category == "grad_shards":
            return "host" if (s.offload_params and s.device == "cuda") else "device"
        if category in ("optimizer", "master_grads"):
            on_host = s.offload or (s.offload_params and s.device == "cuda")
            return "host" if on_host else "device"
        return "device"

    def local(self, i: int) -> int:
        return ShardLayout(self.plan.params[i].numel, self.n, 0).local_numel

    def run(self) -> Memory:
        for ev in self.plan.trace.events:
            kind = ev[0]
            if kind == "seg":
                self.mem.check(ev[1])
                self.mem.acts = ev[2]
            elif kind == "backward":
                self.mem.phase = "backward"
            elif kind == "end":
                self.finish_backward()
            else:
                getattr(self, "on_" + kind)(*ev[1:])
        self.step()
        return self.mem

    def on_grad(self, i: int) -> None:
        self.mem.add("device", "grads", self.plan.params[i].numel * self.pb)

    # -- collectives: their footprints, asked of the layout ([Note: collective footprints]) ----------------
    def count(self, steps: Steps, buffers: str) -> None:
        """A footprint's steps on the device; its ``buffers`` counted as ``buffers``."""
        for part, nbytes in steps:
            self.mem.add("device", _CATEGORIES.get(part, buffers), nbytes)

    def at_launch(self, fp: Footprint, buffers: str) -> None:
        self.count(fp.resident(self.s.device)[0], buffers)

    def at_wait(self, fp: Footprint, buffers: str) -> None:
        """The wait, before the caller takes the results."""
        self.count(fp.resident(self.s.device)[1], buffers)

    def at_completion(self, fp: Footprint, buffers: str) -> None:
        """After the caller took the results."""
        self.count(fp.resident(self.s.device)[2], buffers)

    def on_fwd_pre(self, unit: int, in_backward: bool) -> None:
        pass

    on_fwd_post = on_bwd_pre = on_bwd_post = on_fwd_pre

    def finish_backward(self) -> None:
        pass

    def step(self) -> None:
        """before_step (gradients copied to separate masters), the optimizer's temporaries, after_step.
        The non-finite check allocates nothing that counts (one fp32 sum per gradient)."""
        self.mem.phase = "step"
        locals_ = [self.local(i) if self.s.stage else self.plan.params[i].numel for i in self.trainable] or [0]
        if self.separate_masters() and not self.blocked_step():
            self.mem.add(self.place("master_grads"), "step", sum(locals_) * self.mb)
        temp = self.optimizer_temporaries(locals_)
        self.mem.add(self.place("optimizer"), "step", temp)
        self.mem.add(self.place("optimizer"), "step", -temp)
        self.mem.bytes = {k: v for k, v in self.mem.bytes.items() if k[1] != "step"}
        self.after_step()

    def separate_masters(self) -> bool:
        mixed = self.plan.mixed
        if self.s.stage == 3:
            return not self.shard_is_master and (mixed or (self.s.offload and self.s.device == "cuda"))
        return mixed or (self.s.offload and self.s.device == "cuda")

    def blocked_step(self) -> bool:
        """[Note: cache-blocked offload step] in optim/blocked_step.py: offloaded fp32 masters of lower-precision
        parameters on a CPU-only machine get their gradients cast block by block (AdamW, as planned here)."""
        return self.s.offload and self.s.device == "cpu" and self.separate_masters()

    def optimizer_temporaries(self, locals_: list[int]) -> float:
        """AdamW's temporaries: the fused CPU kernel (offload, optim/offload.py) needs none; torch's default
        on CUDA (foreach) one sqrt per parameter, all at once; on CPU (one tensor at a time) the sqrt and
        the division of the largest parameter."""
        if self.s.offload:
            return 0.0
        if self.s.device == "cuda" and not self.s.offload_params:
            return sum(locals_) * self.mb
        return 2.0 * max(locals_) * self.mb

    def after_step(self) -> None:
        pass


_CATEGORIES = {"grads": "grads", "gathered": "gathered", "temp": "collective_temp"}  # by footprint part


class ReplicatedReplay(Replay):
    """Stages 0-2 (``grads/reducer.py``, ``engines/param_sync.py``): full parameters; gradients bucketed and
    all-reduced (0) or reduce-scattered (1-2), as many buckets pending as ``reducer.pending_bound`` allows.  What the stage
    keeps is read from the row ``stages.py`` builds the engine from (``REPLICATED_STAGES``), not from its number:
    ``sharded`` (regions reduce-scattered, parameters all-gathered after the step) and ``frees_full`` (the full
    gradients go once reduced: ZeRO-2)."""

    def __init__(self, plan: Any, s: Setting, theory: dict[str, float]) -> None:
        super().__init__(plan, s, theory)
        row = REPLICATED_STAGES[s.stage]
        self.sharded = row.sharded_masters
        self.frees_full = not row.keep_full_grad
        self.buckets = self._buckets()
        self.bucket_of = {i: b for b, (idx, _, _) in enumerate(self.buckets) for i in idx}
        self.ready = [0] * len(self.buckets)
        # Bucket b is self.ids[b]: the schedule keys items by identity, so each index is one object.
        self.ids = list(range(len(self.buckets)))
        # [Note: gradients as bucket views] in grads/views.py: stage 0, and stage 1 in place, keep their full
        # gradients in persistent bucket buffers, alive from the first backward on (through every later
        # forward); a fresh gradient is copied into its view and dropped at once.  Views need the reduce dtype.
        in_place = self.layout is IN_PLACE  # as the reducer reads it: what it costs, not how
        keeps_views = reduce_scatter_keeps_views(row.keep_full_grad, in_place) if self.sharded else True
        self.views = keeps_views and self.rb == self.pb
        if self.views:
            self.mem.add("device", "grads", sum(self.plan.params[i].numel for i in self.trainable) * self.pb)
        # [Note: pending reductions] in grads/reducer.py: stage 0 all-reducing only its views has no bound
        bound = reducer.pending_bound(self.views and not self.sharded)
        self.schedule = ReductionSchedule(self._launch_one, self.complete, bound)
        self.schedule.start(self.ids)

    def on_grad(self, i: int) -> None:
        if not self.views:
            self.mem.add("device", "grads", self.plan.params[i].numel * self.pb)
        b = self.bucket_of[i]
        self.ready[b] += 1
        if self.ready[b] == len(self.buckets[b][0]):
            self.schedule.mark_ready(self.ids[b])

    def _buckets(self) -> list[tuple[list[int], int, int]]:
        """(param indices, width, flags) per bucket, cut as ``grads/bucket.py`` cuts them."""
        slots = [
            SimpleNamespace(
                index=i,
                param=SimpleNamespace(numel=lambda i=i: self.plan.params[i].numel, element_size=lambda: self.pb),
                layout=ShardLayout(self.plan.params[i].numel, self.n if self.sharded else 1, 0),
            )
            for i in self.trainable
        ]
        return [
            ([slot.index for slot in b.slots], b.width, len(b.slots))
            for b in plan_buckets(slots, int(self.s.config.comm.bucket_size_mb * 2**20), sharded=self.sharded)
        ]

    def footprint(self, b: int) -> Footprint:
        """Bucket ``b``'s collective: stage 0's flat all-reduce on every layout, else the layout's reduction
        (``ReduceScatterReducer._launch``) of the bucket's padded shards and flags."""
        _, width, k = self.buckets[b]
        if not self.sharded:  # with views the buffer is the gradients' own (``all_reduce_filled``)
            return all_reduce_footprint(width + k, self.rb, filled=self.views)
        return self.layout.reduce_footprint(self.n, width + k, self.bucket_numel(b), self.pb, self.rb, self.frees_full)

    def bucket_numel(self, b: int) -> int:
        return sum(self.plan.params[i].numel for i in self.buckets[b][0])

    def _launch_one(self, b: int) -> list:
        self.launch(b)
        return [None]  # one collective per bucket

    def launch(self, b: int) -> None:
        self.at_launch(self.footprint(b), "reduce_buffers")

    def complete(self, b: int, pending: Any = None) -> None:
        fp = self.footprint(b)
        self.at_wait(fp, "reduce_buffers")
        if self.frees_full:  # stage 2 keeps views of the output row where it has the gradients' dtype, else copies
            kept = (
                fp.output
                if fp.output and self.rb == self.pb
                else sum(self.local(i) for i in self.buckets[b][0]) * self.pb
            )
            self.mem.add(self.place("grad_shards"), "grad_shards", kept)
        self.at_completion(fp, "reduce_buffers")

    def finish_backward(self) -> None:
        self.schedule.flush()  # buckets not issued yet, in order (the reducer's final callback)
        self.schedule.finish()

    def after_step(self) -> None:
        if self.frees_full:
            self.mem.bytes.pop((self.place("grad_shards"), "grad_shards"), None)
        if not (self.sharded and self.n > 1):
            return
        self.mem.phase = "all-gather"  # ``Layout.gather_all``, at most ``param_sync.MAX_INFLIGHT`` waiting
        pending: list[Footprint] = []
        for fp in self.layout.gather_all_footprints(self.n, [width for _, width, _ in self.buckets], self.pb):
            self.at_launch(fp, "allgather_buffers")
            pending.append(fp)
            if len(pending) > param_sync.MAX_INFLIGHT:
                done = pending.pop(0)
                self.at_wait(done, "allgather_buffers")
                self.at_completion(done, "allgather_buffers")


class Stage3Replay(Replay):
    """Stage 3: units gathered around their forward and backward, reduce-scattered when their grads are in."""

    def __init__(self, plan: Any, s: Setting, theory: dict[str, float]) -> None:
        super().__init__(plan, s, theory)
        # Unit u is self.ids[u]: the schedule keys items by identity, so each index is one object.
        self.ids = list(range(len(plan.trace.unit_names)))
        self.order = [self.ids[u] for u in plan.trace.forward_order]
        units = self.ids
        members = {u: [i for i, p in enumerate(plan.params) if p.unit == u and p.numel] for u in units}
        train = {u: [i for i in members[u] if plan.params[i].requires_grad] for u in units}
        self.n_train = {u: len(train[u]) for u in units}
        self.grad_numel = {u: sum(plan.params[i].numel for i in train[u]) for u in units}  # full gradients
        full_numel = {u: sum(plan.params[i].numel for i in members[u]) for u in units}
        self.full = {u: full_numel[u] * self.pb for u in units}  # gathered
        # [Note: collective footprints]: one gather per unit (one compute dtype), its input the flat shards
        # where the layout lays them out and they are stored in the compute dtype on the device ([Note: flat
        # shards] in stage3/unit.py), else copied in; one reduction, which lets the full gradients go, at its
        # completion where a side stream reads them (CUDA)
        laid_out = self.layout.flat_gather_input and not self.shard_is_master and not s.offload_params
        self.gathers = {
            u: self.layout.gather_footprint(
                self.n, self._width(members[u], unit.GATHER_TAG), full_numel[u], self.pb, laid_out
            )
            for u in units
        }
        self.reductions = {
            u: self.layout.reduce_footprint(
                self.n,
                self._width(train[u], len(train[u])),
                self.grad_numel[u],
                self.pb,
                self.rb,
                True,
                side_streams=s.device == "cuda",
            )
            for u in units
        }
        grad_bytes = self.mb if self.shard_is_master else self.pb
        self.shard_grads = {u: sum(self.local(i) for i in train[u]) * grad_bytes for u in units}
        self.wrapped = {ev[1] for ev in plan.trace.events if ev[0] == "bwd_post"}
        self.gathered: set[int] = set()
        self.inflight: dict[int, Footprint] = {}  # unit -> its gather in flight
        self.reduced: set[int] = set()
        self.post: set[int] = set()
        self.ready = {u: 0 for u in units}
        self.schedule = ReductionSchedule(self._launch_one, self.complete, hooks.MAX_INFLIGHT_REDUCES)
        self.schedule.start(reduction_order(self.order, self.ids, self.ids[0], lambda u: self.n_train[u] > 0))
        # accumulate_full_grads: the earlier micro-batches' full gradients, kept in the reduce dtype until
        # the unit's reduction of the synced one sends them ([Note: deferred reduction] in stage3/accumulate.py)
        keeps = s.config.stage3.accumulate_full_grads
        self.kept = {u: self.grad_numel[u] * self.rb if keeps else 0 for u in units}
        self.mem.add("device", "kept_grads", sum(self.kept.values()))

    def _width(self, idx: list[int], extra: int) -> int:
        """Elements per rank in a unit's collective (``stage3/unit.py``): padded shards plus the extras."""
        return sum(ShardLayout(self.plan.params[i].numel, self.n, 0).shard_numel for i in idx) + extra if idx else 0

    # -- gather / release (stage3/unit.py) -------------------------------------------------------
    def gather(self, u: int) -> None:
        self.inflight[u] = self.gathers[u]
        self.at_launch(self.inflight[u], "gather_buffers")

    def ensure(self, u: int) -> None:
        if u in self.gathered:
            return
        if u not in self.inflight:
            self.gather(u)
        fp = self.inflight.pop(u)
        self.at_wait(fp, "gather_buffers")
        self.at_completion(fp, "gather_buffers")  # the full tensors written while the buffers are alive
        self.gathered.add(u)

    def prefetch(self, u: int, direction: int) -> None:
        """Backward prefetches along the reverse forward order: the runtime's agreed backward list when
        every unit's output needed a gradient."""
        order = self.order if direction > 0 else self.order[::-1]
        for v in prefetch_span(order, u, self.s.config.stage3.prefetch_depth):
            if v not in self.gathered and v not in self.inflight:
                self.gather(v)

    def reshard(self, u: int) -> None:
        if u in self.inflight:
            self.ensure(u)
        if u in self.gathered:
            self.gathered.discard(u)
            self.mem.add("device", "gathered", -self.full[u])

    # -- hooks (stage3/hooks.py) -----------------------------------------------------------------
    def on_fwd_pre(self, u: int, in_backward: bool) -> None:
        self.ensure(u)
        if not in_backward:
            self.prefetch(u, +1)

    def on_fwd_post(self, u: int, in_backward: bool) -> None:
        """Reshard after forward as the runtime's ``post_forward`` does: the root's releases every other
        unit still gathered; the root and the last unit of the forward order stay ([Note: last unit kept]
        in ``hooks.py``)."""
        if in_backward:
            return
        for v in [w for w in self.gathered | set(self.inflight) if w != 0] + [0] if u == 0 else [u]:
            reshard = self.s.config.stage3.reshard_after_forward
            if released_after_forward(True, reshard, needed_first(self.order, v, 0)):
                self.reshard(v)

    def on_bwd_pre(self, u: int, in_backward: bool) -> None:
        self.ensure(u)
        self.prefetch(u, -1)

    def on_bwd_post(self, u: int, in_backward: bool) -> None:
        """``Unit.post_backward``: released if reduced already or training nothing, else ready."""
        self.post.add(u)
        if u in self.reduced or not self.n_train[u]:
            self.reshard(u)
        else:
            self.schedule.mark_ready(self.ids[u])

    def on_grad(self, i: int) -> None:
        super().on_grad(i)
        u = self.plan.params[i].unit
        self.ready[u] += 1
        if self.ready[u] == self.n_train[u] and u not in self.reduced:
            self.schedule.mark_ready(self.ids[u])

    def _launch_one(self, u: int) -> list:
        """``Unit.launch_reduce``: the reduction's turn came; released unless its backward may need it."""
        self.launch(u)
        if released_at_reduce(u == 0, u in self.post, u in self.wrapped):
            self.reshard(u)
        return [None]  # one collective per unit (one dtype)

    def launch(self, u: int) -> None:
        """``Unit.launch_reduce``'s ``Layout.reduce``."""
        self.reduced.add(u)
        self.at_launch(self.reductions[u], "reduce_buffers")

    def complete(self, u: int, pending: Any = None) -> None:
        """``Unit.complete_reduce``: the shard gradients kept, then what the reduction held let go."""
        self.mem.add("device", "kept_grads", -self.kept[u])
        self.at_wait(self.reductions[u], "reduce_buffers")
        self.mem.add(self.place("grad_shards"), "grad_shards", self.shard_grads[u])
        self.at_completion(self.reductions[u], "reduce_buffers")

    def finish_backward(self) -> None:
        self.schedule.flush()  # units whose turn did not come, in order (the runtime's final callback)
        self.schedule.finish()
        for u in list(self.gathered | set(self.inflight)):
            self.reshard(u)

    def after_step(self) -> None:
        self.mem.bytes.pop((self.place("grad_shards"), "grad_shards"), None)
