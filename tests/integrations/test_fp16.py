"""fp16 through Accelerate's one flag: ``mixed_precision="fp16"`` under zero_plugin trains exactly as DDP with
torch's GradScaler does (same initial scale and growth interval; the initial scale is huge, so fp16 overflows
and steps are skipped).

Both runs keep fp32 parameters and run the forward under ``autocast(fp16)``; only the GradScaler is replaced by
zero_plugin's synchronized loss scaler ([Note: fp16 one-flag mapping] in ``integrations/_loss_scaling.py``).
So the skipped steps must be the same, step for step, and the losses and weights differ only by the order in
which fp32 gradients are summed over ranks: 1e-5 relative.

Lightning's ``precision="16-mixed"`` stays refused by ``ZeroStrategy`` (tested in ``test_lightning.py``).
"""
from __future__ import annotations

import pytest

from tests.harness import run_ranks
from tests.integrations import fp16_workers as fw

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5


def _max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _max_rel_loss_diff(a: list, b: list) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def ddp_reference():
    ref = run_ranks(2, fw.ddp_grad_scaler_run)
    assert any(ref[0]["skipped"]) and not all(ref[0]["skipped"]), ref[0]["skipped"]   # the test can fail
    return ref


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accelerate_fp16_skips_and_trains_like_ddp_grad_scaler(stage, ddp_reference):
    """Every step DDP + GradScaler skips is skipped here, on both ranks, and no other; the scheduler follows the
    skips (``step_was_skipped``); losses, loss scale and final weights are DDP's."""
    ref = ddp_reference
    got = run_ranks(2, fw.accelerate_fp16_run, stage)
    for rank in range(2):
        assert got[rank]["skipped"] == ref[rank]["skipped"], (rank, got[rank]["skipped"], ref[rank]["skipped"])
        assert got[rank]["lrs"] == pytest.approx(ref[rank]["lrs"], rel=1e-12)
        err = _max_rel_loss_diff(got[rank]["losses"], ref[rank]["losses"])
        assert err < LOSS_RTOL, (rank, err, got[rank]["losses"], ref[rank]["losses"])
        assert got[rank]["loss_scale"] == ref[rank]["loss_scale"]
    assert got[0]["param_dtypes"] == ["torch.float32"]   # parameters stay fp32, as under Accelerate + DDP
    assert _max_weight_diff(got[0]["state"], ref[0]["state"]) < WEIGHT_ATOL
