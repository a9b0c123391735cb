"""``zp.tiled_lm_loss`` at stage 3 on 2 ranks (issue #50, item 2): a real-shaped float32 Llama whose untied
4096 x 256 LM head is a stage-3 unit of its own, its backbone run inside the model's forward and the head's
weight read by the tiled loss outside the head's forward ([Note: direct reads of the output embedding] in
zero_plugin/stage3/direct_reads.py), against the same model trained with its own (untiled) loss at stage 3 and at
stage 0 (DDP): per-rank losses to 1e-6 relative, parameters after 2 SGD steps to update-norm error 1e-5.  Labels
-100 in part of a row and in a whole row."""

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
