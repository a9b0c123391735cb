"""Which link a collective's bytes use when the ranks stand for several nodes (``multinode.py``).

[Note: link attribution]
One rule for every variant, ours and the peers': a collective over a process group of g ranks is
modelled as a ring over the group's ranks in rank order (r0 -> r1 -> ... -> r0), which is how gloo
and NCCL's ring algorithms run it.  Each rank sends (g-1)/g of the collective's logical volume (the
report's counting: all-reduce 2n, reduce-scatter and all-to-all n inputs, all-gather n outputs,
broadcast n) over its one outgoing hop; a hop crosses nodes when its two ranks sit on different nodes
(node = rank // node_size).  Per rank and step, averaged over the ranks of the group:

    wire bytes  = logical × (g-1)/g
    inter-node  = wire × (hops that cross nodes) / g,   intra-node = wire - inter-node

``spanning`` is a second, cruder figure kept beside it: the whole logical volume of every collective
whose group spans nodes.  So a world collective over 4 ranks on 2 nodes of 2 crosses nodes on 2 of its 4 hops (half of its
wire bytes), a group inside one node never does, and a group of one rank per node always does.  The
group is what the collective ran on: torch's process group (its ranks) for DDP, FSDP2 and DeepSpeed,
the shard / replica / world Comm for zero_plugin ([Note: hierarchical groups] in
``zero_plugin/comm/collectives.py``).  Real NCCL picks trees or rings per size and node topology; the rule
is a model, applied alike to all.
"""

from __future__ import annotations

from typing import Iterable, Mapping

__all__ = ["crossing_hops", "link_bytes", "zp_groups"]


def crossing_hops(ranks: Iterable[int], node_size: int) -> int:
    """Hops of the ring over ``ranks`` (sorted) whose two ends sit on different nodes."""
    ring = sorted(ranks)
    if len(ring) < 2:
        return 0
    return sum(ring[i] // node_size != ring[(i + 1) % len(ring)] // node_size for i in range(len(ring)))


def link_bytes(by_group: Mapping[tuple[int, ...], float], node_size: int) -> dict[str, float]:
    """Logical bytes per group -> per-rank wire bytes inside a node and across nodes ([Note: link attribution])."""
    if node_size < 1:
        raise ValueError(f"node_size must be >= 1; got {node_size}")
    out = {"logical": 0.0, "wire": 0.0, "intra": 0.0, "inter": 0.0, "spanning": 0.0}
    for ranks, logical in by_group.items():
        g = len(ranks)
        wire = logical * (g - 1) / g if g > 1 else 0.0
        inter = wire * crossing_hops(ranks, node_size) / g if g > 1 else 0.0
        out["logical"] += logical
        out["wire"] += wire
        out["inter"] += inter
        out["intra"] += wire - inter
        out["spanning"] += logical if crossing_hops(ranks, node_size) else 0.0  # the cruder rule, for reference
    return out


def zp_groups(
    stats: Mapping[str, float], rank: int, world: int, shard: int | None, secondary: int | None = None
) -> dict[tuple[int, ...], float]:
    """zero_plugin's ``comm_stats`` bytes (already per step) by the ranks of the group they ran on.

    ``shard_group`` is this rank's k consecutive ranks, ``replica_group`` the ranks with the same index in
    every shard group; ``secondary_group`` (hpZ) this rank's ``secondary`` consecutive ranks; what is left of
    ``total`` ran over the whole world (setup, world-wide calls)."""
    everyone = tuple(range(world))
    out: dict[tuple[int, ...], float] = {}
    rest = float(stats.get("total", 0))
    if secondary and secondary != world:
        start = rank - rank % secondary
        out[tuple(range(start, start + secondary))] = b = float(stats.get("secondary_group", 0))
        rest -= b
    if shard and shard != world:
        start = rank - rank % shard
        shard_ranks = tuple(range(start, start + shard))
        replica_ranks = tuple(range(rank % shard, world, shard))
        s, r = float(stats.get("shard_group", 0)), float(stats.get("replica_group", 0))
        out[shard_ranks], out[replica_ranks] = s, r
        rest -= s + r
    assert rest >= -1e-6, f"group bytes {out} exceed the total {stats.get('total')}"
    out[everyone] = out.get(everyone, 0.0) + max(rest, 0.0)
    return out
