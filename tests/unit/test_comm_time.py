"""The planner's communication model (zero_plugin/planner/comm_time.py) and ``zero-plugin estimate --nodes``.

* Bytes: for one group (one node, option "plain") the planner's bytes per step, by collective kind, equal
  what ``zp.comm_stats()`` counts for a real step on gloo ranks (stages 0-3, world sizes 2 and 3, both
  collective layouts, accumulation with ``no_sync``, mixed precision), so the byte side of every row
  rests on the engine's own numbers.  The control channel's small exchanges are not payload.
* Hierarchical sharding: on 4 gloo ranks as 2 shard groups of 2 (planned as 2 nodes x 2 GPUs), stages 1-3,
  both layouts, with and without accumulation: the planner's intra-node bytes equal ``comm_stats``'
  ``shard_group`` entry, its inter-node bytes the ``replica_group`` entry (flags included; in place, shard
  rank 1 sends its short regions' padding less, computed independently here).
* Formulas: hand-computed alpha-beta times and per-link bytes for small cases ([Note: alpha-beta model]).
* CLI: the table, the flags and their errors.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests import models
from tests.harness import run_ranks
from tests.unit import comm_time_workers as workers
from zero_plugin import planner as zpp
from zero_plugin.comm.quantize import packed_numel
from zero_plugin.config import ZeroConfig
from zero_plugin.launch.cli import main
from zero_plugin.planner.comm_time import QUANT_BLOCK, Link, Option, Phase, Topology, phase_time, step_phases

BUCKET_MB = 2048 / 2**20  # a few parameters per bucket: several buckets at stages 0-2


@functools.cache
def odd_mlp_plan(config: ZeroConfig, param_dtype: str | None = None, model_dtype=torch.float64) -> zpp.Planner:
    model = models.make_odd_mlp(model_dtype)

    def inputs():
        return (torch.randn(workers.ROWS_PER_RANK, models.MLP_IN, dtype=model_dtype),), {}

    return zpp.Planner(model, inputs=inputs, config=config, param_dtype=param_dtype, device="cpu")


def planned(plan: zpp.Planner, stage: int, world_size: int, accum: int, in_place: bool, keep: bool = False) -> dict:
    out: dict[str, int] = {}
    option = Option(accumulate=keep)
    for ph in step_phases(plan, stage, option, Topology(1, world_size), accum, in_place=in_place):
        assert ph.network == "intra", ph
        out[ph.stats_kind] = out.get(ph.stats_kind, 0) + ph.nbytes
    return out


def measured(stats: dict) -> dict:
    return {k: v["bytes"] for k, v in stats.items() if k not in ("total", "control") and v["bytes"]}


CASES = [
    (stage, ws, layout, accum)
    for stage in (0, 1, 2, 3)
    for ws in (2, 3)
    for layout in (("in_place",) if stage == 0 else ("in_place", "buffered"))
    for accum in ((1, 2) if ws == 2 else (1,))
]


@pytest.mark.parametrize("stage,world_size,layout,accum", CASES, ids=[f"s{s}-ws{w}-{la}-A{a}" for s, w, la, a in CASES])
def test_planned_bytes_equal_comm_stats(stage, world_size, layout, accum):
    config = dict(stage=stage, bucket_size_mb=BUCKET_MB)
    plan = odd_mlp_plan(ZeroConfig(bucket_size_mb=BUCKET_MB))
    want = planned(plan, stage, world_size, accum, in_place=layout == "in_place")
    for rank, stats in enumerate(run_ranks(world_size, workers.step_stats, config, accum, layout == "buffered")):
        assert measured(stats) == want, f"rank {rank}: comm_stats {measured(stats)} vs planner {want}"


@pytest.mark.parametrize("world_size,layout", [(2, "in_place"), (3, "buffered")])
def test_planned_bytes_equal_comm_stats_with_kept_gradients(world_size, layout):
    """ZeroConfig.accumulate_full_grads: gathers every micro-batch, one reduction per step."""
    config = dict(stage=3, bucket_size_mb=BUCKET_MB, accumulate_full_grads=True)
    plan = odd_mlp_plan(ZeroConfig(bucket_size_mb=BUCKET_MB))
    want = planned(plan, 3, world_size, 3, in_place=layout == "in_place", keep=True)
    assert want != planned(plan, 3, world_size, 3, in_place=layout == "in_place")
    for stats in run_ranks(world_size, workers.step_stats, config, 3, layout == "buffered"):
        assert measured(stats) == want


@pytest.mark.parametrize("stage", [2, 3])
def test_planned_bytes_equal_comm_stats_mixed_precision(stage):
    """bf16 parameters reduced in fp32: gathers in 2 bytes, reductions in 4."""
    settings = dict(bucket_size_mb=BUCKET_MB, reduce_dtype="fp32")
    plan = odd_mlp_plan(ZeroConfig(**settings), "bf16", torch.float32)
    want = planned(plan, stage, 2, 2, in_place=True)
    config = dict(stage=stage, param_dtype="bf16", **settings)
    for stats in run_ranks(2, workers.step_stats, config, 2, False, torch.float32):
        assert measured(stats) == want


ZEROPP = [
    ("qwz", 2, "in_place", dict(quantized_weights=True)),
    ("qwz", 2, "buffered", dict(quantized_weights=True)),
    ("qgz", 2, "in_place", dict(quantized_gradients=True)),
    ("qwz+qgz", 2, "buffered", dict(quantized_weights=True, quantized_gradients=True)),
    ("hpz", 4, "in_place", dict(secondary_shard_size=2)),
    ("hpz+qwz+qgz", 4, "buffered", dict(secondary_shard_size=2, quantized_weights=True, quantized_gradients=True)),
]


@pytest.mark.parametrize("name,world_size,layout,switches", ZEROPP, ids=[f"{c[0]}-ws{c[1]}-{c[2]}" for c in ZEROPP])
def test_planned_bytes_equal_comm_stats_zeropp(name, world_size, layout, switches):
    """ZeRO++ (qwZ, qgZ, hpZ): the planner's bytes per kind equal comm_stats, with a block of 64 so that the
    odd MLP's rows span several blocks; hpZ's backward gathers equal the ``secondary_group`` entry."""
    config = dict(stage=3, bucket_size_mb=BUCKET_MB, quantization_block=64, **switches)
    plan = odd_mlp_plan(ZeroConfig(stage=3, bucket_size_mb=BUCKET_MB, quantization_block=64))
    option = Option(
        hpz="secondary_shard_size" in switches,
        qwz="quantized_weights" in switches,
        qgz="quantized_gradients" in switches,
    )
    topo = Topology(world_size // 2, 2)
    phases = step_phases(plan, 3, option, topo, 1, in_place=layout == "in_place")
    want: dict[str, float] = {}
    for ph in phases:
        want[ph.stats_kind] = want.get(ph.stats_kind, 0) + ph.nbytes
    for rank, stats in enumerate(run_ranks(world_size, workers.step_stats, config, 1, layout == "buffered")):
        got = {k: v for k, v in measured(stats).items() if not k.endswith("_group")}
        assert got == want, f"rank {rank}: comm_stats {got} vs planner {want}"
        if option.hpz:
            backward = next(ph for ph in phases if ph.what == "weight all-gather, backward")
            assert stats["secondary_group"]["bytes"] == backward.nbytes > 0


# -- formulas ----------------------------------------------------------------------------------------------
def test_ring_times_by_hand():
    link = Link(bandwidth=1e9, latency=1e-5)
    ag = Phase("x", "all_gather", 1e9, calls=2, ranks=4, network="intra")
    assert phase_time(ag, link) == pytest.approx(2 * 3 * 1e-5 + 3 / 4 * 1.0)
    rs = Phase("x", "reduce_scatter", 1e9, calls=1, ranks=4, network="intra")
    assert phase_time(rs, link) == pytest.approx(3e-5 + 0.75)
    ar = Phase("x", "all_reduce", 2e9, calls=1, ranks=4, network="intra")  # all-reduce of 1 GB: 2 GB logical
    assert phase_time(ar, link) == pytest.approx(2 * 3 * 1e-5 + 2 * 3 / 4 * 1.0)
    assert phase_time(Phase("x", "all_gather", 1e9, 1, 1, "intra"), link) == 0.0


SYN = 3200  # a bare count: 32 blocks of 100 fp32 elements, no root parameters


def _by_what(stage, option, topo, accum=1):
    plan = zpp.Planner(SYN)
    return {ph.what: ph for ph in step_phases(plan, stage, option, topo, accum, in_place=True)}


def test_stage3_multi_node_bytes_by_hand():
    topo = Topology(2, 4)  # 8 ranks
    plain = _by_what(3, Option(), topo)
    assert plain["weight all-gather, forward"].nbytes == SYN * 4 and plain["weight all-gather, forward"].calls == 32
    assert plain["weight all-gather, backward"].nbytes == 31 * 100 * 4  # the last block stays gathered
    assert plain["gradient reduce-scatter"].nbytes == SYN * 4
    assert {ph.network for ph in plain.values()} == {"inter"} and {ph.ranks for ph in plain.values()} == {8}
    hier = _by_what(3, Option(hierarchical=True), topo)
    assert hier["weight all-gather, forward"].network == "intra" and hier["weight all-gather, forward"].ranks == 4
    assert hier["gradient reduce-scatter"].network == "intra"
    across = hier["gradient shard all-reduce across nodes"]
    # per block ceil(100/4) shard elements and one has-gradient flag, all-reduced (2x)
    assert (across.network, across.ranks, across.nbytes) == ("inter", 2, 2 * 32 * (25 + 1) * 4)
    hpz = _by_what(3, Option(hpz=True), topo)
    assert hpz["weight all-gather, forward"].network == "inter"
    assert (hpz["weight all-gather, backward"].network, hpz["weight all-gather, backward"].ranks) == ("intra", 4)
    assert hpz["weight all-gather, backward"].nbytes == 31 * 4 * (25 + 2) * 4  # buffered, tagged, fp32
    qwz = _by_what(3, Option(qwz=True), topo)
    # per block and rank: ceil(100/8) = 13 int8 padded to 16 bytes, one 4-byte scale, the 4-byte tag
    assert QUANT_BLOCK == 2048 and packed_numel(13, QUANT_BLOCK) == 20
    assert qwz["weight all-gather, forward"].nbytes == 32 * 8 * (20 + 4)
    qgz = _by_what(3, Option(qgz=True), topo)
    a2a = qgz["int8 gradient all-to-all"]
    assert (a2a.nbytes, a2a.calls, a2a.ranks, a2a.network) == (32 * 8 * 20, 32, 8, "inter")
    assert "gradient reduce-scatter" not in qgz and qgz["has-gradient flags"].nbytes == 32 * 2 * 4


def test_accumulation_reduces_once_per_step():
    topo = Topology(1, 4)
    every = _by_what(3, Option(), topo, accum=3)
    once = _by_what(3, Option(accumulate=True), topo, accum=3)
    assert every["gradient reduce-scatter"].nbytes == 3 * SYN * 4 and every["gradient reduce-scatter"].calls == 96
    assert once["gradient reduce-scatter"].nbytes == SYN * 4 and once["gradient reduce-scatter"].calls == 32
    for what in ("weight all-gather, forward", "weight all-gather, backward"):
        assert once[what] == every[what]
    replicated = _by_what(2, Option(), topo, accum=3)  # no_sync: stages 0-2 reduce once anyway
    assert replicated["gradient reduce-scatter"].nbytes == SYN * 4


def test_rows_time_and_memory():
    plan = zpp.Planner(SYN)
    topo = Topology(2, 4, intra=Link(1e9, 0.0), inter=Link(1e8, 0.0))
    rows = {(r["stage"], r["name"]): r for r in zpp.comm_rows(plan, topo, accum=2)}
    # stage 2 plain: RS Ψ (+ flags) and AG Ψ, flat over 8 ranks across nodes: 7/8 of the bytes at 1e8 B/s
    r = rows[(2, "plain")]
    assert r["bytes"]["intra"] == 0 and r["time"] == pytest.approx(7 / 8 * r["bytes"]["inter"] / 1e8)
    # accumulation keeps the full gradients of every unit: + Ψ x 4 bytes per rank
    assert rows[(3, "accum")]["model_states"] - rows[(3, "plain")]["model_states"] == SYN * 4
    assert rows[(3, "hpZ")]["model_states"] - rows[(3, "plain")]["model_states"] == SYN * 4 / 4
    assert rows[(3, "hier")]["model_states"] == plan.theory(plan.setting(4, 3))["total"]
    assert rows[(3, "hier")]["bytes"]["inter"] < rows[(3, "plain")]["bytes"]["inter"] / 2
    assert [r["implemented"] for r in rows.values()].count(True) >= 5  # stages 0-3 plain, accumulation
    one_node = {r["name"] for r in zpp.comm_rows(plan, Topology(1, 8), accum=1)}
    assert "hier" not in one_node and "hpZ" not in one_node and "accum" not in one_node


# -- CLI ------------------------------------------------------------------------------------------------------
def test_cli_multi_node_table(capsys):
    argv = ["estimate", "--params", "8B", "--nodes", "4", "--gpus-per-node", "8", "--accum", "4", "--offload", "none"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "world size 32" in out
    assert "4 node(s) x 8 GPUs = 32 ranks, 4 micro-batch(es)" in out
    assert "NVLink 450 GB/s, 3 us; network 50 GB/s (400 Gb/s) per GPU, 10 us" in out
    lines = {tuple(line.split("|")[0].split()): line for line in out.splitlines() if "|" in line}
    assert "available" in lines[("3", "hier+qwZ")] and "available" in lines[("3", "accum")]
    assert "available" in lines[("3", "hpZ+qwZ+qgZ")]
    assert "available" in lines[("2", "plain")]
    assert "+14.90 GiB per rank (trainable parameters x 2 bytes" in out  # 8e9 bf16 full gradients


def test_cli_link_flags(capsys):
    argv = ["estimate", "--params", "1B", "--nodes", "2", "--inter-bw", "100Gb/s", "--intra-bw", "900GB/s"]
    assert main(argv + ["--inter-latency", "0.02ms", "--intra-latency", "2"]) == 0
    out = capsys.readouterr().out
    assert "NVLink 900 GB/s, 2 us; network 12.5 GB/s (100 Gb/s) per GPU, 20 us" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--nodes", "4", "--world-size", "16"], "--world-size 16 is not --nodes x --gpus-per-node = 4 x 8"),
        (["--accum", "0"], "accum must be an int >= 1"),
    ],
)
def test_cli_comm_errors(capsys, argv, message):
    assert main(["estimate", "--params", "1B", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--inter-bw", "fast"), ("--intra-latency", "3 parsecs")])
def test_cli_bad_link_values(capsys, flag, value):
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "1B", "--nodes", "2", flag, value])
    assert "expected a" in capsys.readouterr().err


# -- hierarchical sharding: shard group = "node" -------------------------------------------------------------
HIER_CASES = [(stage, layout, accum) for stage in (1, 2, 3) for layout in ("in_place", "buffered") for accum in (1, 2)]
HIER_CASES += [(3, "in_place", 3, True), (3, "buffered", 3, True)]  # with accumulate_full_grads


def planned_by_network(plan, stage: int, accum: int, in_place: bool, keep: bool = False) -> dict:
    option = Option(hierarchical=True, accumulate=keep)
    out: dict = {"intra": 0, "inter": 0, "kinds": {}}
    for ph in step_phases(plan, stage, option, Topology(2, 2), accum, in_place=in_place):
        out[ph.network] += ph.nbytes
        out["kinds"][ph.stats_kind] = out["kinds"].get(ph.stats_kind, 0) + ph.nbytes
    return out


def short_regions_bytes(plan, shard_rank: int, reductions: int) -> int:
    """In place a rank sends its own regions across groups; the planner counts padded shards (shard rank
    0's): the difference for ``shard_rank``, all-reduced (2x) in the reduce dtype."""
    from zero_plugin.tensors.flat import ShardLayout

    short = 0
    for p in plan.params:
        if p.requires_grad and p.numel:
            layout = ShardLayout(p.numel, 2, shard_rank)
            short += layout.shard_numel - layout.local_numel
    return reductions * 2 * short * plan.reduce_bytes(plan.config)


@pytest.mark.parametrize(
    "stage,layout,accum,keep",
    [c if len(c) == 4 else (*c, False) for c in HIER_CASES],
    ids=[f"s{c[0]}-{c[1]}-A{c[2]}{'-keep' if len(c) == 4 else ''}" for c in HIER_CASES],
)
def test_planned_hierarchical_bytes_equal_group_stats(stage, layout, accum, keep):
    """4 gloo ranks as 2 shard groups of 2 (``shard_group_size=2``), planned as ``--nodes 2 --gpus-per-node
    2``: intra-node bytes = ``comm_stats()["shard_group"]``, inter-node = ``["replica_group"]``, and by kind
    (every group together) the planner's kinds.  The cross-group all-reduce carries the has-gradient flags
    (one per member, in the reduce dtype) beside the reduced shards; the planner counts them."""
    config = dict(stage=stage, bucket_size_mb=BUCKET_MB, shard_group_size=2, accumulate_full_grads=keep)
    plan = odd_mlp_plan(ZeroConfig(bucket_size_mb=BUCKET_MB))
    in_place = layout == "in_place"
    want = planned_by_network(plan, stage, accum, in_place, keep)
    assert want["inter"] > 0 and want["intra"] > 0
    reductions = accum if stage == 3 and not keep else 1
    assert short_regions_bytes(plan, 1, 1) > 0, "odd shapes: shard rank 1's regions end short"
    for rank, stats in enumerate(run_ranks(4, workers.step_stats, config, accum, not in_place)):
        short = short_regions_bytes(plan, rank % 2, reductions) if in_place else 0
        where = f"rank {rank}: comm_stats {stats} vs planner {want}"
        assert stats["shard_group"]["bytes"] == want["intra"], where
        assert stats["replica_group"]["bytes"] == want["inter"] - short, where
        kinds = dict(want["kinds"], all_reduce=want["kinds"]["all_reduce"] - short)
        assert measured({k: v for k, v in stats.items() if not k.endswith("_group")}) == kinds, where


def test_rows_ignore_the_plans_shard_group_size():
    """Each row's option says how its states are sharded; ``--shard-group-size`` only sets the memory table."""
    topo = Topology(4, 8)
    want = [(r["name"], r["model_states"]) for r in zpp.comm_rows(zpp.Planner(SYN), topo)]
    for k in (8, 16):
        got = zpp.comm_rows(zpp.Planner(SYN, config=ZeroConfig(shard_group_size=k)), topo)
        assert [(r["name"], r["model_states"]) for r in got] == want
