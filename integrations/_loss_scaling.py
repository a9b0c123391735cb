"""fp16 through the one-flag paths: Accelerate's ``mixed_precision="fp16"`` and Lightning's ``precision="16-mixed"``.

[Note: fp16 one-flag mapping]
Both flags mean "autocast to fp16 + torch's GradScaler" in their own tools.  A GradScaler cannot work here: it
unscales and checks ``param.grad``, which stages 2-3 do not keep (the reduced shards live in the engine) and
which would be checked rank by rank, so ranks could disagree on skipping.  The flags are therefore mapped onto
zero_plugin's own fp16:

* ``ZeroConfig(param_dtype=fp16)``: parameters are stored (stages 0-2) or gathered (stage 3) in fp16, with fp32
  masters stepped by the optimizer; this is what halves parameter memory and gather traffic, as FSDP's
  ``MixedPrecision(param_dtype=float16)`` does under Accelerate's and Lightning's FSDP fp16.  An explicit other
  ``param_dtype`` is refused.  ``reduce_dtype`` defaults to fp32 here (not fp16): the sum over ranks of two
  fp16 gradients near 65504 overflows where the average (and DDP's fp32 all-reduce) does not, which would skip
  steps the DDP run takes; set ``reduce_dtype="fp16"`` explicitly to halve that traffic.
* autocast stays on (Accelerate's forward wrapper, Lightning's ``forward_context``): ops torch runs in fp32 under
  autocast (softmax, norms, losses) still do, so the numerics are those of the DDP run up to fp16 rounding of
  the tensors autocast leaves in the parameters' dtype (embeddings, the residual stream).  torch's CPU autocast
  runs fp16 too, so the same run happens on a CPU-only machine (Accelerate alone ignores fp16 there).
* the GradScaler's ``init_scale`` and ``growth_interval`` become ``ZeroConfig.loss_scale_init`` /
  ``loss_scale_growth_interval``; its growth/backoff factors must be torch's defaults (2.0, 0.5), which
  zero_plugin's dynamic scaler uses; a disabled scaler becomes ``loss_scale=1.0`` (no scaling, inf/NaN steps
  still skipped on every rank).
* the backward scales the loss by the set-up optimizer's scale (``optim/loss_scale.py``, found through the
  model's engine), clipping unscales first, and ``ZeroOptimizer.step`` skips a step with inf/NaN on any rank.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
from torch import nn

import zero_plugin as zp
from zero_plugin.engine import engine_of

__all__ = ["fp16_config", "scaler_settings", "scale_loss", "unscale"]

_DEFAULT_FACTORS = {"growth_factor": 2.0, "backoff_factor": 0.5}


def scaler_settings(scaler: Any = None, kwargs: Mapping[str, Any] | None = None) -> dict:
    """The ZeroConfig fields for a torch GradScaler, or for GradScaler keyword arguments (Accelerate's
    ``GradScalerKwargs``); ``{}`` for neither."""
    if scaler is not None:
        kwargs = {"init_scale": scaler.get_scale(), "growth_interval": scaler.get_growth_interval(),
                  "growth_factor": scaler.get_growth_factor(), "backoff_factor": scaler.get_backoff_factor(),
                  "enabled": scaler.is_enabled()}
    kwargs = dict(kwargs or {})
    for name, default in _DEFAULT_FACTORS.items():
        if name in kwargs and float(kwargs[name]) != default:
            raise ValueError(f"zero_plugin: GradScaler {name}={kwargs[name]!r} is not supported; zero_plugin's fp16 "
                             f"loss scaler uses {name}={default} (torch's default): leave it unset")
    if not kwargs.get("enabled", True):
        return {"loss_scale": 1.0}
    out = {}
    if "init_scale" in kwargs:
        out["loss_scale_init"] = float(kwargs["init_scale"])
    if "growth_interval" in kwargs:
        out["loss_scale_growth_interval"] = int(kwargs["growth_interval"])
    return out


def fp16_config(config: zp.ZeroConfig, settings: Mapping[str, Any], flag: str) -> zp.ZeroConfig:
    """``config`` with fp16 parameters and fp32 reduction unless set ([Note: fp16 one-flag mapping])."""
    if config.param_dtype not in (None, torch.float16):
        raise ValueError(f"zero_plugin: {flag} trains with fp16 parameters, but ZeroConfig.param_dtype="
                         f"{config.param_dtype}; drop param_dtype from the ZeroConfig, or use the "
                         f"mixed-precision flag for {config.param_dtype}")
    reduce_dtype = config.reduce_dtype if config.reduce_dtype is not None else torch.float32
    return dataclasses.replace(config, param_dtype=torch.float16, reduce_dtype=reduce_dtype, **settings)


def scale_loss(module: nn.Module | None, loss: torch.Tensor) -> torch.Tensor:
    """``loss`` times the loss scale of ``module``'s set-up optimizer (unchanged without fp16 loss scaling)."""
    if module is None or not isinstance(module, nn.Module):
        return loss
    try:
        guard = engine_of(module, "backward").grad_guard
    except ValueError:   # not set up (e.g. a frozen teacher): nothing to scale for
        return loss
    return loss if guard is None else guard.scale_loss(loss)


def unscale(zero_optimizer: zp.ZeroOptimizer) -> None:
    """Divide this step's gradients by the loss scale now (once per step; clipping and hooks see true values)."""
    zero_optimizer.unscale_()
