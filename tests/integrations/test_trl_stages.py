"""TRL's trainers, unchanged, at stages 1, 2, 3 and 3 + offload against their DDP run (issue 37): one launch per
setting (``scripts/trl_stages.py``: ``SFTTrainer``, ``DPOTrainer``, then ``GRPOTrainer`` generating in the trainer;
LoRA, TRL's fused LM head, gradient checkpointing on as TRL defaults), 2 CPU processes, same seed, real-shaped
Llamas (vocab 4096 x hidden 256: the SFT and GRPO models' untied heads are stage-3 units of their own, the DPO
model's tied head is in the root unit).  Losses, DPO and GRPO rewards (GRPO's: equal only if the sampled
completions are) and grad norms step for step, and the saved adapters.  Before stage 3 read the head outside its
forward ([Note: direct reads of the output embedding] in zero_plugin/stage3/direct_reads.py) its SFT run failed
at step 1 with ``RuntimeError: mat2 must be a matrix``.
"""

from __future__ import annotations

import pytest

from tests.integrations.trl_runs import SETTINGS, STEPS

KEYS = {
    "sft": ("loss", "grad_norm", "entropy", "mean_token_accuracy"),
    "dpo": ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"),
    "grpo": ("loss", "grad_norm", "reward", "reward_std", "entropy"),
}


def _steps(runs, name: str, trainer: str) -> list[dict]:
    info = runs.get(name).info
    assert info["world_size"] == 2
    # zero_plugin.run patched TRL's vLLM weight sync (integrations/trl_vllm.py) in every launch it ran
    assert info["vllm_sync"].startswith("zero_plugin" if name != "ddp" else "trl"), info["vllm_sync"]
    return [h for h in info[trainer] if "loss" in h]


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s != "ddp"])
@pytest.mark.parametrize("trainer", list(KEYS))
def test_trl_trainer_equals_ddp(trl_stage_runs, setting, trainer):
    runs = trl_stage_runs
    want, got = _steps(runs, "ddp", trainer), _steps(runs, setting, trainer)
    assert len(want) == len(got) == STEPS
    for step, (w, g) in enumerate(zip(want, got)):
        for key in KEYS[trainer]:
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), (trainer, setting, step, key, w, g)
    assert [want[0][k] for k in KEYS[trainer]] != [want[-1][k] for k in KEYS[trainer]]
    ref, adapter = runs.get("ddp").adapters[trainer], runs.get(setting).adapters[trainer]
    assert adapter.keys() == ref.keys() and len(ref) > 0
    for name, value in ref.items():
        diff = (adapter[name] - value).abs().max().item()
        assert diff <= 1e-5 * max(1.0, value.abs().max().item()), (trainer, setting, name, diff)
