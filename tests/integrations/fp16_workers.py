"""Functions that run inside the ranks of ``test_fp16.py``: Accelerate's ``mixed_precision="fp16"`` under
zero_plugin against DDP with torch's GradScaler.

Every run starts from a huge loss scale so that fp16 overflows in the first steps (and again after each
growth, ``GROWTH_INTERVAL`` clean steps later): the skipped steps must be the same as the reference's.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests import models

INIT_SCALE = 2.0**20
GROWTH_INTERVAL = 2
STEPS = 8
PER_RANK_BATCH = 2
CLIP = 1.0
CLIP_VALUE = 0.01  # clip="value": elementwise, so exact on shards; a clamp must not hide an overflow's inf


def _batches(steps: int = STEPS) -> list:
    return models.make_batches("llama", steps, dist.get_world_size(), PER_RANK_BATCH, seed=1)


def _scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


# -- Accelerate ---------------------------------------------------------------------------------------------
def _accelerator(config, **kwargs):
    from accelerate.state import AcceleratorState
    from accelerate.utils import GradScalerKwargs

    from zero_plugin.integrations.accelerate import Accelerator

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    AcceleratorState._reset_state(True)
    handler = GradScalerKwargs(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    return Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[handler], zero_plugin=config, **kwargs)


def accelerate_fp16_run(stage: int, param_dtype: str | None = None, clip: str = "norm") -> dict:
    """The usual Accelerate loop with clipping (by ``clip``) and a scheduler prepared with the optimizer."""
    import zero_plugin as zp

    accelerator = _accelerator(zp.ZeroConfig(stage=stage, param_dtype=param_dtype))
    model = models.make_tiny_llama(tie=False, layers=2)
    optimizer = models.two_group_adamw(model)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, _scheduler(optimizer))
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, skipped, lrs, param_dtypes = [], [], [], set()
    for batch in _batches():
        loss = models.loss_fn(model, models.shard_batch(batch, rank, world))
        accelerator.backward(loss)
        if clip == "norm":
            accelerator.clip_grad_norm_(model.parameters(), CLIP)
        else:
            accelerator.clip_grad_value_(model.parameters(), CLIP_VALUE)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        skipped.append(bool(optimizer.step_was_skipped))
        lrs.append(optimizer.param_groups[0]["lr"])
    param_dtypes.update(str(p.dtype) for p in model.parameters())
    state = zp.full_state_dict(model)
    accelerator.wait_for_everyone()
    return {
        "losses": losses,
        "skipped": skipped,
        "lrs": lrs,
        "state": state,
        "param_dtypes": sorted(param_dtypes),
        "loss_scale": float(optimizer.optimizer.loss_scale),
    }


@torch.no_grad()
def _clip_grad_norm_f64(params, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the global norm summed in float64, as zero_plugin sums it over
    shards (``zero_plugin/optim/clip.py``).  torch's float32 norm differs from it in the last bits (8e-8
    relative at this test's first applied step), and AdamW at lr 1e-2 on this tiny model carries that to
    ~1e-4 in the weights after five steps, more or less depending on the CPU's kernels: measured, the
    reference with this norm equals zero_plugin's stage 0 to 0.0, with torch's 1.2e-4 apart."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.sqrt(sum(g.double().norm() ** 2 for g in grads))
    coef = float(max_norm) / (float(total) + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


def ddp_grad_scaler_run(clip: str = "norm") -> dict:
    """The reference: DDP, fp32 parameters, autocast fp16 and torch's GradScaler, as Accelerate does on a GPU.
    The scheduler steps as Accelerate's AcceleratedScheduler steps it: only after a step the scaler took, and
    then once per process (batches are not split)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = models.make_tiny_llama(tie=False, layers=2)
    optimizer = models.two_group_adamw(model)
    scheduler = _scheduler(optimizer)
    ddp = DDP(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, skipped, lrs = [], [], []
    for batch in _batches():
        with torch.autocast("cpu", dtype=torch.float16):
            loss = models.loss_fn(ddp, models.shard_batch(batch, rank, world)).float()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if clip == "norm":
            _clip_grad_norm_f64(model.parameters(), CLIP)
        else:
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        was_skipped = scaler.get_scale() < before
        for _ in range(0 if was_skipped else world):
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        skipped.append(was_skipped)
        lrs.append(optimizer.param_groups[0]["lr"])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()} if rank == 0 else {}
    return {"losses": losses, "skipped": skipped, "lrs": lrs, "state": state, "loss_scale": scaler.get_scale()}
