"""Stage-3 gradient accumulation under ``zp.no_sync``: reduce every micro-batch (default) or keep the full
gradients and reduce once (``ZeroConfig.accumulate_full_grads``, [Note: deferred reduction] in
zero_plugin/stage3/accumulate.py), also with hierarchical sharding (``shard_group_size=2`` on 4 ranks), against a single-process float64 reference.

Model and data: ``accumulate_workers`` (parameters used unevenly across micro-batches and ranks, one expert
unused by every rank in every micro-batch of a step, clipping after accumulation).  Tolerance 1e-10
absolute on the parameters and relative on the clip norms: the modes sum the same float64 gradients in
another order (see ``test_parity_stages012.py`` for the reasoning).  Also checked: with the field, each
unit is reduced exactly once per optimizer step (counted at ``Comm``), A times without it.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.harness import run_ranks
from tests.parity import accumulate_workers as W

TOL = 1e-10
UNITS = ["<root>", "blocks.0", "blocks.1", "blocks.2"]  # the root holds the head

CASES = [
    (ws, keep, layout, extra)
    for ws in (2, 3)
    for keep in (False, True)
    for layout, extra in (("in_place", "none"), ("buffered", "none"), ("in_place", "offload"))
] + [(2, True, "in_place", "offload_params"), (3, True, "buffered", "offload_params")]
# hierarchical sharding: 4 ranks as 2 shard groups of 2, the kept gradients reduced in the group, then
# summed across it ([Note: sum across replicas] in zero_plugin/comm/layout.py)
CASES += [(4, True, "in_place", "hier"), (4, True, "buffered", "hier"), (4, False, "in_place", "hier")]
# the buffered layout with its host reads (gather tags, has-gradient flags) left pending until forced, as on
# CUDA ([Note: deferred host reads] in zero_plugin/comm/host_reads.py): the flags of a unit used on some
# micro-batches only are read once per backward
CASES += [(2, False, "deferred", "none"), (3, True, "deferred", "none"), (2, False, "deferred", "offload_params")]
LAYOUT_ARG = {"in_place": False, "buffered": True, "deferred": "deferred"}
EXTRA = {
    "none": {},
    "offload": {"offload_optimizer": "cpu"},
    "offload_params": {"offload_optimizer": "cpu", "offload_params": True},
    "hier": {"shard_group_size": 2},
}


@functools.cache
def reference(world_size: int) -> dict:
    return W.reference(world_size)


@pytest.mark.parametrize(
    "world_size,keep,layout,extra", CASES, ids=[f"ws{w}-{'keep' if k else 'each'}-{la}-{e}" for w, k, la, e in CASES]
)
def test_accumulation_matches_reference(world_size, keep, layout, extra):
    ref = reference(world_size)
    config = {"accumulate_full_grads": keep, **EXTRA[extra]}
    for rank, r in enumerate(run_ranks(world_size, W.train_worker, config, LAYOUT_ARG[layout])):
        where = f"rank {rank}"
        err = max((r["params"][n] - ref["params"][n]).abs().max().item() for n in ref["params"])
        assert err <= TOL, f"{where}: max |θ - θ_ref| = {err:.3g}"
        for got, want in zip(r["norms"], ref["norms"]):
            assert abs(got - want) <= TOL * want, f"{where}: clip norm {got} vs {want}"
        per_step = W.ACCUM if not keep else 1  # [Note: deferred reduction]: once per optimizer step
        for step, seen in enumerate(r["reductions"]):
            assert seen == {u: per_step for u in UNITS}, f"{where}, step {step}: reductions {seen}"


def test_reference_clips_and_skips():
    """The checks bite: clipping is active on some step, and block 2's expert is unused at step 1."""
    for world_size in (2, 3):
        ref = reference(world_size)
        assert any(n > W.MAX_NORM for n in ref["norms"]), ref["norms"]
        assert all(W.block_modes(r, world_size, 1, m)[2] == "dense" for r in range(world_size) for m in range(3))


def test_kept_gradients_are_counted_refused_and_discarded():
    results = run_ranks(2, W.behaviour_worker)
    fresh = run_ranks(2, W.fresh_grads_worker)
    for rank, (r, want) in enumerate(zip(results, fresh)):
        # every parameter that got a gradient in micro-batch 0 is kept whole: float64, all of block 2's expert
        # is unused there, so less than the whole model and more than its shards
        assert r["before"] == 0
        assert r["numel"] * 8 / 2 < r["kept"] <= r["numel"] * 8, (rank, r["kept"])
        assert set(r["errors"]) == {"clip", "step"}, r["errors"]
        assert all("accumulate_full_grads" in msg for msg in r["errors"].values())
        assert r["after_zero_grad"] == 0
        assert r["reduced_bytes"] > 0
        assert r["grads"].keys() == want.keys()
        for name, g in want.items():
            assert (r["grads"][name] - g).abs().max().item() <= TOL, (rank, name)


def test_mixed_precision_keeps_gradients_in_the_reduce_dtype():
    """bf16 parameters, fp32 reductions: the kept gradients are fp32 (4 bytes per element of the parameters
    that got one), and both modes give the same shard gradients up to fp32 rounding."""
    each = run_ranks(2, W.mixed_worker, False)
    keep = run_ranks(2, W.mixed_worker, True)
    numel = sum(p.numel() for p in W.build_model().parameters())
    for rank, (a, b) in enumerate(zip(each, keep)):
        assert a["held"] <= numel * 4 / 2 + 64 < b["held"] <= numel * 4, (rank, a["held"], b["held"])
        assert a["grads"].keys() == b["grads"].keys()
        for name, g in a["grads"].items():
            assert b["grads"][name].dtype == g.dtype == torch.float32
            err = (b["grads"][name] - g).abs().max().item()
            assert err <= 1e-6 * max(g.abs().max().item(), 1e-3), (rank, name, err)
