"""Memory per rank and communication per step of stages 0-2 against the ZeRO paper's numbers.

Ψ is the model's parameter count (~295k, odd layer sizes), N the world size.

Memory (arXiv 1910.02054, section 5), measured after one step (so AdamW state
exists), zero_grad and another backward, i.e. where stage 2 holds its gradient
shards and not yet the step's temporaries:
  fp32 AdamW:        stage 0: 16Ψ, stage 1: 4Ψ + 4Ψ + 8Ψ/N, stage 2: 4Ψ + (4Ψ + 8Ψ)/N
  bf16 + fp32 master: stage 0: 2Ψ + 2Ψ + 12Ψ, stage 1: 2Ψ + 2Ψ + 12Ψ/N, stage 2: 2Ψ + (2Ψ + 12Ψ)/N
Three counts are held against it: ``zp.memory_report``'s measured bytes; an
independent sum of the distinct storages of params, grads, optimizer params,
optimizer state and the engine's grad shards; and every live Python tensor's
storage (so a buffer the engine keeps but does not report would show).

Tolerance ``MEMORY_TOL_BYTES`` = 4 KiB: a rank's share of one parameter differs
from numel/N by fewer than N elements (ceil-sized chunks, the last ranks
short), at most 16 bytes each, plus AdamW's 4-byte ``step`` tensor per
parameter: 6 tensors x (4 x 16 + 4) B ~ 400 B on 4 ranks. 4 KiB is under 0.3%
of the smallest total measured (1.6 MB) and far below any stage-to-stage gap.

Communication per step and rank (section 7): 2Ψ elements for every stage
(all-reduce = reduce-scatter + all-gather), counted by ``zp.comm_stats()`` in
logical bytes; stages 1-2 move the padded size (each parameter rounded up to a
multiple of N elements). The clip norm's all-reduce (one float64 -> 16 logical
bytes, stages 1-2 only, where grads are sharded) is checked separately and
subtracted.
"""
from __future__ import annotations

import pytest

from tests.harness import run_ranks
from tests.unit import memory_comm_workers as workers

STAGES = (0, 1, 2)
MEMORY_TOL_BYTES = 4096
CLIP_BYTES = 16   # all_reduce of one float64: 2 x 8 logical bytes
# The step's inf/NaN check reuses the (global) clip norm when clip_grad_norm_ ran, so no extra collective.

PSI, PARAM_SIZES = workers.numel_of_model()


def theory(stage: int, world_size: int, mixed: bool) -> dict[str, float]:
    low = 2 if mixed else 4             # bytes of a parameter / gradient element
    optimizer = 12 if mixed else 8      # fp32 (master +) exp_avg + exp_avg_sq
    out = {"params": low * PSI,
           "grads": low * PSI / (world_size if stage >= 2 else 1),
           "optimizer": optimizer * PSI / (world_size if stage >= 1 else 1)}
    out["total"] = sum(out.values())
    return out


def test_model_is_large_and_odd():
    assert 2e5 < PSI < 5e5
    assert any(n % 2 for n in PARAM_SIZES) and any(n % 3 for n in PARAM_SIZES)


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", STAGES)
def test_memory_matches_theory(stage, world_size, mixed):
    want = theory(stage, world_size, mixed)
    for rank, r in enumerate(run_ranks(world_size, workers.memory_worker, stage, mixed)):
        report = r["report"]
        where = f"stage {stage}, N={world_size}, {'bf16' if mixed else 'fp32'}, rank {rank}"
        assert report["trainable_params"] == PSI and report["frozen_params"] == 0
        for key, value in want.items():
            assert report["theory"][key] == pytest.approx(value, abs=1), f"{where}: theory[{key}]"
            got = report["measured"][key]
            assert abs(got - value) <= MEMORY_TOL_BYTES, f"{where}: measured[{key}] {got} vs theory {value:.0f}"
        assert abs(r["independent"] - want["total"]) <= MEMORY_TOL_BYTES, \
            f"{where}: independent count {r['independent']} vs theory {want['total']:.0f}"
        assert abs(r["live"] - want["total"]) <= MEMORY_TOL_BYTES, \
            f"{where}: live tensors {r['live']} vs theory {want['total']:.0f} (memory the report does not see?)"
        # ZeRO-2 keeps no full gradient in .grad; stages 0-1 keep all of them.
        assert r["full_grads"] == (0 if stage == 2 else len(PARAM_SIZES)), where


def padded_numel(world_size: int, sharded: bool) -> int:
    if not sharded:
        return PSI
    return sum(-(-n // world_size) * world_size for n in PARAM_SIZES)


def kinds(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k != "total"}


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_communication_per_step_is_two_psi(stage, world_size, mixed):
    elem = 2 if mixed else 4
    sharded = stage >= 1
    padded = padded_numel(world_size, sharded)
    # Each reduction carries one "has a gradient" flag per parameter (grads/reducer.py, [Note: unused
    # parameters]): world_size flags per parameter in a reduce-scatter input, one (counted twice) in an all-reduce.
    n_params = len(PARAM_SIZES)
    flags = world_size * n_params if sharded else n_params
    for rank, ph in enumerate(run_ranks(world_size, workers.comm_worker, stage, mixed, 0.25)):
        where = f"stage {stage}, N={world_size}, rank {rank}"
        assert kinds(ph["no_sync_backward"]) == {}, f"{where}: no_sync must not communicate"
        if sharded:
            assert set(kinds(ph["backward"])) == {"reduce_scatter"}, where
            assert ph["backward"]["reduce_scatter"]["bytes"] == (padded + flags) * elem, where
            assert kinds(ph["clip"]) == {"all_reduce": {"calls": 1, "bytes": CLIP_BYTES}}, where
            assert set(kinds(ph["step"])) == {"all_gather"}, where
            assert ph["step"]["all_gather"]["bytes"] == padded * elem, where
        else:
            assert set(kinds(ph["backward"])) == {"all_reduce"}, where
            assert ph["backward"]["all_reduce"]["bytes"] == 2 * (PSI + flags) * elem, where
            assert kinds(ph["clip"]) == {} and kinds(ph["step"]) == {}, where
        assert ph["backward"]["total"]["calls"] > 1, f"{where}: bucket_size_mb=0.25 should give several buckets"
        per_step = sum(ph[p]["total"]["bytes"] for p in ("backward", "clip", "step"))
        per_step -= ph["clip"]["total"]["bytes"]
        assert per_step == (2 * padded + flags * (1 if sharded else 2)) * elem, where
        # Padding and flags: fewer than N elements per parameter moved twice, plus the flags.
        assert 0 <= per_step - 2 * PSI * elem < (2 * world_size * n_params + 2 * flags) * elem, where


def _spy_by_kind(spy: dict) -> dict:
    out: dict = {}
    for name, calls in spy.items():
        kind = workers.COUNTED.get(name, name)
        out[kind] = out.get(kind, 0) + calls
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_every_collective_goes_through_the_counter(stage, world_size):
    """Every torch.distributed collective seen by spies equals comm_stats()'s calls, kind by kind."""
    for rank, r in enumerate(run_ranks(world_size, workers.spy_worker, stage, False)):
        where = f"stage {stage}, N={world_size}, rank {rank}"
        assert {"_ALL_GATHER", "_REDUCE_SCATTER", "all_reduce", "barrier"} <= set(r["wrapped"]), where
        counted = {k: v["calls"] for k, v in kinds(r["stats"]).items()}
        # On gloo a reduce-scatter is issued as an in-place all-reduce (collectives.py, same wire traffic):
        # each logical reduce_scatter shows up as one torch all_reduce call.
        physical = dict(counted)
        moved = physical.pop("reduce_scatter", 0)
        if moved:
            physical["all_reduce"] = physical.get("all_reduce", 0) + moved
        assert _spy_by_kind(r["spy"]) == physical, f"{where}: spies {r['spy']} vs comm_stats {counted}"
        step_kinds = {"reduce_scatter", "all_gather"} if stage else {"all_reduce"}
        assert step_kinds <= set(counted), where


def test_counter_check_catches_a_bypass():
    """Control: one raw torch.distributed.all_reduce is seen by the spies and missing from comm_stats()."""
    for r in run_ranks(2, workers.spy_worker, 2, False, bypass=True):
        spied = _spy_by_kind(r["spy"])
        stats = r["stats"]
        logical = stats.get("all_reduce", {}).get("calls", 0) + stats.get("reduce_scatter", {}).get("calls", 0)
        assert spied["all_reduce"] == logical + 1   # gloo issues reduce-scatters as all-reduces
