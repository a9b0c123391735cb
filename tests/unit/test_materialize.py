"""Models bigger than one rank: built on the meta device, filled unit by unit at setup."""

from __future__ import annotations

import pytest
import torch

from tests import models
from tests.harness import run_ranks
from tests.unit import materialize_workers as MW


@pytest.mark.parametrize("stage", [2, 3])
def test_pretrained_on_meta_loads_the_checkpoint(stage, tmp_path):
    ref = models.make_tiny_llama()
    ref.save_pretrained(tmp_path)
    with torch.no_grad():
        want = ref(input_ids=torch.arange(12).view(1, 12)).logits
    for r in run_ranks(2, MW.from_checkpoint_worker, str(tmp_path), stage):
        assert r["tied"]
        assert (r["logits"] - want).abs().max().item() <= 1e-5
        if stage == 3:  # no rank holds a full parameter after setup
            assert r["largest_local"] <= -(-max(p.numel() for p in ref.parameters()) // 2)


@pytest.mark.parametrize("stage", [0, 3])
def test_init_fn_materialises_and_trains(stage):
    for r in run_ranks(2, MW.init_fn_worker, stage):
        assert not r["any_meta"]
        assert r["losses"][-1] < r["losses"][0]


def test_meta_model_without_source_is_a_clear_error():
    msg = run_ranks(1, MW.missing_source_worker)[0]
    assert "meta device" in msg and "param_source" in msg
