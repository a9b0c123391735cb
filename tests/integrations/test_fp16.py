"""fp16 through Accelerate's one flag: ``mixed_precision="fp16"`` under zero_plugin trains exactly as DDP with
torch's GradScaler does (same initial scale and growth interval; the initial scale is huge, so fp16 overflows
and steps are skipped).

Both runs keep fp32 parameters and run the forward under ``autocast(fp16)``; only the GradScaler is replaced by
zero_plugin's synchronized loss scaler ([Note: fp16 one-flag mapping] in ``integrations/loss_scaling.py``).
So the skipped steps must be the same, step for step, and the losses and weights differ only by the order in
which fp32 gradients are summed over ranks: 1e-5 relative.

Lightning's ``precision="16-mixed"`` takes the same path: ``test_lightning_fp16.py``.
"""

from __future__ import annotations

import pytest

import zero_plugin as zp
from tests.harness import run_ranks
from tests.integrations import fp16_workers as fw
from zero_plugin.integrations import loss_scaling as _loss_scaling

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
    assert any(ref[0]["skipped"]) and not all(ref[0]["skipped"]), ref[0]["skipped"]  # the test can fail
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
    assert got[0]["param_dtypes"] == ["torch.float32"]  # parameters stay fp32, as under Accelerate + DDP
    assert _max_weight_diff(got[0]["state"], ref[0]["state"]) < WEIGHT_ATOL


@pytest.fixture(scope="module")
def ddp_value_clip_reference():
    ref = run_ranks(2, fw.ddp_grad_scaler_run, "value")
    assert any(ref[0]["skipped"]) and not all(ref[0]["skipped"]), ref[0]["skipped"]
    return ref


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_accelerate_fp16_clip_by_value_skips_as_ddp(stage, ddp_value_clip_reference):
    """``clip_grad_value_`` under fp16: the skips are DDP's, and elementwise clipping makes the run DDP's bit for
    bit.  (Here the overflows reach the gradients as NaN, which a clamp keeps; an inf that the clamp would make
    finite must still skip the step, which ``test_lightning_fp16.py``'s Trainer runs show: they fail without
    ``GradGuard.check_before_clamp``.)"""
    ref = ddp_value_clip_reference
    got = run_ranks(2, fw.accelerate_fp16_run, stage, None, "value")
    for rank in range(2):
        assert got[rank]["skipped"] == ref[rank]["skipped"], (rank, got[rank]["skipped"], ref[rank]["skipped"])
        assert got[rank]["losses"] == ref[rank]["losses"] and got[rank]["loss_scale"] == ref[rank]["loss_scale"]
    assert _max_weight_diff(got[0]["state"], ref[0]["state"]) == 0.0


def test_fp16_parameters_stay_an_explicit_opt_in(ddp_reference):
    """``ZeroConfig(param_dtype="fp16")`` with the flag keeps fp16 parameters (fp32 masters): ranks still agree on
    every skip and the first overflows are DDP's, but fp16 per-parameter gradients may overflow (and skip) where
    DDP's fp32 ones do not, so the pattern is not held to DDP's."""
    got = run_ranks(2, fw.accelerate_fp16_run, 2, "fp16")
    assert got[0]["param_dtypes"] == ["torch.float16"]
    assert got[0]["skipped"] == got[1]["skipped"] and got[0]["skipped"][:3] == ddp_reference[0]["skipped"][:3]
    assert _max_rel_loss_diff(got[0]["losses"][:3], ddp_reference[0]["losses"][:3]) < 5e-3  # fp16 rounding


@pytest.mark.parametrize(
    "config, fragment",
    [
        (zp.ZeroConfig(param_dtype="bf16"), "param_dtype=torch.bfloat16"),
        (zp.ZeroConfig(loss_scaling=False), "loss_scaling=False"),
    ],
)
def test_fp16_flag_refuses_contradicting_configs(config, fragment):
    with pytest.raises(ValueError, match=fragment):
        _loss_scaling.fp16_config(config, {}, "mixed_precision='fp16'")


def test_grad_scaler_settings_map_onto_the_config():
    settings = _loss_scaling.scaler_settings({"init_scale": 1024, "growth_interval": 10})
    assert zp.ZeroConfig(loss_scaling=True, **settings).loss_scale_init == 1024.0
    assert settings == {"loss_scale_init": 1024.0, "loss_scale_growth_interval": 10}
    assert _loss_scaling.scaler_settings({"enabled": False}) == {"loss_scale": 1.0}
    with pytest.raises(ValueError, match="growth_factor=3.0"):
        _loss_scaling.scaler_settings({"growth_factor": 3.0})
