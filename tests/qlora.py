"""The QLoRA setup the tests share: a tiny random Llama saved as the base, loaded 4-bit by bitsandbytes in the
FSDP-QLoRA layout (nf4, double quantization, ``bnb_4bit_quant_storage=torch.bfloat16``; [Note: packed 4-bit
weights] in zero_plugin/loading/quantized.py), and PEFT LoRA adapters on top.

Compute is fp32 so parity can be tight; bitsandbytes' CPU backend runs the 4-bit matmuls.  The rank workers
(``tests/unit/qlora_workers.py``), the single-process references beside them and the launched script
(``tests/integrations/scripts/qlora_accelerate.py``) all build their models here, so the adapters they compare
start from the same draws.
"""

from __future__ import annotations

import torch

from tests import models

VOCAB = 96
LORA_TARGETS = ("q_proj", "v_proj", "down_proj")


def save_base(folder: str, aligned: bool = False) -> None:
    """The seed-1 base, saved with ``save_pretrained``.  Default sizes are odd (hidden 36, intermediate 75: packed
    MLP weights of 675 bf16 elements, padded at 2 ranks); ``aligned``: multiples of 32 (hidden 64, intermediate
    128), which bitsandbytes' in-place CPU repacking for inference needs ([Note: packed 4-bit weights])."""
    hidden, inter, heads = (64, 128, 4) if aligned else (36, 75, 6)
    config = models.llama_config(VOCAB, hidden, intermediate=inter, heads=heads, kv_heads=heads)
    models.save_random_llama(folder, config, seed=1)


def bnb_4bit_config(**overrides):
    """``BitsAndBytesConfig``: 4-bit nf4, double quantization, bf16 storage, fp32 compute; ``overrides``: any
    field (e.g. ``bnb_4bit_quant_storage=torch.uint8`` for the refusal tests)."""
    from transformers import BitsAndBytesConfig

    kw = dict(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_quant_storage=torch.bfloat16,
        bnb_4bit_compute_dtype=torch.float32,
    )
    kw.update(overrides)
    return BitsAndBytesConfig(**kw)


def load_base(folder: str, cpu_repacking: bool = False, **overrides):
    """The base loaded 4-bit (``overrides``: ``bnb_4bit_config`` fields).  ``cpu_repacking=False``: the CPU path
    zp.setup leaves on (no in-place repacking in eval-mode forwards), which the unsharded references run;
    ``True``: as ``from_pretrained`` leaves it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=bnb_4bit_config(**overrides), dtype=torch.float32
    )
    if not cpu_repacking:
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    return model


def add_lora(model):
    """PEFT LoRA (r 4, alpha 8) on ``LORA_TARGETS``, drawn after ``torch.manual_seed(0)``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS)))


def load_qlora(folder: str):
    """The base loaded 4-bit for the references' CPU path, with ``add_lora``'s adapters."""
    return add_lora(load_base(folder))
