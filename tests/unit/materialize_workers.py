"""Rank-side functions for test_materialize.py."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

import zero_plugin as zp
from tests import models
from zero_plugin.loading.materialize import empty_model, from_init_fn, pretrained_on_meta


def from_checkpoint_worker(path: str, stage: int) -> dict:
    model, source = pretrained_on_meta(path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=stage), param_source=source)
    largest_local = max(p.numel() for p in model.parameters())
    ids = torch.arange(12).view(1, 12)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return {
        "logits": logits,
        "largest_local": largest_local,
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }


def init_fn_worker(stage: int) -> dict:
    cfg = models.make_tiny_llama().config
    model = empty_model(lambda: LlamaForCausalLM(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=stage), param_source=from_init_fn(model._init_weights))
    ids = torch.arange(12).view(1, 12) % cfg.vocab_size
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "any_meta": any(p.is_meta for p in model.parameters())}


def missing_source_worker() -> str:
    cfg = models.make_tiny_llama().config
    model = empty_model(lambda: LlamaForCausalLM(cfg))
    try:
        zp.setup(model, torch.optim.AdamW(model.parameters()), zp.ZeroConfig(stage=3))
    except ValueError as exc:
        return str(exc)
    return ""
