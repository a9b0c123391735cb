"""Rank-side function for test_peft_generate.py."""

import torch

import zero_plugin as zp
from tests import models
from zero_plugin.engines.engine import engine_of


def peft_generate_worker() -> dict:
    ids = torch.arange(5).view(1, 5)
    want = models.make_tiny_llama_lora().generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    model = models.make_tiny_llama_lora()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=3))
    got = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)  # PeftModel.generate -> inner model
    return {"equal": torch.equal(want, got), "unsharded": [u.name for u in engine_of(model, "t").unsharded_units()]}
