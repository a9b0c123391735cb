"""QLoRA on a real device (tests/gpu/qlora.py; run by tests/gpu/run.sh); skips without CUDA."""

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run tests/gpu/run.sh on a GPU machine)")
def test_qlora_stage3_matches_unsharded_on_cuda_and_keeps_packed_bytes():
    from tests.gpu.qlora import part_qlora

    result = part_qlora()
    assert result["ok"], result
