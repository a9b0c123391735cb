"""Rank-side functions of ``test_reductions.py``: several synced backwards per step, and reduce_dtype."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zero_plugin as zp
from tests import models
from zero_plugin.engines.engine import engine_of

LR = 1e-2


def synced_backwards_worker(stage: int, buffered: bool, mode: str, batches: list, steps: int) -> dict:
    """Each step: two micro-batches, both synced (no ``no_sync``): ``"accumulate"`` runs two forwards and
    backwards; ``"retain"`` runs one forward and ``backward(retain_graph=True)`` twice (half the loss each)."""
    from tests.unit.memory_comm_workers import collectives_layout

    with collectives_layout(buffered):
        model = models.make_odd_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=stage, bucket_size_mb=0.0005))
        rank, world = dist.get_rank(), dist.get_world_size()
        for step in range(steps):
            micro = batches[2 * step : 2 * step + 2]
            if mode == "accumulate":
                for batch in micro:
                    (models.loss_fn(model, models.shard_batch(batch, rank, world)) / 2).backward()
            else:
                loss = models.loss_fn(model, models.shard_batch(micro[0], rank, world))
                (loss / 2).backward(retain_graph=True)
                (loss / 2).backward()
            opt.step()
            opt.zero_grad()
        full = zp.full_state_dict(model)  # collective: every rank calls it, rank 0 gets the tensors
        return {k: v.clone() for k, v in full.items()}


def reference_synced_backwards(mode: str, batches: list, steps: int) -> dict:
    model = models.make_odd_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        micro = batches[2 * step : 2 * step + 2]
        if mode == "accumulate":
            for batch in micro:
                (models.loss_fn(model, batch) / 2).backward()
        else:
            loss = models.loss_fn(model, micro[0])
            (loss / 2).backward(retain_graph=True)
            (loss / 2).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reduced_grad_worker(stage: int, buffered: bool, batch) -> dict:
    """bf16 parameters, reduce_dtype fp32: the gradient each owned region gets, as the optimizer sees it."""
    from tests.unit.memory_comm_workers import collectives_layout

    with collectives_layout(buffered):
        model = models.make_odd_mlp(dtype=torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        cfg = zp.ZeroConfig(stage=stage, param_dtype="bf16", reduce_dtype="fp32")
        model, opt = zp.setup(model, opt, cfg)
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = models.shard_batch(batch, rank, world)
        models.loss_fn(model, (x, y)).backward()
        engine = engine_of(model, "test")
        out = {}
        for slot in engine.slots:
            grad = engine.owned_grad(slot)
            lo, hi = slot.layout.bounds(rank)
            out[slot.name] = (lo, hi, grad.dtype, grad.detach().reshape(-1)[: hi - lo].double().clone())
        opt.zero_grad()
        return out


def local_bf16_grads(batch, world: int) -> dict:
    """Each rank's bf16 gradient (one process, one thread, as the ranks), averaged in fp64 (exact here)."""
    model = models.make_odd_mlp(dtype=torch.float32).to(torch.bfloat16)
    total = {}
    for rank in range(world):
        x, y = models.shard_batch(batch, rank, world)
        model.zero_grad()
        models.loss_fn(model, (x.to(torch.bfloat16), y)).backward()
        for name, p in model.named_parameters():
            total[name] = total.get(name, 0) + p.grad.double().reshape(-1)
    return {name: g / world for name, g in total.items()}


def clip_before_last_backward_worker(stage: int, fp16: bool, batches: list) -> dict:
    """Clip after the first of two synced backwards, then a second backward whose loss is NaN on the last
    rank: the step must see the NaN (skip) instead of trusting the norm cached by the clip.  fp16: the
    second backward must raise (unscaled and scaled gradients would be summed)."""
    model = models.make_odd_mlp(dtype=torch.float32 if fp16 else torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    cfg = zp.ZeroConfig(stage=stage, param_dtype="fp16" if fp16 else None)
    model, opt = zp.setup(model, opt, cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    before = {k: v.clone() for k, v in zp.full_state_dict(model).items()}
    x, y = models.shard_batch(batches[0], rank, world)
    opt.scale_loss(models.loss_fn(model, (x, y))).backward()
    zp.clip_grad_norm_(model, 1.0)
    loss = models.loss_fn(model, (x, y))
    if rank == world - 1:
        loss = loss * float("nan")
    try:
        opt.scale_loss(loss).backward()
    except RuntimeError as exc:
        return {"raised": str(exc)}
    opt.step()
    after = zp.full_state_dict(model)
    changed = any(not torch.equal(before[k], after[k]) for k in before) if rank == 0 else None
    return {"raised": None, "skipped": opt.skipped_steps, "changed": changed}
