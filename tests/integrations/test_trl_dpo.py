"""TRL's ``DPOTrainer`` (PEFT policy, separate reference model) under ``zero-plugin launch --stage 3`` against
its plain DDP run (``accelerate launch --multi_gpu``), 2 CPU processes, same seed (issue 19, item 6).

TRL prepares the reference model with ``accelerator.prepare_model(ref_model, evaluation_mode=True)``; at stage
3 that shards it for evaluation only ([Note: evaluation-only models] in zero_plugin/stage3/inference.py).
The runs are ``scripts/trl_stages.py``'s DDP and stage-3 launches (no zero_plugin in the script; shared with
``test_trl_stages.py`` through the ``trl_stage_runs`` fixture, ``trl_runs.py``): its DPO trainer (LoRA policy,
a reference of another seed, tied real-shaped Llamas) reports the bytes each rank's reference model holds:
half the model at stage 3 on 2 ranks, the whole model under DDP.
"""

from __future__ import annotations

import pytest

from tests.integrations.trl_runs import STEPS


def test_dpo_losses_equal_ddp(trl_stage_runs):
    ddp, zero = trl_stage_runs.get("ddp").info, trl_stage_runs.get("stage3").info
    assert ddp["world_size"] == zero["world_size"] == 2
    assert ddp["accelerator_class"] == "accelerate.accelerator"
    assert zero["accelerator_class"] == "zero_plugin.integrations.accelerate"
    steps = [h for h in ddp["dpo"] if "loss" in h]
    got = [h for h in zero["dpo"] if "loss" in h]
    assert len(steps) == len(got) == STEPS
    for want, have in zip(steps, got):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "grad_norm"):
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (key, want, have)
    assert steps[0]["rewards/margins"] != 0  # the reference differs from the policy: it moves the loss


def test_reference_model_is_sharded(trl_stage_runs):
    ddp, zero = trl_stage_runs.get("ddp").dpo_memory, trl_stage_runs.get("stage3").dpo_memory
    full = ddp[0]["ref_full_bytes"]
    assert all(m["ref_param_bytes"] == full for m in ddp)
    for m in zero:  # 1/2 of the model, padding at most one element per parameter (20 tensors: tied head)
        assert full / 2 - 20 * 4 <= m["ref_param_bytes"] <= full / 2 + 20 * 4, (m, full)
