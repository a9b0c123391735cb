"""Non-finite gradients never reach the weights, and every rank makes the same skip decision."""
from __future__ import annotations

import pytest

from tests.harness import run_ranks
from tests.reliability import numerics_workers as NW


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_inf_on_one_rank_skips_step_everywhere_and_lowers_scale(stage):
    results = run_ranks(2, NW.poisoned_step_worker, stage, "fp16", "inf")
    for r in results:
        assert r["changed"] == [True, False, True], r      # step 1 skipped on every rank, training continues
        assert r["skipped"] == [0, 1, 1]
        assert r["scales"][1] == r["scales"][0] / 2         # dynamic scale backed off
        assert r["finite"]
    assert results[0]["scales"] == results[1]["scales"]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_needs_no_scaler(stage):
    r = run_ranks(2, NW.poisoned_step_worker, stage, "bf16", "1.0")[0]
    assert r["scales"] == [1.0, 1.0, 1.0] and r["changed"] == [True, True, True] and r["skipped"] == [0, 0, 0]


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_nan_loss_without_scaler_is_reported_not_stepped(stage):
    results = run_ranks(2, NW.poisoned_step_worker, stage, None, "nan")
    for r in results:
        assert r["changed"] == [True, False, True] and r["skipped"] == [0, 1, 1] and r["finite"]
        assert any("non-finite gradient" in w for w in r["warnings"]), r["warnings"]
