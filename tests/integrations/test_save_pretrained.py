"""``save_pretrained`` of a set-up model writes the full model at every stage (issue 19, item 1).

The saving lines are transformers' ``run_clm_no_trainer.py`` verbatim (``accelerator.unwrap_model(model)
.save_pretrained(out, is_main_process=..., save_function=accelerator.save)``), run by 2 ranks under
zero_plugin's ``Accelerator`` after two training steps; the folder is then loaded with ``from_pretrained``
here, in a plain process, and compared with the trained weights (float32, exact).  With PEFT the adapter
folder is loaded onto a fresh base model with ``PeftModel.from_pretrained``.
"""

from __future__ import annotations

import pytest
import torch

from tests import models
from tests.harness import run_ranks
from tests.integrations import save_pretrained_workers as w


def _compare(loaded: dict, trained: dict) -> None:
    assert list(loaded) == list(trained), f"keys differ: {sorted(set(loaded) ^ set(trained))[:5]}"
    for key, value in trained.items():
        assert loaded[key].shape == value.shape, (
            f"{key}: saved {tuple(loaded[key].shape)}, trained {tuple(value.shape)}"
        )
        assert torch.equal(loaded[key], value), f"{key}: max |Δ| {(loaded[key] - value).abs().max():.3g}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_save_pretrained_then_from_pretrained_equals_the_trained_model(tmp_path, stage):
    from transformers import LlamaForCausalLM

    trained = run_ranks(2, w.train_and_save_pretrained, stage, False, str(tmp_path), timeout=180)[0]
    loaded = LlamaForCausalLM.from_pretrained(tmp_path).state_dict()
    _compare(loaded, trained)
    init = models.make_tiny_llama(layers=3).state_dict()
    assert not torch.equal(loaded["model.layers.0.mlp.up_proj.weight"], init["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_peft_save_pretrained_then_from_pretrained_equals_the_trained_adapters(tmp_path, stage):
    from peft import PeftModel

    trained = run_ranks(2, w.train_and_save_pretrained, stage, True, str(tmp_path), timeout=180)[0]
    loaded = PeftModel.from_pretrained(models.make_tiny_llama(layers=3), tmp_path).state_dict()
    _compare(loaded, trained)
    lora = [k for k in trained if "lora_" in k]
    start = models.make_tiny_llama_lora(layers=3).state_dict()
    assert lora and all(not torch.equal(trained[k], start[k]) for k in lora), "adapters did not train"


def test_save_pretrained_with_the_rank0_only_switch(tmp_path):
    from transformers import LlamaForCausalLM

    trained = run_ranks(2, w.train_and_save_pretrained, 3, False, str(tmp_path), True, timeout=180)[0]
    _compare(LlamaForCausalLM.from_pretrained(tmp_path).state_dict(), trained)
