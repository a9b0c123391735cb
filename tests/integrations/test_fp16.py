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
def test_accelerate_fp16_matches_ddp_grad_scaler(stage, ddp_reference):
    ref = ddp_reference
    got = run_ranks(2, fw.accelerate_fp16_run, stage)
    assert any(ref[0]["skipped"]) and not all(ref[0]["skipped"]), ref[0]["skipped"]
    for rank in range(2):
        assert got[rank]["skipped"] == ref[rank]["skipped"], (rank, got[rank]["skipped"], ref[rank]["skipped"])
        assert got[rank]["lrs"] == pytest.approx(ref[rank]["lrs"], rel=1e-12)   # the scheduler saw the skips
        assert got[rank]["loss_scale"] == ref[rank]["loss_scale"]
        err = _max_rel_loss_diff(got[rank]["losses"], ref[rank]["losses"])
        assert err < LOSS_RTOL, (rank, err, got[rank]["losses"], ref[rank]["losses"])
    assert got[0]["param_dtypes"] == ["torch.float16"]   # compute in fp16; the fp32 masters are the state below
    err = _max_weight_diff(got[0]["state"], ref[0]["state"])
    assert err < WEIGHT_ATOL, err


@pytest.fixture(scope="module")
def lightning_ddp_reference():
    return run_ranks(2, fw.lightning_fp16_run, "ddp")


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_lightning_16_mixed_matches_ddp_grad_scaler(strategy, lightning_ddp_reference):
    ref = lightning_ddp_reference
    got = run_ranks(2, fw.lightning_fp16_run, strategy)
    scales = ref[0]["scales"]
    assert any(b < a for a, b in zip([fw.INIT_SCALE] + scales, scales)), scales   # some step was skipped
    for rank in range(2):
        assert got[rank]["scales"] == ref[rank]["scales"], (rank, got[rank]["scales"], ref[rank]["scales"])
        err = _max_rel_loss_diff(got[rank]["losses"], ref[rank]["losses"])
        assert err < LOSS_RTOL, (rank, err)
    assert got[0]["global_step"] == ref[0]["global_step"]
    err = _max_weight_diff(got[0]["state"], ref[0]["state"])
    assert err < WEIGHT_ATOL, err


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_fabric_16_mixed_matches_ddp_grad_scaler(strategy):
    ref = run_ranks(2, fw.fabric_fp16_run, "ddp")
    got = run_ranks(2, fw.fabric_fp16_run, strategy)
    scales = ref[0]["scales"]
    assert any(b < a for a, b in zip([fw.INIT_SCALE] + scales, scales)), scales
    for rank in range(2):
        assert got[rank]["scales"] == ref[rank]["scales"], (rank, got[rank]["scales"], ref[rank]["scales"])
        err = _max_rel_loss_diff(got[rank]["losses"], ref[rank]["losses"])
        assert err < LOSS_RTOL, (rank, err)
    err = _max_weight_diff(got[0]["state"], ref[0]["state"])
    assert err < WEIGHT_ATOL, err
