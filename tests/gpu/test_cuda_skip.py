"""The CUDA checks live in tests/gpu/check.py (run by tests/gpu/run.sh on a GPU); here they skip cleanly."""

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run tests/gpu/run.sh on a GPU machine)")
def test_cuda_parity_world_size_1():
    from tests.gpu.check import part_parity

    assert part_parity()["ok"]
