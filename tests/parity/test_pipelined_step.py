"""The stage-1/2 step bucket by bucket with each bucket's gather in flight ([Note: pipelined step] in
``zero_plugin/optim/pipelined_step.py``): the same parameters as a float64 single-process reference, bit for
bit those of the whole step, every rank alike; a step hook keeps the whole step and runs once per step.
Model, data and rank function: ``pipelined_step_workers.py``."""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_ranks
from tests.parity import pipelined_step_workers as w

# The pipelined step runs on gloo's in-place layout only; the buffered one (NCCL's, forced on gloo for the
# fuzzer and the parity runs) steps whole, which the rest of the parity suite covers.
pytestmark = pytest.mark.skipif(
    os.environ.get("ZERO_PLUGIN_BUFFERED_COLLECTIVES") == "1", reason="[Note: pipelined step]: in-place layout only"
)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("optimizer", list(w.OPTIMIZERS))
def test_pipelined_step_equals_the_whole_step_and_the_reference(world_size, stage, optimizer):
    ref = w.reference(world_size, optimizer)
    pipelined = run_ranks(world_size, w.train_worker, stage, optimizer, True)
    whole = run_ranks(world_size, w.train_worker, stage, optimizer, False)
    for rank, (got, base) in enumerate(zip(pipelined, whole)):
        assert got["pipelined"] and not base["pipelined"], f"rank {rank}: the path was not the one asked for"
        assert got["buckets"] >= 4, f"rank {rank}: bucket_size_mb should give a bucket per parameter"
        assert base["hook_calls"] == w.STEPS, f"rank {rank}: a step hook must run once per step"
        assert got["groups"] == base["groups"] == [5, 2], f"rank {rank}: param groups not restored"
        for step, (mine, whole_step, want) in enumerate(zip(got["params"], base["params"], ref, strict=True)):
            for name, p in want.items():
                where = f"rank {rank}, step {step}, {name}"
                assert torch.equal(mine[name], whole_step[name]), f"{where}: differs from the whole step"
                assert torch.equal(mine[name], pipelined[0]["params"][step][name]), f"{where}: differs from rank 0"
                torch.testing.assert_close(mine[name], p, rtol=0, atol=1e-12, msg=lambda m, at=where: f"{at}: {m}")
