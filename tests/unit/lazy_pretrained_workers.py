"""Rank-side functions for test_lazy_pretrained.py: lazily loaded models set up and trained beside eager ones."""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

import zero_plugin as zp
from zero_plugin.loading import lazy_pretrained, materialize

LORA_TARGETS = ("q_proj", "v_proj", "down_proj")


@contextlib.contextmanager
def lazy_loading():
    """What ``zero_plugin.run`` installs at stage 3, for the block only (test workers are reused)."""
    materialize._SET_UP[0] = False  # an earlier test's zp.setup in this reused process
    lazy_pretrained.install()
    try:
        yield
    finally:
        lazy_pretrained.uninstall()


def load(path: str, lazy: bool, lora: bool, dtype: torch.dtype = torch.float32, seed: int = 0):
    """``from_pretrained`` (+ ``get_peft_model``) as a user script does, lazily or not, from one seed."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with lazy_loading() if lazy else contextlib.nullcontext(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft reads a deprecated transformers property
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        if lora:
            config = LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), lora_dropout=0.0)
            model = get_peft_model(model, config)
    return model


def _inner(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def train_worker(
    path: str,
    stage: int,
    lazy_ranks: tuple[int, ...],
    lora: bool,
    steps: int = 3,
    cpu_ram_efficient_loading: bool = False,
) -> dict:
    """Load (lazily on ``lazy_ranks``), set up, train ``steps``; losses, ties and rank 0's final weights."""
    rank = dist.get_rank()
    model = load(path, lazy=rank in lazy_ranks, lora=lora)
    meta_before = sum(p.is_meta for p in model.parameters())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    config = zp.ZeroConfig(stage=stage, cpu_ram_efficient_loading=cpu_ram_efficient_loading)
    model, opt = zp.setup(model, opt, config)
    gen = torch.Generator().manual_seed(100 + rank)
    vocab = _inner(model).config.vocab_size
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 12), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        zp.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    inner = _inner(model)
    state = zp.full_state_dict(model)
    return {
        "losses": losses,
        "meta_before": meta_before,
        "any_meta": any(p.is_meta for p in model.parameters()),
        "tied": inner.lm_head.weight is inner.model.embed_tokens.weight,
        "state": state,
    }


def load_after_setup_worker(path: str) -> dict:
    """A from_pretrained after zp.setup (an evaluation or reload copy) loads eagerly, without a warning."""
    model = load(path, lazy=True, lora=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    zp.setup(model, opt, zp.ZeroConfig(stage=3))
    lazy_pretrained.install()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            again = load(path, lazy=False, lora=False)
    finally:
        lazy_pretrained.uninstall()
    fallback = [w for w in caught if issubclass(w.category, lazy_pretrained.LazyLoadFallbackWarning)]
    return {"meta": sum(p.is_meta for p in again.parameters()), "warnings": len(fallback)}
