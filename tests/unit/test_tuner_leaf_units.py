"""Stage-3 unit choice around PEFT's wrappers of a real-shaped embedding / LM head (issue 37): the unit that a
read of the weight needs is the one gathered.  The end-to-end check is ``tests/integrations/test_trl_trainers.py``
(``sft_tokens``, ``sft_save_head``, ``sft_resized`` at stage 3 against DDP: they crashed before)."""

from __future__ import annotations

import types

from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from tests.models import real_llama_config
from zero_plugin.config import ZeroConfig
from zero_plugin.stage3.direct_reads import output_embedding_backbones
from zero_plugin.stage3.policy import assign_units


def _peft(**extra):
    model = LlamaForCausalLM(real_llama_config(tie=False, layers=1))
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM", **extra))


def _units(model):
    units, owner = assign_units(model, ZeroConfig(stage=3))
    return {name: module for name, module in units}, owner, units


def test_trainable_tokens_layer_is_the_unit_with_its_base_embedding():
    """[Note: tuner layers around a leaf]: ``TrainableTokensLayer.forward`` runs ``F.embedding`` on
    ``base_layer.weight`` itself, so the tuner layer, not ``base_layer``, is the unit, with its delta."""
    model = _peft(trainable_token_indices=[1, 2, 3])
    names, owner, units = _units(model)
    adapter = model.base_model.model.model.embed_tokens.token_adapter
    name = next(n for n, m in names.items() if m is adapter)
    assert not any(m is adapter.base_layer for m in names.values())
    index = [n for n, _ in units].index(name)
    assert owner[id(adapter.base_layer.weight)] == owner[id(adapter.trainable_tokens_delta["default"])] == index


def test_lora_embedding_is_the_unit_with_its_base_embedding():
    model = LlamaForCausalLM(real_llama_config(tie=False, layers=1))
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["embed_tokens"], task_type="CAUSAL_LM"))
    names, _, _ = _units(model)
    assert any(m is model.base_model.model.model.embed_tokens for m in names.values())


def test_modules_to_save_head_copy_is_found_for_direct_reads():
    """``get_output_embeddings()`` is PEFT's ``ModulesToSaveWrapper``; TRL's fused head reads its ``weight``, the
    trainable copy's, whose unit must be gathered at the end of the backbone."""
    model = _peft(modules_to_save=["lm_head"])
    _, _, units = _units(model)
    fake = [types.SimpleNamespace(module=m, index=i) for i, (_, m) in enumerate(units)]
    found = output_embedding_backbones(model, fake)
    copy = model.base_model.model.lm_head.modules_to_save["default"]
    assert [unit.module for _, unit in found] == [copy]
