"""zp.offload_states / zp.reload_states on a real device (tests/gpu/colocate.py; run by tests/gpu/run.sh);
skips without CUDA."""

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run tests/gpu/run.sh on a GPU machine)")
def test_offload_states_frees_the_device_and_reload_continues_bitwise():
    from tests.gpu.colocate import part_colocate

    result = part_colocate()
    assert result["ok"], result
