"""``GradGuard.scale_loss`` scales a loss as torch's GradScaler does: by an fp32 tensor, so a 0-dim fp16 loss
is promoted to fp32 instead of overflowing (a loss of 3.0 times 2^20 is not an fp16 number)."""

import pytest
import torch

from zero_plugin.optim.loss_scale import GradGuard


@pytest.mark.parametrize("shape", [(), (3,)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_scaled_loss_equals_grad_scalers(shape, dtype):
    guard = GradGuard(engine=None, dynamic_scale=True, init_scale=2.0**20)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    loss = torch.full(shape, 3.0, dtype=dtype)
    ours, torchs = guard.scale_loss(loss), scaler.scale(loss)
    assert ours.dtype == torchs.dtype
    assert torch.equal(ours, torchs)
    if not shape:
        assert torch.isfinite(ours).all() and ours.dtype == torch.float32


def test_no_scaling_returns_the_loss_itself():
    guard = GradGuard(engine=None, dynamic_scale=False)
    loss = torch.tensor(3.0, dtype=torch.float16)
    assert guard.scale_loss(loss) is loss
