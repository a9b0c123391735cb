"""Optimizer offload on a real device (tests/gpu/offload.py; run by tests/gpu/run.sh); skips without CUDA."""

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run tests/gpu/run.sh on a GPU machine)")
def test_offload_drops_optimizer_state_from_the_device_and_blocked_step_is_bitwise():
    from tests.gpu.offload import part_offload

    result = part_offload()
    assert result["ok"], result
