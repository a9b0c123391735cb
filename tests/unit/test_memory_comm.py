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
logical bytes; with gloo's in-place layout stages 1-2 move exactly Ψ each way, with the
rank-major buffered layout (NCCL's, forced in one parametrization) the padded size (each parameter
rounded up to a multiple of N elements). The clip norm's all-reduce (one float64 -> 16 logical
bytes, stages 1-2 only, where grads are sharded) is checked separately and
subtracted.
"""

from __future__ import annotations

import pytest

from tests.harness import run_ranks
from tests.unit import memory_comm_workers as workers

STAGES = (0, 1, 2)
MEMORY_TOL_BYTES = 4096
CLIP_BYTES = 16  # all_reduce of one float64: 2 x 8 logical bytes
# The step's inf/NaN check reuses the (global) clip norm when clip_grad_norm_ ran, so no extra collective.

PSI, PARAM_SIZES = workers.numel_of_model()


def theory(stage: int, world_size: int, mixed: bool) -> dict[str, float]:
    low = 2 if mixed else 4  # bytes of a parameter / gradient element
    optimizer = 12 if mixed else 8  # fp32 (master +) exp_avg + exp_avg_sq
    out = {
        "params": low * PSI,
        "grads": low * PSI / (world_size if stage >= 2 else 1),
        "optimizer": optimizer * PSI / (world_size if stage >= 1 else 1),
    }
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
        assert abs(r["independent"] - want["total"]) <= MEMORY_TOL_BYTES, (
            f"{where}: independent count {r['independent']} vs theory {want['total']:.0f}"
        )
        assert abs(r["live"] - want["total"]) <= MEMORY_TOL_BYTES, (
            f"{where}: live tensors {r['live']} vs theory {want['total']:.0f} (memory the report does not see?) {r['unexplained']}"
        )
        # ZeRO-2 keeps no full gradient in .grad; stages 0-1 keep all of them.
        assert r["full_grads"] == (0 if stage == 2 else len(PARAM_SIZES)), where


def padded_numel(world_size: int, sharded: bool) -> int:
    if not sharded:
        return PSI
    return sum(-(-n // world_size) * world_size for n in PARAM_SIZES)


def kinds(stats: dict) -> dict:
    """Payload collectives (the control channel's small exchanges are checked on their own)."""
    return {k: v for k, v in stats.items() if k not in ("total", "control")}


LAYOUTS = [(0, "in_place"), (1, "in_place"), (1, "buffered"), (2, "in_place"), (2, "buffered")]


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage,layout", LAYOUTS)
def test_communication_per_step_is_two_psi(stage, layout, world_size, mixed):
    """``in_place`` (gloo's default): reductions sum the gradients in place and the parameter sync
    broadcasts each rank's region, so exactly Ψ elements each way, and the "has a gradient" flags ride
    in a float32 all-reduce of their own.  ``buffered`` (NCCL's layout, forced here): each parameter is
    padded to a multiple of N elements in rank-major buffers, and the flags are N extra columns of the
    reduce-scatter input.  Stage 0 has one layout (all-reduce of flat buckets)."""
    elem = 2 if mixed else 4
    sharded = stage >= 1
    buffered = layout == "buffered"
    moved = padded_numel(world_size, sharded) if buffered else PSI
    n_params = len(PARAM_SIZES)
    for rank, ph in enumerate(run_ranks(world_size, workers.comm_worker, stage, mixed, 0.25, buffered)):
        where = f"stage {stage}, N={world_size}, {layout}, rank {rank}"
        assert kinds(ph["no_sync_backward"]) == {}, f"{where}: no_sync must not communicate"
        if sharded:
            rs = ph["backward"]["reduce_scatter"]["bytes"]
            # stage 2: at the end of backward the ranks agree on late gradients, one float64 per bucket and
            # rank on the control channel ([Note: rank-agreed reduction order] in grads/schedule.py)
            late = {"calls": 1, "bytes": 8 * world_size * ph["backward"]["reduce_scatter"]["calls"]}
            assert ph["backward"].get("control") == (late if stage == 2 else None), where
            if buffered:  # flags: N columns per parameter in the reduce-scatter input
                assert set(kinds(ph["backward"])) == {"reduce_scatter"}, where
                flag_bytes = world_size * n_params * elem
                assert rs == (moved + world_size * n_params) * elem, where
            else:  # flags: one float32 per parameter, all-reduced (counted twice)
                assert set(kinds(ph["backward"])) == {"reduce_scatter", "all_reduce"}, where
                flag_bytes = 2 * 4 * n_params
                assert ph["backward"]["all_reduce"]["bytes"] == flag_bytes, where
                assert rs == moved * elem, where
            assert kinds(ph["clip"]) == {"all_reduce": {"calls": 1, "bytes": CLIP_BYTES}}, where
            assert set(kinds(ph["step"])) == {"all_gather"}, where
            assert ph["step"]["all_gather"]["bytes"] == moved * elem, where
        else:
            flag_bytes = 2 * n_params * elem
            assert set(kinds(ph["backward"])) == {"all_reduce"}, where
            assert ph["backward"]["all_reduce"]["bytes"] == 2 * PSI * elem + flag_bytes, where
            assert kinds(ph["clip"]) == {} and kinds(ph["step"]) == {}, where
        assert ph["backward"]["total"]["calls"] > 1, f"{where}: bucket_size_mb=0.25 should give several buckets"
        per_step = sum(sum(v["bytes"] for v in kinds(ph[p]).values()) for p in ("backward", "step"))
        assert per_step == 2 * moved * elem + flag_bytes, where
        # Padding (buffered only): fewer than N elements per parameter moved twice.
        assert 0 <= per_step - flag_bytes - 2 * PSI * elem < 2 * world_size * n_params * elem, where


@pytest.mark.parametrize("buffered", [False, True], ids=["in_place", "buffered"])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_every_collective_goes_through_the_counter(stage, world_size, buffered):
    """Every torch.distributed call seen by spies was issued by zero_plugin/comm/collectives.py (its own count
    of the calls it made, by function name), and each logical collective of the step was counted."""
    for rank, r in enumerate(run_ranks(world_size, workers.spy_worker, stage, False, False, buffered)):
        where = f"stage {stage}, N={world_size}, {'buffered' if buffered else 'in place'}, rank {rank}"
        assert {"_ALL_GATHER", "_REDUCE_SCATTER", "all_reduce", "barrier"} <= set(r["wrapped"]), where
        assert r["spy"] == r["physical"], f"{where}: spies {r['spy']} vs issued by Comm {r['physical']}"
        counted = {k: v["calls"] for k, v in kinds(r["stats"]).items()}
        step_kinds = {"reduce_scatter", "all_gather"} if stage else {"all_reduce"}
        assert step_kinds <= set(counted), where


def test_counter_check_catches_a_bypass():
    """Control: one raw torch.distributed.all_reduce is seen by the spies and missing from comm_stats()."""
    for r in run_ranks(2, workers.spy_worker, 2, False, bypass=True):
        assert r["spy"]["all_reduce"] == r["physical"]["all_reduce"] + 1
        assert {k: v for k, v in r["spy"].items() if k != "all_reduce"} == {
            k: v for k, v in r["physical"].items() if k != "all_reduce"
        }
