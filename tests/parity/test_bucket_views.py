"""Stages 0 and 1 keep gradients as views of persistent bucket buffers ([Note: gradients as bucket views] in
``zero_plugin/grads/views.py``), checked against a float64 single-process reference, step by step: every
parameter's reduced gradient before the step (stage 1: its owned region) and the parameters after it, through
copy-in, in-place accumulation into the views, ``no_sync`` micro-batches, two synced backwards per step, a
parameter used on one rank only and one used by none; stage 1 in both collective layouts.  Model, schedule
and reference: ``bucket_view_workers.py``."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.parity import bucket_view_workers as w
from zero_plugin.tensors.flat import ShardLayout


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage0_bucket_view_gradients_match_reference(world_size):
    ref = w.reference(world_size)
    results = run_ranks(world_size, w.train_worker)
    for rank, steps in enumerate(results):
        for step, (got, want) in enumerate(zip(steps, ref, strict=True)):
            where = f"rank {rank}, step {step} {w.SCHEDULE[step]}"
            assert len(got["buffers"]) >= 2, f"{where}: bucket_size_mb should give several buckets"
            for name, g in want["grads"].items():
                mine = got["grads"][name]
                if g is None:
                    assert mine is None, f"{where}: {name} is used by no rank and must keep no gradient"
                    continue
                assert mine is not None, f"{where}: {name} has no gradient"
                torch.testing.assert_close(
                    mine, g, rtol=0, atol=1e-12, msg=lambda m, n=name, at=where: f"{at} {n}: {m}"
                )
                assert got["in_buffer"][name], f"{where}: {name}.grad is not a view of its bucket's buffer"
                assert torch.equal(mine, results[0][step]["grads"][name]), f"{where}: {name} differs from rank 0"
            for name, p in want["params"].items():
                torch.testing.assert_close(
                    got["params"][name], p, rtol=0, atol=1e-12, msg=lambda m, n=name, at=where: f"{at} {n}: {m}"
                )


@pytest.mark.parametrize("buffered", [False, True], ids=["in_place", "buffered"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_stage1_bucket_view_gradients_match_reference(world_size, buffered):
    """Stage 1: each rank's owned region of ``param.grad`` is the reference average, and in place (gloo)
    ``param.grad`` is a view of a bucket buffer that stays at the same address step after step, so a backward
    keeps no full gradient of its own.  The exceptions, by design: a second synced backward before one step
    keeps its fresh gradient (the view holds the first one's average, [Note: reduced regions and later
    backwards]); the buffered layout keeps no views (its rows are a copy anyway)."""
    ref = w.reference(world_size)
    results = run_ranks(world_size, w.train_worker, 1, buffered)
    for rank, steps in enumerate(results):
        first_ptrs = steps[0]["ptrs"]
        for step, (got, want) in enumerate(zip(steps, ref, strict=True)):
            where = f"rank {rank}, step {step} {w.SCHEDULE[step]}"
            if buffered:
                assert not got["buffers"], f"{where}: the buffered layout should keep no bucket views"
            else:
                assert len(got["buffers"]) >= 2, f"{where}: bucket_size_mb should give several buckets"
                assert got["buffers"] == steps[0]["buffers"], f"{where}: the bucket buffers moved"
            viewed = not buffered and w.SCHEDULE[step][2] != "synced"
            for name, g in want["grads"].items():
                mine = got["owned"][name]
                if g is None:
                    assert mine is None and got["grads"][name] is None, f"{where}: {name} is used by no rank"
                    continue
                region = ShardLayout(g.numel(), world_size, rank).local_view(g)
                assert mine is not None, f"{where}: {name} has no owned gradient"
                torch.testing.assert_close(
                    mine, region, rtol=0, atol=1e-12, msg=lambda m, n=name, at=where: f"{at} {n}: {m}"
                )
                full = got["grads"][name]
                assert full is not None and full.shape == g.shape, f"{where}: {name}.grad is not full"
                lo, hi = ShardLayout(g.numel(), world_size, rank).bounds()
                assert torch.equal(full.reshape(-1)[lo:hi], mine), f"{where}: {name}.grad's region is not the average"
                if viewed:
                    assert got["in_buffer"][name], f"{where}: {name}.grad is not a view of its bucket's buffer"
                    assert got["ptrs"][name] == first_ptrs[name], f"{where}: {name}.grad moved"
            for name, p in want["params"].items():
                torch.testing.assert_close(
                    got["params"][name], p, rtol=0, atol=1e-12, msg=lambda m, n=name, at=where: f"{at} {n}: {m}"
                )
