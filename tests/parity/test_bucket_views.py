"""Stage 0's gradients as views of persistent bucket buffers ([Note: gradients as bucket views] in
``zero_plugin/grads/views.py``) against a float64 single-process reference, step by step: every
parameter's reduced gradient before the step and the parameters after it, through copy-in, in-place
accumulation into the views, ``no_sync`` micro-batches, two synced backwards per step, a parameter used
on one rank only and one used by none.  Model, schedule and reference: ``bucket_view_workers.py``."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.parity import bucket_view_workers as w


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage0_bucket_view_gradients_match_reference(world_size):
    ref = w.reference(world_size)
    results = run_ranks(world_size, w.train_worker)
    for rank, steps in enumerate(results):
        for step, (got, want) in enumerate(zip(steps, ref, strict=True)):
            where = f"rank {rank}, step {step} {w.SCHEDULE[step]}"
            assert got["buckets"] >= 2, f"{where}: bucket_size_mb should give several buckets"
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
