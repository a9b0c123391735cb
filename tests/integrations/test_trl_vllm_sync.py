"""TRL's vLLM server-mode weight sync (``VLLMGeneration.sync_weights``, what GRPO and RLOO call before
generating) pushes the full, unsharded weights, LoRA merged as TRL merges them, at stages 2 and 3 on 2 ranks:
names, shapes and values equal to TRL's sync of an unsharded copy of the trained model; at stage 3 one unit
(or one decoder layer with its own sliced projections) gathered at a time (``integrations/trl_vllm.py``).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.harness import run_ranks

CASES = [
    pytest.param(3, False, None, id="stage3"),
    pytest.param(3, True, 1 << 14, id="stage3-lora-sliced-projections"),
    pytest.param(2, True, None, id="stage2-lora"),
]


@pytest.mark.parametrize("stage,lora,linear_slice_numel", CASES)
def test_pushed_weights_equal_the_unsharded_models(stage, lora, linear_slice_numel):
    from tests.integrations import trl_vllm_workers as w

    out = run_ranks(2, w.sync_matches_unsharded, stage, lora, linear_slice_numel, timeout=240)[0]
    pushed, expected = out["pushed"], out["expected"]
    assert list(pushed) and sorted(pushed) == sorted(expected)
    assert not any("lora_" in name or "base_layer" in name for name in pushed)
    assert sorted(out["metadata"]) == sorted(out["expected_metadata"])
    for name, value in expected.items():
        assert pushed[name].shape == value.shape, name
        assert torch.equal(pushed[name], value), (name, (pushed[name] - value).abs().max())
    if stage == 3:
        assert len(out["gathered"]) == len(pushed)
        for name, units in out["gathered"]:
            assert sum(numel for _, numel in units) <= out["bound"], (name, units)
            assert len(units) <= 1 or len({_layer(unit) for unit, _ in units}) == 1, (name, units)


def _layer(unit_name: str) -> str | None:
    found = re.search(r"layers\.\d+", unit_name)
    return found.group(0) if found else None
