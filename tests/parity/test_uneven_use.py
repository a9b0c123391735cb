"""Parameters used unevenly across ranks: gradients must be reduced in a rank-agreed order.

A gradient hook fires only for a parameter that received a gradient, so when ranks use parameters
unevenly (an expert that gets tokens on some ranks only, a block that ignores its weights on one rank,
a branch chosen by rank parity) buckets (stages 0-2) and units (stage 3) complete in different orders
on different ranks.  Reductions launched in completion order then pair different buckets across ranks:
gloo silently sums one bucket's gradient into another of the same size, and aborts the process when
the sizes differ.  Expected semantics are DDP's (``uneven_workers`` docstring), checked against a
single-process float64 reference to 1e-10 (only the summation order differs, see
``test_parity_stages012.py``).

Sweep: stages 0-3 x both collective layouts (gloo in place, and the rank-major buffered layout NCCL
uses, forced by ZERO_PLUGIN_BUFFERED_COLLECTIVES=1; stage 0 has one layout) x world sizes 2 and 3 x
bucket sizes (stages 0-2: one block per bucket, one parameter per bucket, the default single bucket;
stage 3 has none); inside each call, every case x {AdamW, SGD} (one of them where the other adds
nothing, see each test).  One ``run_ranks`` call per test.

Stage 3 with a block not called at all on one rank is not trainable (the gathers no longer pair): every
rank must raise a RuntimeError naming the unit, promptly, instead of aborting in gloo or hanging.
"""

from __future__ import annotations

import functools
import re

import pytest

from tests import harness
from tests.harness import RankError, run_ranks
from tests.parity import uneven_workers as W

TOL = 1e-10
STAGES = (0, 1, 2, 3)
WORLD_SIZES = (2, 3)
# "deferred": the buffered layout with the host reads of gather tags and has-gradient flags left pending
# until forced, as on CUDA ([Note: deferred host reads] in zero_plugin/comm/host_reads.py)
LAYOUTS = {"in_place": False, "buffered": True, "deferred": "deferred"}
# Generous: a parity call takes a few seconds; anything longer is a hang the harness turns into a failure.
CALL_TIMEOUT_S = 120
# Below W.COLLECTIVE_TIMEOUT_S: a divergence must be reported, not run into zero_plugin's hang timeout.
DIVERGENCE_TIMEOUT_S = 25


@functools.cache
def references(world_size: int) -> dict:
    return {(case, opt): W.reference(case, opt, world_size) for case in W.CASES for opt in W.OPTIMIZERS}


def _hook_launch_order(grad_order: list[str], groups: list[list[str]]) -> list[int]:
    """Order in which a reducer that launches a group as soon as its last gradient arrives, and flushes
    the incomplete groups at the end (in group order), would reduce ``groups``."""
    launched, done = [], set()
    for name in grad_order:
        done.add(name)
        for i, group in enumerate(groups):
            if i not in launched and set(group) <= done:
                launched.append(i)
    return launched + [i for i in range(len(groups)) if i not in launched]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", W.CASES)
def test_case_makes_hook_order_differ_between_ranks(case, world_size):
    """[Note: uneven bucket order] holds: with one bucket per parameter, and with one bucket (or unit)
    per block, completion order differs between rank 0 and some other rank at some step, and the groups
    paired by that difference have equal sizes in the per-block grouping (silent mixing, not an abort)."""
    model = W.build_model()
    names = [n for n, _ in model.named_parameters()]
    numel = dict((n, p.numel()) for n, p in model.named_parameters())
    per_block = [[n for n in names if n.startswith(f"blocks.{i}.")] for i in range(W.N_BLOCKS)]
    per_block.append([n for n in names if n.startswith("head.")])
    assert sum(numel[n] for n in per_block[0]) * 8 == W.BLOCK_BYTES
    for groups, what in (([[n] for n in names], "per parameter"), (per_block, "per block")):
        differs = False
        for step in range(W.STEPS):
            orders = [_hook_launch_order(o, groups) for o in W.gradient_order(case, world_size, step)]
            for other in orders[1:]:
                pairs = [(a, b) for a, b in zip(orders[0], other) if a != b]
                differs |= bool(pairs)
                if what == "per block":
                    sizes = {(sum(numel[n] for n in groups[a]), sum(numel[n] for n in groups[b])) for a, b in pairs}
                    assert all(x == y for x, y in sizes), (case, step, pairs, sizes)
        assert differs, f"{case}: {what} completion order is the same on every rank at every step"


def test_reference_moves_every_parameter_and_skips_the_unused_expert():
    """The checks are not vacuous: in every reference every parameter moves (each is used by some rank
    at some step), and at step 2 of "expert" no rank gives blocks.1.expert a gradient, so AdamW must
    skip it (a zero gradient instead would still move it: Adam's first moment and weight decay)."""
    init = dict(W.build_model().named_parameters())
    for world_size in WORLD_SIZES:
        for (case, opt), ref in references(world_size).items():
            assert ref.keys() == init.keys()
            still = [n for n in init if not (ref[n] - init[n]).abs().max() > 1e-4]
            assert not still, f"{case}/{opt}, {world_size} ranks: parameters that did not move: {still}"
        for rank, names in enumerate(W.gradient_order("expert", world_size, step=2)):
            assert not [n for n in names if n.startswith("blocks.1.expert.")], (world_size, rank, names)


def _discard_pool(world_size: int) -> None:
    """A divergence can leave unmatched collectives in the workers' process group: the next test gets
    fresh workers (a pool the harness already killed is not started again just to be closed)."""
    pool = harness._POOLS.get(world_size)
    if pool is not None and pool.alive():
        pool.close(force=True)


# Stage 0 all-reduces a flat bucket in either layout (zero_plugin/planner/replay.py), so it runs once.
STAGE_LAYOUTS = [(0, "in_place")] + [(stage, lay) for stage in STAGES[1:] for lay in ("in_place", "buffered")]
STAGE_LAYOUTS += [(1, "deferred"), (2, "deferred"), (3, "deferred")]  # stage 0 reads its flags at completion
BUCKETED = [(s, lay) for s, lay in STAGE_LAYOUTS if s < 3]


def check_parity(
    world_size: int, stage: int, layout: str, runs: list[tuple[str, str, str]], shard_group_size: int | None = None
) -> None:
    refs = references(world_size)
    try:
        errors = run_ranks(
            world_size, W.parity_worker, stage, LAYOUTS[layout], runs, refs, shard_group_size, timeout=CALL_TIMEOUT_S
        )
    except RankError:
        _discard_pool(world_size)  # ranks that timed out in a mismatched collective may still hold it
        raise
    for rank, per_run in enumerate(errors):
        bad = {k: f"{v:.3g}" for k, v in per_run.items() if not v <= TOL}
        assert not bad, f"rank {rank}: max |θ - θ_ref| > {TOL:g} (case/optimizer/bucket): {bad}"


@pytest.mark.parametrize("stage,layout", STAGE_LAYOUTS[1:], ids=[f"stage{s}-{lay}" for s, lay in STAGE_LAYOUTS[1:]])
def test_uneven_use_with_hierarchical_sharding(stage, layout):
    """4 ranks as 2 shard groups of 2 (ZeroConfig.shard_group_size=2): the expert used on rank 0 only has no
    gradient anywhere in the second shard group, which must still get it through the replica sum and its
    summed flags; the ignored block (last rank) and the branch (rank parity) likewise."""
    if stage == 3:
        runs = [(case, opt, "default") for case in W.CASES for opt in W.OPTIMIZERS]
    else:
        runs = [(case, opt, "block") for case in W.CASES for opt in W.OPTIMIZERS]
    check_parity(4, stage, layout, runs, shard_group_size=2)


@pytest.mark.parametrize("stage,layout", STAGE_LAYOUTS, ids=[f"stage{s}-{lay}" for s, lay in STAGE_LAYOUTS])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_uneven_use_matches_reference(world_size, stage, layout):
    """Stages 0-2 with one bucket per block (a block missing a gradient on one rank is reduced there in
    place of another block of the same size) and with the default single bucket (one order on every
    rank whatever the hooks do: AdamW alone); stage 3 (units are blocks)."""
    if stage == 3:
        runs = [(case, opt, "default") for case in W.CASES for opt in W.OPTIMIZERS]
    else:
        runs = [(case, opt, "block") for case in W.CASES for opt in W.OPTIMIZERS]
        runs += [(case, "adamw", "default") for case in W.CASES]
    check_parity(world_size, stage, layout, runs)


@pytest.mark.parametrize("stage,layout", BUCKETED, ids=[f"stage{s}-{lay}" for s, lay in BUCKETED])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_uneven_use_one_bucket_per_parameter(world_size, stage, layout):
    """Stages 0-2 with every parameter in its own bucket: reductions paired out of order differ in size.
    SGD only (its update is the raw gradient); the per-block test covers AdamW."""
    check_parity(world_size, stage, layout, [(case, "sgd", "tiny") for case in W.CASES])


# (absent block, whether it is larger, layout).  Today: blocks.1 same size is caught by the tag check,
# but rank 1's message names another unit; blocks.1 one parameter larger aborts rank 1 in gloo;
# blocks.2 (the last) blocks both ranks until the collective timeout, in either layout.
DIVERGENCE_CASES = [
    (1, False, "in_place"),
    (1, False, "buffered"),
    (1, True, "in_place"),
    (1, True, "buffered"),
    (2, False, "in_place"),
    (1, False, "deferred"),
]
DIVERGENCE_IDS = [f"blocks.{a}-{'larger' if big else 'same-size'}-{lay}" for a, big, lay in DIVERGENCE_CASES]


@pytest.mark.parametrize("absent,larger,layout", DIVERGENCE_CASES, ids=DIVERGENCE_IDS)
def test_block_not_called_on_one_rank_raises_on_every_rank(absent, larger, layout):
    """From step 1 on, rank 1 does not call ``blocks.<absent>`` at all, so its gathers no longer pair with
    rank 0's.  Every rank must raise a RuntimeError that names that block and says the order diverged,
    within the call's timeout: no rank may die (gloo aborts a process whose collective meets one of
    another size) or block until the collective timeout."""
    world_size, name = 2, f"blocks.{absent}"
    try:
        with pytest.raises(RankError) as info:
            run_ranks(world_size, W.divergence_worker, absent, larger, LAYOUTS[layout], timeout=DIVERGENCE_TIMEOUT_S)
    finally:
        _discard_pool(world_size)
    err = info.value
    assert not err.missing, f"ranks {err.missing} hung:\n{err}"
    assert sorted(err.tracebacks) == list(range(world_size)), f"not every rank raised:\n{err}"
    for rank, text in err.tracebacks.items():
        assert "worker exited" not in text, f"rank {rank} died (gloo abort?):\n{err}"
        assert "RuntimeError" in text, f"rank {rank}:\n{text}"
        assert "did not complete" not in text, f"rank {rank} waited for the collective timeout:\n{text}"
        assert name in text and re.search(r"diverg", text, re.IGNORECASE), (
            f"rank {rank}: the error must name {name} and say the order diverged:\n{text}"
        )
