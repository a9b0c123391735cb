"""Functions that run inside the ranks of ``test_fp16.py``: fp16 through the one-flag paths (Accelerate's
``mixed_precision="fp16"``, Lightning's ``precision="16-mixed"``) against DDP with torch's GradScaler.

Every run starts from a huge loss scale so that fp16 overflows in the first steps (and again after each
growth, ``GROWTH_INTERVAL`` clean steps later): the skipped steps must be the same as the reference's.
"""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from tests import models

INIT_SCALE = 2.0 ** 20
GROWTH_INTERVAL = 2
STEPS = 8
PER_RANK_BATCH = 2
CLIP = 1.0


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


def accelerate_fp16_run(stage: int) -> dict:
    """The usual Accelerate loop with clipping and a scheduler prepared with the optimizer."""
    import zero_plugin as zp

    accelerator = _accelerator(zp.ZeroConfig(stage=stage))
    model = models.make_tiny_llama(tie=False, layers=2)
    optimizer = models.two_group_adamw(model)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, _scheduler(optimizer))
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, skipped, lrs, param_dtypes = [], [], [], set()
    for batch in _batches():
        loss = models.loss_fn(model, models.shard_batch(batch, rank, world))
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        skipped.append(bool(optimizer.step_was_skipped))
        lrs.append(optimizer.param_groups[0]["lr"])
    param_dtypes.update(str(p.dtype) for p in model.parameters())
    state = zp.full_state_dict(model)
    accelerator.wait_for_everyone()
    return {"losses": losses, "skipped": skipped, "lrs": lrs, "state": state, "param_dtypes": sorted(param_dtypes),
            "loss_scale": float(optimizer.optimizer.loss_scale)}


def ddp_grad_scaler_run() -> dict:
    """The reference: DDP, fp32 parameters, autocast fp16 and torch's GradScaler, as Accelerate does on a GPU
    (the scheduler steps only when the optimizer did, as Accelerate's AcceleratedScheduler decides)."""
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
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        was_skipped = scaler.get_scale() < before
        if not was_skipped:
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        skipped.append(was_skipped)
        lrs.append(optimizer.param_groups[0]["lr"])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()} if rank == 0 else {}
    return {"losses": losses, "skipped": skipped, "lrs": lrs, "state": state, "loss_scale": scaler.get_scale()}


# -- Lightning Trainer and Fabric ------------------------------------------------------------------------------
def _plugin(package: str):
    """``precision="16-mixed"``'s plugin, made by hand: on a CPU-only machine Lightning's connector turns the flag
    into bf16-mixed, so the flag path is exercised on a GPU (tests/gpu/fp16_paths.py)."""
    import importlib

    mixed = importlib.import_module(f"{package}.plugins.precision").MixedPrecision
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    return mixed("16-mixed", "cpu", scaler=scaler)


def _scale_of(trainer) -> float:
    from zero_plugin.integrations import _common

    zero_optimizer = _common.zero_optimizer_of(trainer.optimizers[0])
    if zero_optimizer is not None:
        return float(zero_optimizer.loss_scale)
    return float(trainer.precision_plugin.scaler.get_scale())


def lightning_fp16_run(strategy: str) -> dict:
    """``Trainer(precision="16-mixed")`` with accumulation, clipping and a step-wise scheduler; the loss scale
    after every optimizer step."""
    import lightning.pytorch as pl

    from tests.integrations import lightning_workers as lw

    class ScaleLog(pl.Callback):
        def __init__(self) -> None:
            self.scales: list[float] = []

        def on_train_batch_end(self, trainer, *args) -> None:
            if (trainer.fit_loop.epoch_loop.batch_progress.current.completed + 1) % lw.ACCUM == 0:
                self.scales.append(_scale_of(trainer))

    log = ScaleLog()
    with lw.lightning_ranks(), tempfile.TemporaryDirectory() as root:
        module = lw.make_module("llama")
        trainer = lw.make_trainer(strategy, root, max_epochs=1, plugins=[_plugin("lightning.pytorch")],
                                  callbacks=[log])
        trainer.fit(module, lw.loader(STEPS * lw.ACCUM))
        return lw._result(trainer, module, scales=log.scales, global_step=trainer.global_step)


def fabric_fp16_run(strategy: str) -> dict:
    """A Fabric loop with ``precision="16-mixed"``'s plugin: backward, clip_gradients, step."""
    from lightning.fabric import Fabric

    from tests.integrations import lightning_workers as lw

    with lw.lightning_ranks():
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[_plugin("lightning.fabric")])
        fabric.launch()
        net = lw.build_net("llama")
        model, opt = fabric.setup(net, lw.make_optimizer(net.parameters()))
        rank, world = dist.get_rank(), dist.get_world_size()
        losses, scales = [], []
        for batch in _batches():
            loss = model(**models.shard_batch(batch, rank, world)).loss
            fabric.backward(loss)
            fabric.clip_gradients(model, opt, max_norm=CLIP, error_if_nonfinite=False)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            zero = getattr(opt.optimizer, "loss_scale", None)
            scales.append(float(zero) if zero is not None else float(fabric.strategy.precision.scaler.get_scale()))
        return {"losses": losses, "scales": scales, "state": lw._fabric_state(fabric, model)}
