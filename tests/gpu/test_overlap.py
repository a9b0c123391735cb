"""Stage-3 side streams on a real device (tests/gpu/overlap.py; run by tests/gpu/run.sh); skips without CUDA."""

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run tests/gpu/run.sh on a GPU machine)")
def test_prefetch_overlaps_compute_with_bounded_deterministic_memory():
    from tests.gpu.overlap import part_overlap

    result = part_overlap()
    assert result["ok"], {k: v for k, v in result.items() if k != "ok"}
