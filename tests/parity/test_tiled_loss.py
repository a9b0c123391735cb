"""``zp.tiled_lm_loss`` at stage 3 on 2 ranks (issue #50, item 2): a real-shaped float32 Llama whose untied
4096 x 256 LM head is a stage-3 unit of its own, its backbone run inside the model's forward and the head's
weight read by the tiled loss outside the head's forward ([Note: direct reads of the output embedding] in
zero_plugin/stage3/direct_reads.py), against the same model trained with its own (untiled) loss at stage 3 and at
stage 0 (DDP): per-rank losses to 1e-6 relative, parameters after 2 SGD steps to update-norm error 1e-5.  Labels
-100 in part of a row and in a whole row.  With sequence parallelism (K = 2, ``sequence_parallel=model``) at stages
1 and 3: equal to one process's training on the whole sequences in float64."""

from __future__ import annotations

import functools

import pytest
import torch

from tests import models
from tests.harness import run_ranks
from tests.parity import tiled_loss_workers as workers

STEPS, WORLD = 2, 2


@functools.cache
def batches() -> list:
    out = models.make_batches("llama", STEPS, WORLD, per_rank_batch=2)
    for batch in out:
        batch["labels"][0, :5] = -100
        batch["labels"][3] = -100  # rank 1's second row: no label at all
    return out


@functools.cache
def run(stage: int, loss: str) -> list:
    return run_ranks(WORLD, workers.train_worker, stage, loss, batches())


@pytest.mark.parametrize("stage,loss", [(3, "model"), (0, "model"), (0, "tiled")])
def test_tiled_loss_at_stage_3_trains_as_the_untiled_loss(stage, loss):
    tiled = run(3, "tiled")
    assert "lm_head" in tiled[0]["units"], tiled[0]["units"]  # the head is a unit of its own
    other = run(stage, loss)
    init = dict(workers.build_model().state_dict())
    for rank in range(WORLD):
        got, want = torch.tensor(tiled[rank]["losses"]), torch.tensor(other[rank]["losses"])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    err = models.update_norm_error(tiled[0]["params"], other[0]["params"], init)
    print(f"stage 3 tiled vs stage {stage} {loss}: update-norm error {err:.3g}")
    assert err <= 1e-5, f"update-norm error {err:.3g}"
    assert not torch.equal(tiled[0]["params"]["lm_head.weight"], init["lm_head.weight"])  # the head trained


@pytest.mark.parametrize("stage", [1, 3])
def test_sequence_parallel_tiled_loss_equals_whole_sequence_training(stage):
    """K = 2 on 2 ranks (tests/parity/test_sequence_parallel.py's float64 Llama, -100 labels), the loss
    ``zp.tiled_lm_loss(..., sequence_parallel=model)`` with tiles of 3 of each rank's 2 x 8 tokens: every rank's
    loss and the parameters after 3 SGD steps equal one process's training on the whole sequences to 1e-12."""
    from tests.parity import sequence_workers as sw

    results = run_ranks(WORLD, workers.sequence_parallel_worker, stage, 3)
    ref = sw.reference(sw.Case(stage, 2), groups=1)
    for rank, out in enumerate(results):
        for step, loss in enumerate(out["losses"]):
            expected = ref["losses"][step][0]
            assert abs(loss - expected) <= 1e-12 * abs(expected), (rank, step, loss, expected)
    error = models.update_norm_error(results[0]["params"], ref["params"], ref["theta0"])
    print(f"stage {stage} K = 2 tiled: update-norm error {error:.3g}")
    assert error <= 1e-12, error
