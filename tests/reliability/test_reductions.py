"""Regression tests for two reduction bugs of issue 17.

* Stage 1 with several *synced* backwards before one step (accumulation without ``no_sync``, or
  ``backward(retain_graph=True)`` twice): after a reduction ``param.grad`` held the average only in this
  rank's own region and the sum (in place) or the local gradient (buffered) elsewhere, and the next
  backward added to that and reduced it again (update error 0.46).  Every stage must match one process
  (float64, 1e-10), with several buckets, in both collective layouts.
* ``reduce_dtype="fp32"`` with bf16 parameters: stages 1-2 rounded the reduced gradients back to bf16;
  stage 3 kept fp32.  Every stage must hand the optimizer the fp32 average of the ranks' bf16 gradients.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests import models
from tests.harness import run_ranks
from tests.reliability import reduction_workers as W

STEPS = 3


@functools.cache
def _batches() -> list:
    return models.make_batches("mlp", 2 * STEPS, world_size=1, per_rank_batch=12, seed=3)


@functools.cache
def _reference(mode: str) -> dict:
    return W.reference_synced_backwards(mode, _batches(), STEPS)


@pytest.mark.parametrize("mode", ["accumulate", "retain"])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "stage,buffered", [(0, False), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]
)
def test_several_synced_backwards_before_one_step(stage, buffered, world_size, mode):
    got = run_ranks(world_size, W.synced_backwards_worker, stage, buffered, mode, _batches(), STEPS)[0]
    ref = _reference(mode)
    worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    assert worst <= 1e-10, f"stage {stage}, N={world_size}, {'buffered' if buffered else 'in place'}: {worst:.3e}"


@pytest.mark.parametrize("stage,buffered", [(1, False), (1, True), (2, False), (2, True), (3, False), (3, True)])
def test_fp32_reduction_of_bf16_gradients_stays_fp32(stage, buffered):
    world = 2
    batch = _batches()[0]
    expected = run_ranks(1, W.local_bf16_grads, batch, world)[0]  # one thread, as the ranks
    for rank, grads in enumerate(run_ranks(world, W.reduced_grad_worker, stage, buffered, batch)):
        for name, (lo, hi, dtype, got) in grads.items():
            assert dtype == torch.float32, f"stage {stage} rank {rank} {name}: reduced gradient kept in {dtype}"
            want = expected[name][lo:hi]
            # the ranks sum fp32 casts of bf16 gradients: exact in fp64 up to fp32 rounding of the sum
            err = float((got - want).abs().max()) if hi > lo else 0.0
            assert err <= 1e-6 * (1 + (float(want.abs().max()) if hi > lo else 0.0)), (stage, rank, name, err)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clip_before_the_last_backward_does_not_hide_a_nan(stage):
    """The norm ``clip_grad_norm_`` cached for the step's inf/NaN check belonged to the gradients before the
    second backward; a NaN that backward brought on one rank was stepped (parameters became NaN)."""
    for rank, r in enumerate(run_ranks(2, W.clip_before_last_backward_worker, stage, False, _batches())):
        assert r["raised"] is None, r
        assert r["skipped"] == 1, f"stage {stage} rank {rank}: the NaN step was not skipped: {r}"
        if rank == 0:
            assert r["changed"] is False, f"stage {stage}: parameters changed by a skipped step"


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_fp16_backward_after_unscale_is_refused(stage):
    for r in run_ranks(2, W.clip_before_last_backward_worker, stage, True, _batches()):
        assert r["raised"] and "after this step's gradients were unscaled" in r["raised"], r
