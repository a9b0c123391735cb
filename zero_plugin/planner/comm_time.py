"""The planner's time model: bytes per step over each link and an alpha-beta estimate of communication time.

    plan = zpp.Planner("llama-7b", param_dtype="bf16")
    rows = zpp.comm_rows(plan, zpp.Topology(nodes=4, gpus_per_node=8), accum=4)

Each row is one (stage, option): which collectives a training step issues, their logical bytes per rank
(the ``comm_stats`` convention, [Note: logical bytes] in ``collectives.py``), the network each runs on and
its time.  For a single group (``Option.plain``, one node) the bytes are exactly what ``zp.comm_stats()``
counts for one step in steady state, in the layout of the planned backend (in place on gloo, buffered on
NCCL, [Note: collective layouts] in ``comm/layout.py``): ``tests/unit/test_comm_time.py`` runs the engine
and compares.  So does hierarchical sharding (``Option.hierarchical``, shard group = node) at stages 1-3:
its intra-node bytes are what ``comm_stats()["shard_group"]`` counts and its inter-node bytes what
``comm_stats()["replica_group"]`` counts, for shard rank 0 (in place, other shard ranks send their
regions' padding less across groups, ``_Sizes.replica_bytes``).  The control channel's small exchanges
([Note: control channel]) are not counted.

[Note: alpha-beta model]
A collective over ``p`` ranks is a ring (Patarasuk & Yuan; the accounting of ZeRO, arXiv 1910.02054
section 7, and ZeRO++, arXiv 2306.10209).  With ``n`` the bytes of the full buffer, ``α`` the
latency of one ring step and ``β`` the per-rank bandwidth of the link the ring runs over:
    all-gather (n outputs), reduce-scatter (n inputs):  T = (p-1)·α + (p-1)/p · n/β
    all-reduce of n:                                    T = 2(p-1)·α + 2(p-1)/p · n/β
In logical bytes L (n for the first two, 2n for an all-reduce) both read ``steps·α + (p-1)/p · L/β`` per
call, ``steps`` = p-1 or 2(p-1); a phase of ``c`` calls with L bytes in all takes c·steps·α + (p-1)/p·L/β.
Links: ``intra`` (NVLink inside a node) and ``inter`` (the network, per GPU: one NIC per GPU as on
HGX H100/H200, ``inter.bandwidth`` is what one GPU gets across nodes, what nccl-tests reports as bus
bandwidth for a collective over 2+ nodes).  A group inside one node runs on ``intra``; a group of one rank
per node runs on ``inter`` (the G such groups of a node run side by side, each on its own NIC); a flat group
over all ``N = M·G`` ranks of ``M > 1`` nodes is bound by its slowest hop and runs on ``inter``.  The bytes
of a flat multi-node collective count as inter-node bytes (ZeRO++'s "cross-node volume").
Hierarchical collectives are an intra phase plus an inter phase:
  * hierarchical sharding (shard group = node: FSDP2 HSDP, MiCS, ``ZeroConfig.shard_group_size=G``):
    parameters gathered inside the node, AG(n, G) on intra; gradients reduce-scattered inside the node,
    RS(n, G) on intra, then the 1/G shard with its has-gradient flags all-reduced across nodes,
    AR(n/G, M) on inter; the inf/NaN check and the clip norm stay inside the node;
  * hpZ (ZeRO++, ``ZeroConfig.secondary_shard_size=G``): a secondary copy of the parameters sharded inside
    the node (+n/G memory) serves backward's gathers, AG(n, G) on intra, in the parameter dtype (not
    quantized) and in the buffered layout with the unit's tag; forward gathers stay flat, AG(n, N);
  * qwZ (ZeRO++, ``quantized_weights``): weights all-gathered as int8 in blocks of
    ``ZeroConfig.quantization_block`` elements with one fp32 scale each, per rank one packed row of its
    padded chunks (``comm/quantize.packed_numel``) plus the unit's tag (4 bytes): about n/param_bytes·(1 +
    4/block) bytes instead of n;
  * qgZ (``quantized_gradients``; int8, the paper's int4 would halve it): gradients quantized the same way,
    one row per destination, exchanged by one all-to-all over the shard group (the world, or the node
    with hierarchical sharding), A2A(q, p) with the ring's cost (p-1)·α + (p-1)/p · q/β, the has-gradient
    flags in a float32 all-reduce beside it, and with hierarchical sharding the exact replica all-reduce
    as without qgZ ([Note: qgZ reduction] in ``comm/quantized.py``; ZeRO++'s two-hop all-to-all is not
    implemented);
  * stage-3 accumulation (``ZeroConfig.accumulate_full_grads``, under ``zp.no_sync``): gathers every
    micro-batch, one reduction per step (+ the full gradients of every unit in memory, Ψ·reduce bytes).
A step of A micro-batches: stages 0-2 reduce once (``no_sync`` before the last), stage 3 gathers A times
and reduces A times (once with accumulation).  The time is the sum over phases: what communication costs
when nothing overlaps it; overlapped with compute, a step takes at least max(compute, this).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

from ..comm.quantize import packed_numel
from ..grads.bucket import plan_buckets
from ..stage3.unit import GATHER_TAG as _GATHER_TAG
from ..tensors.flat import ShardLayout

__all__ = [
    "DEFAULT_INTER",
    "DEFAULT_INTRA",
    "IMPLEMENTED",
    "Link",
    "OPTIONS",
    "Option",
    "Phase",
    "QUANT_BLOCK",
    "Topology",
    "comm_rows",
    "phase_time",
    "step_phases",
]

QUANT_BLOCK = 2048  # qwZ/qgZ: ZeroConfig.quantization_block's default (elements per int8 block, one fp32 scale)
_FLAG_BYTES = 4  # the in-place layout's has-gradient flags: float32, all-reduced beside each reduction


@dataclass(frozen=True, slots=True)
class Link:
    bandwidth: float  # bytes/s per rank, per direction
    latency: float  # seconds per ring step


DEFAULT_INTRA = Link(450e9, 3e-6)  # NVLink 4 (H100/H200): 900 GB/s both ways = 450 GB/s per direction
DEFAULT_INTER = Link(400e9 / 8, 10e-6)  # one 400 Gb/s NIC per GPU (InfiniBand NDR / 400G RoCE)


@dataclass(frozen=True, slots=True)
class Topology:
    nodes: int
    gpus_per_node: int
    intra: Link = DEFAULT_INTRA
    inter: Link = DEFAULT_INTER

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"planner: {name} must be an int >= 1; got {v!r}")
        for name in ("intra", "inter"):
            link = getattr(self, name)
            if not (link.bandwidth > 0 and link.latency >= 0):
                raise ValueError(f"planner: {name} link needs bandwidth > 0 and latency >= 0; got {link!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def flat_network(self) -> str:
        return "inter" if self.nodes > 1 else "intra"

    def link(self, network: str) -> Link:
        return self.intra if network == "intra" else self.inter


@dataclass(frozen=True, slots=True)
class Option:
    hierarchical: bool = False  # shard group = node (HSDP / MiCS)
    hpz: bool = False
    qwz: bool = False
    qgz: bool = False
    accumulate: bool = False  # stage 3: ZeroConfig.accumulate_full_grads under no_sync

    @property
    def name(self) -> str:
        parts = [n for n, on in (("hier", self.hierarchical), ("hpZ", self.hpz), ("qwZ", self.qwz)) if on]
        parts += [n for n, on in (("qgZ", self.qgz), ("accum", self.accumulate)) if on]
        return "+".join(parts) or "plain"


# Which options zero_plugin implements today (the rest are planned: rows to compare against).
IMPLEMENTED = {"hierarchical": True, "hpz": True, "qwz": True, "qgz": True, "accumulate": True}

_STAGE3 = [
    Option(),
    Option(hierarchical=True),
    Option(hpz=True),
    Option(qwz=True),
    Option(qgz=True),
    Option(hpz=True, qwz=True, qgz=True),
    Option(hierarchical=True, qwz=True),
]
OPTIONS: dict[int, list[Option]] = {0: [Option()], 1: [Option(), Option(hierarchical=True)], 2: [], 3: _STAGE3}
OPTIONS[2] = list(OPTIONS[1])
_ACCUMULATING = [Option(accumulate=True), Option(hierarchical=True, accumulate=True)]
_ACCUMULATING.append(Option(hierarchical=True, qwz=True, accumulate=True))


@dataclass(frozen=True, slots=True)
class Phase:
    """One kind of collective of a step: ``nbytes`` logical bytes per rank in ``calls`` calls."""

    what: str
    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "all_to_all"
    nbytes: float
    calls: int
    ranks: int
    network: str  # "intra" | "inter"
    counted_as: str = ""  # comm_stats kind (defaults to ``kind``)

    @property
    def stats_kind(self) -> str:
        return self.counted_as or self.kind


def phase_time(phase: Phase, link: Link) -> float:
    """[Note: alpha-beta model]: c·steps·α + (p-1)/p · L/β."""
    p = phase.ranks
    if p <= 1:
        return 0.0
    steps = 2 * (p - 1) if phase.kind == "all_reduce" else p - 1
    return phase.calls * steps * link.latency + (p - 1) / p * phase.nbytes / link.bandwidth


# -- sizes of one model's collectives ------------------------------------------------------------------
@dataclass(slots=True)
class _Sizes:
    """What the step's collectives carry, from the planner's trace (units, order, buckets)."""

    plan: Any
    in_place: bool
    pb: int = 0
    rb: int = 0
    members: dict = field(default_factory=dict)  # unit -> param indices with elements
    train: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        plan = self.plan
        self.pb, self.rb = plan.param_bytes, plan.reduce_bytes(plan.config)
        units = range(len(plan.trace.unit_names))
        self.members = {u: [i for i, p in enumerate(plan.params) if p.unit == u and p.numel] for u in units}
        self.train = {u: [i for i in self.members[u] if plan.params[i].requires_grad] for u in units}

    def numel(self, idx) -> int:
        return sum(self.plan.params[i].numel for i in idx)

    def padded(self, idx, p: int) -> int:
        return sum(ShardLayout(self.plan.params[i].numel, p, 0).shard_numel for i in idx)

    # stage 3 ------------------------------------------------------------------------------
    def gathered_units(self) -> tuple[list[int], list[int]]:
        """Units gathered in a steady-state forward, and again in backward ([Note: last unit kept] and
        [Note: root unit] in stage3/hooks.py: the root and the last unit of the forward stay gathered)."""
        order = self.plan.trace.forward_order
        forward = [u for u in [0, *order] if self.members[u]]
        if not self.plan.config.stage3.reshard_after_forward:
            return forward, []
        return forward, [u for u in order[:-1] if self.members[u]]

    def gather_bytes(self, u: int, p: int, wbytes: float) -> float:
        """One all-gather of unit ``u`` over ``p`` ranks: in place its elements, buffered its padded rows
        and the unit's tag ([Note: gather tag] in stage3/unit.py)."""
        idx = self.members[u]
        if self.in_place or p == 1:
            return self.numel(idx) * wbytes
        return p * (self.padded(idx, p) + _GATHER_TAG) * wbytes if idx else 0

    def quantized_gather_bytes(self, u: int, p: int) -> float:
        """qwZ: one packed row per rank, its padded chunks quantized, then the tag in 4 bytes ([Note: qwZ
        gather] in comm/quantized.py), in either layout."""
        idx = self.members[u]
        return p * (packed_numel(self.padded(idx, p), self.block) + 4) if idx else 0

    def secondary_gather_bytes(self, u: int, g: int) -> float:
        """hpZ: a buffered gather of the secondary shards over the node's g ranks, with the tag."""
        idx = self.members[u]
        return g * (self.padded(idx, g) + _GATHER_TAG) * self.pb if idx else 0

    def quantized_reduce_bytes(self, idx: list[int], p: int) -> float:
        """qgZ: one packed row per destination rank, sent by one all-to-all."""
        return p * packed_numel(self.padded(idx, p), self.block)

    @property
    def block(self) -> int:
        return getattr(self.plan.config, "quantization_block", QUANT_BLOCK)

    def reduce_units(self) -> list[int]:
        return [u for u in self.train if self.train[u]]

    def reduce_bytes(self, idx: list[int], p: int, rbytes: float) -> float:
        """One reduce-scatter over ``p`` ranks: in place the gradients' elements, buffered padded rows with
        one flag column per parameter ([Note: collective layouts])."""
        if self.in_place:
            return self.numel(idx) * rbytes
        return p * (self.padded(idx, p) + len(idx)) * rbytes

    def replica_bytes(self, idx: list[int], g: int, rbytes: float) -> float:
        """One all-reduce across the replica group ([Note: sum across replicas] in ``comm/layout.py``): the
        reduced shard of every member and its has-gradient flag, in the reduce dtype, logical 2x.  The
        shard is counted padded, which is exactly what shard rank 0 sends in either layout (and every rank
        when buffered); in place a rank whose regions end short sends their padding less."""
        return 2 * (self.padded(idx, g) + len(idx)) * rbytes

    # stages 0-2 -----------------------------------------------------------------------------
    def buckets(self, p: int, sharded: bool) -> list[list[int]]:
        """Parameter indices per gradient bucket, cut as ``grads/bucket.py`` cuts them."""
        trainable = [i for i, q in enumerate(self.plan.params) if q.requires_grad]
        slots = [
            SimpleNamespace(
                index=i,
                param=SimpleNamespace(numel=lambda i=i: self.plan.params[i].numel, element_size=lambda: self.pb),
                layout=ShardLayout(self.plan.params[i].numel, p if sharded else 1, 0),
            )
            for i in trainable
        ]
        bucket_bytes = int(self.plan.config.comm.bucket_size_mb * 2**20)
        return [[s.index for s in b.slots] for b in plan_buckets(slots, bucket_bytes, sharded=sharded)]


# -- phases of one step ----------------------------------------------------------------------------------
def step_phases(plan: Any, stage: int, option: Option, topo: Topology, accum: int = 1, in_place: bool = False):
    """The collectives of one optimizer step of ``accum`` micro-batches, as :class:`Phase` rows."""
    if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1:
        raise ValueError(f"planner: accum must be an int >= 1; got {accum!r}")
    sizes = _Sizes(plan, in_place)
    if stage == 3:
        phases = _stage3(sizes, option, topo, accum)
    else:
        phases = _replicated(sizes, stage, option, topo)
    # optim/loss_scale.py ``found_nonfinite``: one float32 flag all-reduced before each step (clip_grad_norm_,
    # when called, replaces it with its norm's all-reduce of one float64); with hierarchical sharding over
    # the shard group only, whose owned gradients replicas share bit for bit ([Note: sum across replicas])
    check = (topo.gpus_per_node, "intra") if option.hierarchical else (topo.world_size, topo.flat_network)
    phases.append(Phase("inf/NaN check before the step", "all_reduce", 2 * 4, 1, *check))
    return [ph for ph in phases if ph.ranks > 1 and (ph.nbytes or ph.calls)]


def _replicated(sizes: _Sizes, stage: int, option: Option, topo: Topology) -> list[Phase]:
    n, g, m, flat = topo.world_size, topo.gpus_per_node, topo.nodes, topo.flat_network
    rb, pb = sizes.rb, sizes.pb
    if stage == 0:
        buckets = sizes.buckets(n, sharded=False)
        total = sum(2 * (sizes.numel(b) + len(b)) * rb for b in buckets)  # the flags ride in the buffer
        return [Phase("gradient all-reduce", "all_reduce", total, len(buckets), n, flat)]
    p = g if option.hierarchical else n
    net = "intra" if option.hierarchical else flat
    buckets = sizes.buckets(p, sharded=True)
    out = [
        Phase(
            "gradient reduce-scatter",
            "reduce_scatter",
            sum(sizes.reduce_bytes(b, p, rb) for b in buckets),
            len(buckets),
            p,
            net,
        )
    ]
    if sizes.in_place:
        k = sum(len(b) for b in buckets)
        out.append(Phase("has-gradient flags", "all_reduce", 2 * _FLAG_BYTES * k, len(buckets), p, net))
    if option.hierarchical:
        across = sum(sizes.replica_bytes(b, g, rb) for b in buckets)
        out.append(Phase("gradient shard all-reduce across nodes", "all_reduce", across, len(buckets), m, "inter"))
    if sizes.in_place:  # every region in place, one gather per bucket as the step goes ([Note: pipelined step])
        gathered, calls = sizes.numel([i for b in buckets for i in b]) * pb, len(buckets)
    else:
        gathered, calls = sum(p * sizes.padded(b, p) * pb for b in buckets), len(buckets)
    out.append(Phase("parameter all-gather after the step", "all_gather", gathered, calls, p, net))
    return out


def _stage3(sizes: _Sizes, option: Option, topo: Topology, accum: int) -> list[Phase]:
    n, g, m, flat = topo.world_size, topo.gpus_per_node, topo.nodes, topo.flat_network
    forward, backward = sizes.gathered_units()
    fwd_p, fwd_net = (g, "intra") if option.hierarchical else (n, flat)
    bwd_p, bwd_net = (g, "intra") if (option.hierarchical or option.hpz) else (n, flat)

    def gathered(u: int, p: int, secondary: bool = False) -> float:
        if secondary:  # hpZ: the backward's gathers, not quantized
            return sizes.secondary_gather_bytes(u, p)
        return sizes.quantized_gather_bytes(u, p) if option.qwz else sizes.gather_bytes(u, p, sizes.pb)

    reductions = 1 if option.accumulate else accum
    out = [
        Phase(
            "weight all-gather, forward",
            "all_gather",
            accum * sum(gathered(u, fwd_p) for u in forward),
            accum * len(forward),
            fwd_p,
            fwd_net,
        ),
        Phase(
            "weight all-gather, backward",
            "all_gather",
            accum * sum(gathered(u, bwd_p, option.hpz) for u in backward),
            accum * len(backward),
            bwd_p,
            bwd_net,
        ),
    ]
    units = sizes.reduce_units()
    calls = reductions * len(units)
    p, net = (g, "intra") if option.hierarchical else (n, flat)
    k = sum(len(sizes.train[u]) for u in units)
    if option.qgz:
        q = reductions * sum(sizes.quantized_reduce_bytes(sizes.train[u], p) for u in units)
        out.append(Phase("int8 gradient all-to-all", "all_to_all", q, calls, p, net))
    else:
        rs = reductions * sum(sizes.reduce_bytes(sizes.train[u], p, sizes.rb) for u in units)
        out.append(Phase("gradient reduce-scatter", "reduce_scatter", rs, calls, p, net))
    if sizes.in_place or option.qgz:
        out.append(Phase("has-gradient flags", "all_reduce", reductions * 2 * _FLAG_BYTES * k, calls, p, net))
    if option.hierarchical:
        across = reductions * sum(sizes.replica_bytes(sizes.train[u], g, sizes.rb) for u in units)
        out.append(Phase("gradient shard all-reduce across nodes", "all_reduce", across, calls, m, "inter"))
    return out


# -- rows ---------------------------------------------------------------------------------------------------
def _extra_memory(plan: Any, option: Option, topo: Topology) -> float:
    """Bytes per rank an option adds to the model states: hpZ's secondary shard (1/G of the parameters
    in param dtype), accumulation's full gradients of every unit (in the reduce dtype)."""
    c = plan.counts
    extra = c["total"] * plan.param_bytes / topo.gpus_per_node if option.hpz else 0.0
    if option.accumulate:
        extra += c["trainable"] * plan.reduce_bytes(plan.config)
    return extra


def implemented(option: Option) -> bool:
    return all(IMPLEMENTED[f] for f in ("hierarchical", "hpz", "qwz", "qgz", "accumulate") if getattr(option, f))


def comm_rows(plan: Any, topo: Topology, accum: int = 1, stages=(0, 1, 2, 3), in_place: bool = False) -> list[dict]:
    """One row per (stage, option): bytes per rank per step on each network, time, model states per rank."""
    rows = []
    for stage in stages:
        options = list(OPTIONS[stage]) + (_ACCUMULATING if stage == 3 and accum > 1 else [])
        if topo.nodes == 1:  # one node: the shard group is the world; hpZ's secondary copy is the primary
            options = [o for o in options if not (o.hierarchical or o.hpz)]
        for option in options:
            phases = step_phases(plan, stage, option, topo, accum, in_place)
            # the row's option says how the states are sharded, whatever the plan's config.comm.shard_group_size
            shard_world = topo.gpus_per_node if option.hierarchical else topo.world_size
            setting = replace(plan.setting(topo.world_size, stage), shard_world=shard_world)
            states = plan.theory(setting)["total"] + _extra_memory(plan, option, topo)
            rows.append(
                {
                    "stage": stage,
                    "option": option,
                    "name": option.name,
                    "implemented": implemented(option),
                    "phases": phases,
                    "bytes": {net: sum(ph.nbytes for ph in phases if ph.network == net) for net in ("intra", "inter")},
                    "time": sum(phase_time(ph, topo.link(ph.network)) for ph in phases),
                    "model_states": states,
                }
            )
    return rows
