"""fp16 through Lightning's one flag: ``16-mixed`` under the ZeRO strategies trains as ``strategy="ddp"`` with
Lightning's own GradScaler does (same initial scale and growth interval; the initial scale is huge, so fp16
overflows and steps are skipped).

Both keep fp32 parameters and Lightning's ``autocast(fp16)``; only the GradScaler is replaced by zero_plugin's
synchronized loss scaler ([Note: fp16 one-flag mapping] in ``integrations/loss_scaling.py``).  So the skipped
steps must be the same, step for step, the learning rates too (Lightning steps the scheduler after a skipped
step under both), and the gradients are DDP's fp32 ones, so losses and weights are DDP's to the last bit
(offload's fused CPU AdamW aside).
The runs clip by value: a clamp turns an overflowed inf into a finite value, which must still skip the step
(torch's GradScaler records infs when it unscales, before clipping).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tests.harness import run_ranks
from tests.integrations import lightning_fp16_workers as fw

# Measured: every run but offload equals DDP's bit for bit (clipping by value, see lightning_fp16_workers.py).
LOSS_RTOL = 1e-7
WEIGHT_RTOL = 1e-7  # ||θ - θ_ddp|| / ||θ_ddp||, over every floating-point entry
UPDATE_TOL = 1e-6  # ||Δθ - Δθ_ddp|| / ||Δθ_ddp||
# Offload steps with torch's fused CPU AdamW kernel, so its reference is DDP with ``AdamW(fused=True)``: against
# DDP's default AdamW the two kernels' last bits, through fp16 autocast, move the losses by 5.9e-6 and the weights
# by 2.6e-6 / 3.3e-5 (update) on an AMD EPYC (5.6e-7 / 6.9e-6 on the Intel host where it was first measured).
TRAINER_SPECS = (0, 1, 2, 3, "zero3_offload")
FABRIC_SPECS = (0, 1, 2, 3)


@functools.cache
def trainer_run(spec) -> list:
    return run_ranks(2, fw.trainer_fp16_run, spec)


@functools.cache
def fabric_run(spec) -> list:
    return run_ranks(2, fw.fabric_fp16_run, spec)


def _flat(state: dict, names: list[str], base: dict | None = None) -> torch.Tensor:
    return torch.cat([(state[k].double() - (0 if base is None else base[k].double())).reshape(-1) for k in names])


def assert_like_ddp(got: list, ref: list, weight_rtol: float = WEIGHT_RTOL, update_tol: float = UPDATE_TOL) -> None:
    assert any(ref[0]["skipped"]) and not all(ref[0]["skipped"]), ref[0]["skipped"]  # the test can fail
    for rank in range(2):
        assert got[rank]["skipped"] == ref[rank]["skipped"], (rank, got[rank]["skipped"], ref[rank]["skipped"])
        assert got[rank]["loss_scale"] == ref[rank]["loss_scale"]
        assert got[rank]["lrs"] == pytest.approx(ref[rank]["lrs"], rel=1e-12)
        losses, ref_losses = got[rank]["losses"], ref[rank]["losses"]
        assert len(losses) == len(ref_losses)
        err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        assert err <= LOSS_RTOL, (rank, err, losses, ref_losses)
    state, ref_state, init = got[0]["state"], ref[0]["state"], ref[0]["init"]
    names = [k for k, v in ref_state.items() if v.is_floating_point()]
    assert names and set(names) <= set(state)
    theta, theta_ref = _flat(state, names), _flat(ref_state, names)
    assert float((theta - theta_ref).norm() / theta_ref.norm()) <= weight_rtol
    delta, delta_ref = _flat(state, names, init), _flat(ref_state, names, init)
    assert delta_ref.norm() > 0, "the reference did not train"
    assert float((delta - delta_ref).norm() / delta_ref.norm()) <= update_tol


@pytest.mark.parametrize("spec", TRAINER_SPECS)
def test_trainer_16_mixed_skips_and_trains_like_ddp_grad_scaler(spec):
    offload = isinstance(spec, str) and spec.endswith("offload")
    got, ref = trainer_run(spec), trainer_run("ddp_fused" if offload else "ddp")
    assert_like_ddp(got, ref)
    assert got[0]["global_step"] == ref[0]["global_step"] == fw.STEPS  # a skipped step still counts, as in DDP
    assert got[0]["param_dtypes"] == ["torch.float32"]  # parameters stay fp32, as under DDP


@pytest.mark.parametrize("spec", FABRIC_SPECS)
def test_fabric_16_mixed_skips_and_trains_like_ddp_grad_scaler(spec):
    got, ref = fabric_run(spec), fabric_run("ddp")
    assert_like_ddp(got, ref)
    norms, ref_norms = got[0]["norms"], ref[0]["norms"]  # unscaled before the norm; inf/NaN where DDP's is
    assert [math.isfinite(n) for n in norms] == [math.isfinite(n) for n in ref_norms] and any(map(math.isfinite, norms))
    assert [n for n in norms if math.isfinite(n)] == pytest.approx([n for n in ref_norms if math.isfinite(n)], rel=1e-6)


def test_grad_scaler_settings_zero_plugin_cannot_reproduce_are_refused():
    out = run_ranks(2, fw.refusals_worker)[0]
    assert "growth_factor=4.0" in out["trainer_growth"], out
    assert "backoff_factor=0.25" in out["fabric_backoff"], out


def test_the_plugin_scaler_maps_onto_the_config():
    """Init scale and growth interval carry over, a disabled or absent scaler means no scaling, another scaler class
    is refused, and other precisions keep the config as it is."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    import zero_plugin as zp
    from zero_plugin.integrations.lightning import common

    default = common.loss_scaler_settings(MixedPrecision("16-mixed", "cpu"))
    assert default == {"loss_scale_init": 65536.0, "loss_scale_growth_interval": 2000}
    config = common.engine_config(zp.ZeroConfig(stage=2), default)
    assert config.loss_scaling is True and config.stage == 2 and config.param_dtype is None
    disabled = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", enabled=False))
    assert common.loss_scaler_settings(disabled) == {"loss_scale": 1.0}
    absent = MixedPrecision("16-mixed", "cpu")
    absent.scaler = None
    assert common.loss_scaler_settings(absent) == {"loss_scale": 1.0}
    assert common.loss_scaler_settings(MixedPrecision("bf16-mixed", "cpu")) is None
    assert common.engine_config(zp.ZeroConfig(stage=3), None) == zp.ZeroConfig(stage=3)

    class OwnScaler(torch.amp.GradScaler):
        pass

    with pytest.raises(ValueError, match="OwnScaler"):
        common.loss_scaler_settings(MixedPrecision("16-mixed", "cpu", scaler=OwnScaler("cpu")))
    with pytest.raises(ValueError, match="loss_scaling=False"):
        common.engine_config(zp.ZeroConfig(loss_scaling=False), default)
