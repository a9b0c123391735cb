"""Rank-side functions for ``test_colocate.py`` (module-level so the worker pool can pickle them)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import zero_plugin as zp
from tests import models
from zero_plugin.engines.engine import engine_of
from zero_plugin.engines.state_offload import StatesOffloaded


def _build(kind: str):
    model = models.make_real_llama(layers=1) if kind == "real_llama" else models.make_tiny_llama(layers=2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _state_tensors(engine, opt) -> list[torch.Tensor]:
    held = engine.model_state_tensors()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return held["params"] + held["grads"] + held["masters"] + state


def _misuse(model, opt, batch) -> list[str]:
    """Each refused use, by name; every one must raise StatesOffloaded (or RuntimeError for a second offload)."""
    refused = []
    uses = {
        "forward": lambda: models.loss_fn(model, batch),
        "step": opt.step,
        "zero_grad": opt.zero_grad,
        "model.zero_grad": model.zero_grad,
        "clip": lambda: zp.clip_grad_norm_(model, 1.0),
        "state_dict": model.state_dict,
        "full_state_dict": lambda: zp.full_state_dict(model),
        "offload twice": lambda: zp.offload_states(model),
    }
    for name, use in uses.items():
        try:
            use()
        except (StatesOffloaded, RuntimeError) as exc:
            if name != "offload twice" and not isinstance(exc, StatesOffloaded):
                raise
            assert "zp.reload_states(model)" in str(exc), str(exc)
            refused.append(name)
    return refused


def _cycle(model, opt, batch, include, misuse: bool) -> dict:
    """offload -> report -> (misuse) -> reload -> report; every value checked bit for bit."""
    engine = engine_of(model, "test")  # before offload_states, which makes engine_of refuse
    before_values = [t.detach().clone() for t in _state_tensors(engine, opt) if t.untyped_storage().nbytes()]
    before = zp.memory_report(model, opt)
    summary = zp.offload_states(model, include=include)
    during = zp.memory_report(model, opt)
    emptied = sum(1 for t in _state_tensors(engine, opt) if t.numel() and t.untyped_storage().nbytes() == 0)
    refused = _misuse(model, opt, batch) if misuse else []
    moved_back = zp.reload_states(model)
    after = zp.memory_report(model, opt)
    after_values = [t.detach().clone() for t in _state_tensors(engine, opt) if t.untyped_storage().nbytes()]
    same = len(before_values) == len(after_values) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(before_values, after_values)
    )
    return {
        "summary": summary,
        "moved_back": moved_back,
        "placement": [r["placement"] for r in (before, during, after)],
        "measured": [r["measured"] for r in (before, during, after)],
        "emptied": emptied,
        "refused": refused,
        "bit_identical": same,
    }


def train_worker(
    kind: str, stage: int, offload_optimizer: bool, batches: list, steps: int, accum: int, cycles: bool, include=None
) -> dict:
    """Train ``steps`` x ``accum`` micro-batches; with ``cycles``, offload + reload after the first micro-batch of
    step 1 (gradients mid-accumulation) and after step 0's step (optimizer state, no gradients)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = _build(kind)
    config = zp.ZeroConfig(stage=stage, offload_optimizer="cpu" if offload_optimizer else "none")
    model, opt = zp.setup(model, opt, config)
    losses, records = [], {}
    for step in range(steps):
        for i, micro in enumerate(batches[step * accum : (step + 1) * accum]):
            local = models.shard_batch(micro, rank, world)
            with contextlib.nullcontext() if i == accum - 1 else zp.no_sync(model):
                loss = models.loss_fn(model, local)
                (loss / accum).backward()
            losses.append(loss.item())
            if cycles and step == 1 and i == 0:
                records["mid_accumulation"] = _cycle(model, opt, local, include, misuse=True)
        opt.step()
        opt.zero_grad()
        if cycles and step == 0:
            records["between_steps"] = _cycle(model, opt, local, include, misuse=False)
    full = zp.full_state_dict(model)
    optim = opt.consolidate_state_dict()
    return {"losses": losses, "params": full, "optim": optim.get("state", {}), "records": records}


def evaluation_only_worker(stage: int, batch) -> dict:
    """A reference model set up without an optimizer (TRL's ref / reward models): its parameters move and come
    back, its forward is refused meanwhile and equal afterwards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = _build("tiny_llama")
    model, _ = zp.setup(model, None, zp.ZeroConfig(stage=stage))
    local = models.shard_batch(batch, rank, world)
    with torch.no_grad():
        before = model(**local).logits
        summary = zp.offload_states(model)
        device = zp.memory_report(model)["placement"]["device"]["total"]
        try:
            model(**local)
            refused = False
        except StatesOffloaded:
            refused = True
        zp.reload_states(model)
        after = model(**local).logits
    return {"summary": summary, "device": device, "refused": refused, "same": torch.equal(before, after)}
