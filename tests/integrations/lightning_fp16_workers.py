"""Functions that run inside the ranks of ``test_lightning_fp16.py``: Lightning's ``16-mixed`` under the ZeRO
strategies against ``strategy="ddp"`` with Lightning's own GradScaler.

On CPU, Lightning turns ``precision="16-mixed"`` into ``"bf16-mixed"`` (with a warning) before any strategy sees
it, so every run here passes the plugin itself, ``MixedPrecision("16-mixed", "cpu", scaler=GradScaler(...))``,
which Lightning takes as it is: under DDP this is Lightning's real fp16 path (autocast fp16 + its GradScaler).
The initial scale is huge, so fp16 overflows in the first steps (and again after each growth,
``GROWTH_INTERVAL`` clean steps later): the skipped steps must be the reference's.
"""

from __future__ import annotations

import functools
import tempfile

import torch
import torch.distributed as dist

from tests import models
from tests.integrations import lightning_workers as lw
from tests.integrations.lightning_setup import cpu_fabric, cpu_trainer, lightning_ranks

INIT_SCALE = 2.0**20
GROWTH_INTERVAL = 2
STEPS = 8
ACCUM = 2
# Clipping by value is exact on shards; a clip by norm that scales the gradients differs from torch's in the
# coefficient's last bits (another order of sums), which Adam amplifies to ~1e-5 in the weights in 8 steps.  So
# the runs clip by value, and Fabric's also take the norm (with a bound it never reaches) every other step.
CLIP_VALUE = 0.01
NO_CLIP_NORM = 1e6


def _scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def _strategy(spec, fabric: bool):
    """``"ddp"`` (``"ddp_fused"``: DDP whose AdamW is torch's fused kernel), or a ZeroConfig stage (int) / preset
    name for the ZeRO strategy; stage 3 built eagerly (the reference builds the same weights on every rank)."""
    if spec in ("ddp", "ddp_fused"):
        return "ddp"
    import zero_plugin as zp
    from zero_plugin.integrations.lightning import ZeroFabricStrategy, ZeroStrategy

    config = zp.ZeroConfig(stage=spec) if isinstance(spec, int) else spec
    return (ZeroFabricStrategy if fabric else ZeroStrategy)(config=config, meta_init=False)


def _plugin(package: str, **scaler_kwargs):
    from importlib import import_module

    MixedPrecision = import_module(f"{package}.plugins.precision").MixedPrecision
    options = dict(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, **scaler_kwargs)
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **options))


def loss_scale_of(precision, optimizer) -> float:
    """Lightning's GradScaler's scale under DDP; zero_plugin's loss scale under the ZeRO strategies."""
    from zero_plugin.integrations import common

    zero_optimizer = common.zero_optimizer_of(optimizer)
    if zero_optimizer is not None:
        return zero_optimizer.loss_scale  # Fabric's plugin keeps its GradScaler, which the strategy never calls
    return precision.scaler.get_scale()


def _skips(scales: list[float]) -> list[bool]:
    """A step was skipped exactly when it backed the scale off (both scalers halve it then, and only then)."""
    return [after < before for before, after in zip(scales, scales[1:])]


# -- Trainer ----------------------------------------------------------------------------------------------
@functools.cache
def _module_class():
    import lightning.pytorch as pl

    class Fp16Module(pl.LightningModule):
        """A tiny random Llama; the loss (fp32) of every micro-batch, the scale and lr after every step."""

        def __init__(self) -> None:
            super().__init__()
            self.net = models.make_tiny_llama(tie=False, layers=2)
            self.init_state = {k: v.detach().clone() for k, v in self.state_dict().items()}
            self.step_losses: list[float] = []
            self.scales = [INIT_SCALE]
            self.lrs: list[float] = []
            self.accum = ACCUM
            self.fused = None

        def training_step(self, batch, batch_idx):
            loss = self.net(**batch).loss.float()
            self.step_losses.append(loss.item())
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            if (batch_idx + 1) % self.accum == 0:
                optimizer = self.trainer.optimizers[0]
                self.scales.append(loss_scale_of(self.trainer.strategy.precision_plugin, optimizer))
                self.lrs.append(optimizer.param_groups[0]["lr"])

        def configure_optimizers(self):
            optimizer = models.two_group_adamw(self.net, fused=self.fused)
            # Lightning refuses to clip for an optimizer that unscales inside its step; the GradScaler unscales
            # first instead (as zero_plugin's scaler does before its fused step)
            optimizer._step_supports_amp_scaling = False
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": _scheduler(optimizer), "interval": "step"}}

    return Fp16Module


def trainer_fp16_run(spec, clip: tuple = ("value", CLIP_VALUE), accum: int = ACCUM) -> dict:
    """``STEPS`` optimizer steps of ``accum`` micro-batches, clipping by ``clip`` (algorithm, value), 16-mixed."""
    with lightning_ranks(), tempfile.TemporaryDirectory() as root:
        module = _module_class()()
        trainer = cpu_trainer(
            _strategy(spec, fabric=False),
            root,
            plugins=[_plugin("lightning.pytorch")],
            max_epochs=1,
            accumulate_grad_batches=accum,
            gradient_clip_algorithm=clip[0],
            gradient_clip_val=clip[1],
        )
        module.accum = accum
        module.fused = True if spec == "ddp_fused" else None
        trainer.fit(module, lw.loader(STEPS * accum, seed=1))
        out = {
            "losses": module.step_losses,
            "skipped": _skips(module.scales),
            "loss_scale": module.scales[-1],
            "lrs": module.lrs,
            "global_step": trainer.global_step,
            "state": lw.full_state(trainer),
            "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        }
        if dist.get_rank() == 0:
            out["init"] = module.init_state
        return out


# -- Fabric -----------------------------------------------------------------------------------------------
def fabric_fp16_run(spec) -> dict:
    """The user's Fabric loop: backward, clip_gradients (by value, or the norm: non-finite allowed), step."""
    with lightning_ranks():
        fabric = cpu_fabric(_strategy(spec, fabric=True), plugins=[_plugin("lightning.fabric")])
        net = models.make_tiny_llama(tie=False, layers=2)
        init = {k: v.detach().clone() for k, v in net.state_dict().items()}
        optimizer = models.two_group_adamw(net)
        scheduler = _scheduler(optimizer)
        model, optimizer = fabric.setup(net, optimizer)
        rank, world = dist.get_rank(), dist.get_world_size()
        losses, scales, lrs, norms = [], [INIT_SCALE], [], []
        for batch in models.make_batches("llama", STEPS, world, lw.PER_RANK_BATCH, seed=1):
            loss = model(**models.shard_batch(batch, rank, world)).loss.float()
            fabric.backward(loss)
            if len(losses) % 2:  # one clip per step: Lightning's GradScaler refuses to unscale twice
                fabric.clip_gradients(model, optimizer, clip_val=CLIP_VALUE)
            else:
                norms.append(
                    float(fabric.clip_gradients(model, optimizer, max_norm=NO_CLIP_NORM, error_if_nonfinite=False))
                )
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            scales.append(loss_scale_of(fabric.strategy.precision, optimizer))
            lrs.append(optimizer.param_groups[0]["lr"])
        state = fabric.strategy.get_module_state_dict(model._forward_module)
        return {
            "losses": losses,
            "skipped": _skips(scales),
            "loss_scale": scales[-1],
            "lrs": lrs,
            "norms": norms,
            "state": state if rank == 0 else {},
            "init": init,
        }


# -- refusals -------------------------------------------------------------------------------------------------
def refusals_worker() -> dict:
    """The messages of GradScaler settings zero_plugin's scaler cannot reproduce."""
    from zero_plugin.integrations.lightning import ZeroFabricStrategy, ZeroPrecision

    out = {}
    with lightning_ranks():
        try:
            ZeroPrecision(_plugin("lightning.pytorch", growth_factor=4.0))
        except ValueError as exc:
            out["trainer_growth"] = str(exc)
        try:
            ZeroFabricStrategy(config="zero2", precision=_plugin("lightning.fabric", backoff_factor=0.25))
        except ValueError as exc:
            out["fabric_backoff"] = str(exc)
    return out
