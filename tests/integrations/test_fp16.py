"""fp16 through the one-flag paths: Accelerate's ``mixed_precision="fp16"`` and Lightning's ``16-mixed`` run on
zero_plugin's synchronized loss scaler with fp16 parameters and fp32 masters, against DDP + torch's GradScaler
(same initial scale and growth interval; the initial scale is huge, so fp16 overflows and steps are skipped).

Tolerances: the reference keeps fp32 parameters and casts them to fp16 inside autocast, zero_plugin stores
them in fp16 (same rounding of the same masters), but the tensors autocast leaves alone (embedding output,
residual stream, RMSNorm weights) are fp16 here and fp32 there: fp16 rounding, ~1e-3 relative.
"""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.integrations import fp16_workers as fw

LOSS_RTOL = 5e-3
WEIGHT_ATOL = 5e-3   # AdamW at lr 1e-2: a step moves weights by ~1e-2, rounding changes it by far less


def _max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _max_rel_loss_diff(a: list, b: list) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def ddp_reference():
    return run_ranks(2, fw.ddp_grad_scaler_run)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accelerate_fp16_skips_and_trains_like_ddp_grad_scaler(stage, ddp_reference):
    """Every overflow DDP + GradScaler sees is skipped here too, on both ranks alike, the scheduler follows the
    skips (step_was_skipped), and up to the first step where only the fp16 parameters' gradients overflow
    (see [Note: fp16 one-flag mapping]: a gradient that is finite in fp32 but above 65504) the losses agree."""
    ref = ddp_reference
    got = run_ranks(2, fw.accelerate_fp16_run, stage)
    assert any(ref[0]["skipped"]) and not all(ref[0]["skipped"]), ref[0]["skipped"]
    assert got[0]["skipped"] == got[1]["skipped"]   # one decision for every rank
    mine, theirs = got[0]["skipped"], ref[0]["skipped"]
    first = next((i for i, (m, t) in enumerate(zip(mine, theirs, strict=True)) if m != t), len(mine))
    assert first >= 3 and (first == len(mine) or mine[first]), (mine, theirs)   # never misses an overflow
    # LambdaLR(1 / (1 + k)) after k scheduler steps; Accelerate's scheduler wrapper skips them with the optimizer
    # (Accelerate steps it once per process when batches are not split: 2 here)
    expected = [1e-2 / (1 + 2 * sum(not skipped for skipped in mine[:i + 1])) for i in range(len(mine))]
    assert got[0]["lrs"] == pytest.approx(expected, rel=1e-12), (got[0]["lrs"], expected)
    for rank in range(2):
        err = _max_rel_loss_diff(got[rank]["losses"][:first + 1], ref[rank]["losses"][:first + 1])
        assert err < LOSS_RTOL, (rank, err, got[rank]["losses"], ref[rank]["losses"])
    if stage < 3:   # stage 3 keeps the fp32 shard between uses and gathers it in fp16
        assert got[0]["param_dtypes"] == ["torch.float16"]
    if first == len(mine):
        assert _max_weight_diff(got[0]["state"], ref[0]["state"]) < WEIGHT_ATOL


def test_accelerate_fp16_is_the_same_run_at_every_stage():
    runs = [run_ranks(2, fw.accelerate_fp16_run, stage) for stage in (1, 3)]
    assert runs[0][0]["skipped"] == runs[1][0]["skipped"] and any(runs[0][0]["skipped"])
    assert runs[0][0]["loss_scale"] == runs[1][0]["loss_scale"]
    for rank in range(2):
        assert _max_rel_loss_diff(runs[1][rank]["losses"], runs[0][rank]["losses"]) < 1e-3
    assert _max_weight_diff(runs[1][0]["state"], runs[0][0]["state"]) < 1e-3
