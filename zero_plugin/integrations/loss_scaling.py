"""Accelerate's ``mixed_precision="fp16"`` and Lightning's ``precision="16-mixed"`` on zero_plugin's synchronized
loss scaler.

[Note: fp16 one-flag mapping]
Under DDP, ``mixed_precision="fp16"`` (Accelerate) or ``precision="16-mixed"`` (Lightning Trainer and Fabric)
means: fp32 parameters, the forward under ``autocast(fp16)``, and torch's GradScaler (backward scales, unscaling
before clipping, the step skipped on inf/NaN).
zero_plugin keeps the first two as they are and replaces only the GradScaler, which cannot work here: it
unscales and checks ``param.grad``, which stages 2-3 do not keep (the reduced shards live in the engine), and
it would check rank by rank.  So the flag sets ``ZeroConfig.loss_scaling=True`` (parameters keep their dtype)
and the GradScaler's settings, and the engine's ``GradGuard`` (``zero_plugin/optim/loss_scale.py``) does the
scaler's work on the owned gradients, with one all-reduced flag so that every rank skips the same steps.  The
gradients are fp32, as DDP's, so the skipped steps are DDP's step for step and the numbers differ only by the
order of the fp32 sums (``tests/integrations/test_fp16.py``, ``test_lightning_fp16.py``).

* the GradScaler's ``init_scale`` / ``growth_interval`` (Accelerate's ``GradScalerKwargs``; the ``scaler`` of
  Lightning's ``MixedPrecision`` plugin) become ``ZeroConfig.loss_scale_init`` / ``loss_scale_growth_interval``;
  its growth/backoff factors must be torch's defaults (2.0, 0.5), which zero_plugin's scaler uses; a disabled
  scaler becomes ``loss_scale=1.0`` (no scaling; an inf/NaN step is still skipped on every rank, where a
  disabled GradScaler would apply it).
* Accelerate: autocast is kept on every device: on CPU, where Accelerate alone ignores fp16 (no autocast, no
  scaler), the run is the one a GPU would make, so it can be tested and compared on CPU.
* Lightning (``lightning/common.py``, ``loss_scaler_settings``): the plugin keeps autocast; ``ZeroPrecision``
  (Trainer) and ``ZeroFabricStrategy.backward`` / ``optimizer_step`` scale, unscale and step through the engine
  and never call the plugin's GradScaler.  As with Lightning's own scaler, a skipped step is still a step to
  Lightning (``global_step`` and step-interval schedulers advance) and ``optimizer_step`` returns None.  On
  CPU, Lightning itself turns ``precision="16-mixed"`` into ``"bf16-mixed"`` before a strategy sees it, under
  DDP as under ZeRO; passing ``plugins=[MixedPrecision("16-mixed", "cpu")]`` keeps fp16.
* fp16 parameters are an explicit opt-in: ``ZeroConfig(param_dtype="fp16")`` with the flag keeps them (fp32
  masters; half the parameter memory and stage-3 gather traffic, as FSDP's ``param_dtype=float16``), at the
  price of fp16 per-parameter gradients, which can overflow (and skip a step) where DDP's fp32 ones do not.
  A bf16 ``param_dtype`` contradicts the flag and is refused, as is ``loss_scaling=False``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from zero_plugin.config import ZeroConfig

__all__ = ["fp16_config", "scaler_settings"]

_DEFAULT_FACTORS = {"growth_factor": 2.0, "backoff_factor": 0.5}


def scaler_settings(kwargs: Mapping[str, Any] | None) -> dict:
    """The ZeroConfig fields for torch GradScaler keyword arguments (Accelerate's ``GradScalerKwargs``)."""
    kwargs = dict(kwargs or {})
    for name, default in _DEFAULT_FACTORS.items():
        if name in kwargs and float(kwargs[name]) != default:
            raise ValueError(
                f"zero_plugin: GradScaler {name}={kwargs[name]!r} is not supported; zero_plugin's fp16 "
                f"loss scaler uses {name}={default} (torch's default): leave it unset"
            )
    if not kwargs.get("enabled", True):
        return {"loss_scale": 1.0}
    out = {}
    if "init_scale" in kwargs:
        out["loss_scale_init"] = float(kwargs["init_scale"])
    if "growth_interval" in kwargs:
        out["loss_scale_growth_interval"] = int(kwargs["growth_interval"])
    return out


def fp16_config(config: ZeroConfig, settings: Mapping[str, Any], flag: str) -> ZeroConfig:
    """``config`` with loss scaling on and ``settings`` ([Note: fp16 one-flag mapping])."""
    if config.precision.loss_scaling is False:
        raise ValueError(
            f"zero_plugin: {flag} needs loss scaling, but ZeroConfig.loss_scaling=False; drop "
            "loss_scaling from the ZeroConfig, or train without fp16"
        )
    if config.precision.param_dtype not in (None, torch.float32, torch.float16):
        raise ValueError(
            f"zero_plugin: {flag} runs the forward in fp16, but ZeroConfig.param_dtype="
            f"{config.precision.param_dtype}; drop param_dtype from the ZeroConfig (fp32 parameters, as "
            f"under DDP) or set it to fp16, or use the mixed-precision flag for {config.precision.param_dtype}"
        )
    return config.replace(loss_scaling=True, **settings)
