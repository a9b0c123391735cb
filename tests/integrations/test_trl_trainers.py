"""The rest of TRL's trainers and PEFT's extras, unchanged, against their DDP run (issue 37):
``scripts/trl_trainers.py``'s trainers (``RLOOTrainer``, ``KTOTrainer``, ``RewardTrainer``,
``DistillationTrainer``, ``DPOTrainer`` without ``ref_model`` and with ``precompute_ref_log_probs``; ``SFTTrainer``
with ``modules_to_save=["lm_head"]``, ``trainable_token_indices``, LoRA on ``embed_tokens``,
``resize_token_embeddings`` before the trainer, bf16 weights), 2 CPU processes, real-shaped Llamas (vocab 4096 x
hidden 256), at stages 1 and 3, run after SFT, DPO and GRPO in the launches ``test_trl_stages.py`` compares
(``trl_stages.py --more``, the ``trl_stage_runs`` fixture of ``trl_runs.py``: one launch per setting).  Losses, grad norms and the trainers' rewards / margins step by step, and the saved adapters.

Precision: ``rloo``, ``kto``, ``reward`` and the DPO runs train in fp32, the others with TRL's default
``bf16=True`` (autocast) and ``sft_bf16_weights`` on bf16 weights.  The tolerances are those of
``test_trl_stages.py`` for both: the ranks run the same kernels on the same weights as DDP's, and a gradient
is the same two-term sum (exact in either order), so only the grad norm's summation order over shards differs
(measured: <= 2e-7 relative, adapters equal to 1e-8), in bf16 as in fp32.

Every trainer runs at stage 3 too.  The stage-3 fixes they
needed are pinned against single-process references: KTO / DPO without ``ref_model`` by
``tests/parity/test_fused_head_reference_forward.py``, the distillation teacher's head read after its forward by
``test_fused_head.py::test_teacher_head_read_after_a_forward_without_grad``, PEFT's wrappers around the
embedding and head by ``tests/unit/test_tuner_leaf_units.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.integrations.trl_runs import MORE_TRAINERS, STEPS, WITH_MORE

KEYS = {
    "rloo": ("loss", "grad_norm", "reward", "reward_std", "kl", "entropy"),
    "kto": ("loss", "grad_norm", "kl", "rewards/chosen", "rewards/margins", "logps/chosen"),
    "reward": ("loss", "grad_norm", "mean_reward", "margin", "accuracy"),
    "distill": ("loss", "grad_norm", "entropy"),
    "dpo_noref": ("loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/chosen"),
    "dpo_precompute": ("loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/chosen"),
    "sft_save_head": ("loss", "grad_norm", "entropy"),
    "sft_tokens": ("loss", "grad_norm", "entropy"),
    "sft_lora_embed": ("loss", "grad_norm", "entropy"),
    "sft_resized": ("loss", "grad_norm", "entropy"),
    "sft_bf16_weights": ("loss", "grad_norm", "entropy"),
}
FP32 = {"rloo", "kto", "reward", "dpo_noref", "dpo_precompute"}
# Trainers of a 2^20-element tensor (``UNCLIPPED`` in the script, trained without clipping): DDP's grad norm is
# torch's fp32 ``clip_grad_norm_``, 4.7e-4 relative off the float64 norm for the lm_head (zero_plugin's sums in
# float64 and equals the float64 reference); everything else is compared as tightly as for the others.
NORM_REL = {"sft_save_head": 1e-3, "sft_lora_embed": 1e-3, "sft_resized": 1e-3}


def test_every_trainer_launched_is_compared():
    assert tuple(KEYS) == MORE_TRAINERS


def _steps(runs, name: str, trainer: str) -> list[dict]:
    info = runs.get(name).info
    assert info["world_size"] == 2
    assert info[f"{trainer}_mixed_precision"] == ("no" if trainer in FP32 else "bf16")
    return [h for h in info[trainer] if "loss" in h]


@pytest.mark.parametrize("trainer", list(KEYS))
@pytest.mark.parametrize("setting", ["stage1", "stage3"])
def test_trl_trainer_equals_ddp(trl_stage_runs, setting, trainer):
    runs = trl_stage_runs
    want, got = _steps(runs, "ddp", trainer), _steps(runs, setting, trainer)
    assert len(want) == len(got) == STEPS
    for step, (w, g) in enumerate(zip(want, got)):
        for key in KEYS[trainer]:
            rel = NORM_REL.get(trainer, 1e-4) if key == "grad_norm" else 1e-4
            assert g[key] == pytest.approx(w[key], rel=rel, abs=1e-6), (trainer, setting, step, key, w, g)
    assert [want[0][k] for k in KEYS[trainer]] != [want[-1][k] for k in KEYS[trainer]]
    ref, adapter = runs.get("ddp").adapters[trainer], runs.get(setting).adapters[trainer]
    assert adapter.keys() == ref.keys() and len(ref) > 0
    for name, value in ref.items():
        diff = (adapter[name].float() - value.float()).abs().max().item()
        assert diff <= 1e-5 * max(1.0, value.abs().max().item()), (trainer, setting, name, diff)


def test_saved_adapters_hold_what_peft_saves(trl_stage_runs):
    """LoRA on ``embed_tokens``: PEFT saves the embedding whole (``save_embedding_layers="auto"``), the DDP run's
    file holds it, and so does zero_plugin's save_model (integrations/hf_trainer.py) at every stage."""
    name = "base_model.model.model.embed_tokens.base_layer.weight"
    for setting in WITH_MORE:
        adapter = trl_stage_runs.get(setting).adapters["sft_lora_embed"]
        assert adapter[name].shape == torch.Size([4096, 256]), setting
