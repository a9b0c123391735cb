"""Rank-side functions for test_numerics.py."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import zero_plugin as zp
from tests import models


def _setup(stage: int, param_dtype: str | None):
    model = models.make_odd_mlp(dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return zp.setup(model, opt, zp.ZeroConfig(stage=stage, param_dtype=param_dtype))


def _snapshot(model) -> dict:
    return {k: v.float().clone() for k, v in zp.full_state_dict(model, rank0_only=False).items()}


def poisoned_step_worker(stage: int, param_dtype: str | None, poison: str) -> dict:
    """Step 0 clean, step 1 with an inf/NaN loss on rank 1 only, step 2 clean."""
    model, opt = _setup(stage, param_dtype)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = models.make_batches("mlp", 3, world, 2, dtype=torch.float32)
    out = {"scales": [], "changed": [], "skipped": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, batch in enumerate(batches):
            before = _snapshot(model)
            loss = models.loss_fn(model, models.shard_batch(batch, rank, world))
            if step == 1 and rank == 1:
                loss = loss * float(poison)
            opt.scale_loss(loss).backward()
            zp.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            after = _snapshot(model)
            out["changed"].append(any(not torch.equal(before[k], after[k]) for k in before))
            out["scales"].append(opt.loss_scale)
            out["skipped"].append(opt.skipped_steps)
            out["finite"] = all(torch.isfinite(v).all().item() for v in after.values())
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return out


# -- per-step state and discarded gradients ----------------------------------------------------
PROBE_DISCARDS = ("model", "model_keep", "optimizer", "optimizer_keep")


def _discard(model, opt, how: str) -> None:
    """Throw the current gradients away the way a user (or PEFT / HF Trainer) would."""
    if how == "model":
        model.zero_grad()
    elif how == "model_keep":
        model.zero_grad(set_to_none=False)
    elif how == "optimizer":
        opt.zero_grad()
    elif how == "optimizer_keep":
        opt.zero_grad(set_to_none=False)
    else:
        raise ValueError(f"unknown discard {how!r}; expected one of {PROBE_DISCARDS}")


def sgd(model) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def adamw(model) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def probe_discarded_worker(stage: int, batches: list, probes: list) -> dict:
    """Per step: a probe backward on ``probes[i]``, its gradients discarded (each way in turn, on a fresh
    float64 model), then the real backward on ``batches[i]`` and a step.  Parameters per discard."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for how in PROBE_DISCARDS:
        model = models.make_odd_mlp()
        model, opt = zp.setup(model, adamw(model), zp.ZeroConfig(stage=stage))
        for batch, probe in zip(batches, probes):
            models.loss_fn(model, models.shard_batch(probe, rank, world)).backward()
            _discard(model, opt, how)
            models.loss_fn(model, models.shard_batch(batch, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        out[how] = zp.full_state_dict(model, rank0_only=False)
    return out


def skipped_spike_worker(stage: int, precision: str, how: str, batches: list, poison_step: int | None) -> dict:
    """Step 0: backward, ``clip_grad_norm_``, gradients discarded without a step (a loss spike skipped by
    the user).  Later steps train normally, except that the last rank's loss at ``poison_step`` is NaN.
    ``precision``: "fp16" (fp32 model, fp16 params, dynamic loss scale) or "fp64" (float64, no scaling)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = models.make_odd_mlp(dtype=torch.float32 if precision == "fp16" else torch.float64)
    config = zp.ZeroConfig(stage=stage, param_dtype="fp16" if precision == "fp16" else None)
    model, opt = zp.setup(model, sgd(model), config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, batch in enumerate(batches):
            loss = models.loss_fn(model, models.shard_batch(batch, rank, world))
            if step == poison_step and rank == world - 1:
                loss = loss * float("nan")
            opt.scale_loss(loss).backward()
            if step == 0:
                zp.clip_grad_norm_(model, 0.1)
                _discard(model, opt, how)
                continue
            opt.step()
            opt.zero_grad()
    params = {k: v.double() for k, v in zp.full_state_dict(model, rank0_only=False).items()}
    return {
        "params": params,
        "skipped": opt.skipped_steps,
        "scale": opt.loss_scale,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    }


def config_clip_worker(stage: int, batches: list, config_max: float, user_max: float | None) -> dict:
    """float64 OddMLP, two-group AdamW, ``ZeroConfig(clip_grad_norm=config_max)``; with ``user_max`` the
    loop also calls ``zp.clip_grad_norm_(model, user_max)`` before each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = models.make_odd_mlp()
    model, opt = zp.setup(model, models.two_group_adamw(model), zp.ZeroConfig(stage=stage, clip_grad_norm=config_max))
    norms = []
    for batch in batches:
        models.loss_fn(model, models.shard_batch(batch, rank, world)).backward()
        if user_max is not None:
            norms.append(float(zp.clip_grad_norm_(model, user_max)))
        opt.step()
        opt.zero_grad()
    return {"params": zp.full_state_dict(model, rank0_only=False), "user_norms": norms}


def lora_probe_discarded_worker(stage: int, batches: list, probes: list) -> dict:
    """The set-up object is a PeftModel: a probe backward, ``model.zero_grad()`` on it, the real step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = models.make_tiny_llama_lora(layers=2)
    model, opt = zp.setup(model, adamw(model), zp.ZeroConfig(stage=stage))
    for batch, probe in zip(batches, probes):
        models.loss_fn(model, models.shard_batch(probe, rank, world)).backward()
        model.zero_grad()
        models.loss_fn(model, models.shard_batch(batch, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    return zp.full_state_dict(model, rank0_only=False, trainable_only=True)


# -- the inf/NaN check folded into stage 0's average ([Note: finite check in the average]) ----------------
UNCLIPPED_POISONS = ("loss", "grad_in_place", "hook_and_write", "none")


def unclipped_poison_worker(stage: int, poison: str, dtype: str = "fp32") -> dict:
    """Step 0 clean, step 1 poisoned on the last rank only, step 2 clean; no clipping, no loss scaling, so the
    step's own inf/NaN check decides.  One parameter per bucket.  ``poison``: "loss" (a NaN loss),
    "grad_in_place" (an inf written into the first parameter's reduced ``param.grad`` after backward),
    "hook_and_write" (the first parameter's gradient made inf in backward, before its reduction, and the last
    one's reduced gradient scaled in place by 1.0 after it: the step reads that one and takes the other's
    answer from its average), "none".  Also the aten ops of each step that compute norms."""
    torch_dtype = {"fp32": torch.float32, "fp64": torch.float64}[dtype]
    model = models.make_odd_mlp(dtype=torch_dtype)
    config = zp.ZeroConfig(stage=stage, bucket_size_mb=1e-6)  # one parameter per bucket
    model, opt = zp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    first, last = list(model.parameters())[0], list(model.parameters())[-1]
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = models.make_batches("mlp", 3, world, 2, dtype=torch_dtype)
    out = {"changed": [], "skipped": [], "norm_ops": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, batch in enumerate(batches):
            before = _snapshot(model)
            loss = models.loss_fn(model, models.shard_batch(batch, rank, world))
            poisoned = step == 1 and rank == world - 1
            if poisoned and poison == "loss":
                loss = loss * float("nan")
            hook = first.register_hook(lambda g: g + float("inf")) if poisoned and poison == "hook_and_write" else None
            loss.backward()
            if hook is not None:
                hook.remove()
                last.grad.mul_(1.0)
            if poisoned and poison == "grad_in_place":
                first.grad.view(-1)[0] = float("inf")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                opt.step()
            opt.zero_grad()
            out["norm_ops"].append(
                sorted({e.key for e in prof.key_averages() if "norm" in e.key and e.key.startswith("aten::")})
            )
            after = _snapshot(model)
            out["changed"].append(any(not torch.equal(before[k], after[k]) for k in before))
            out["skipped"].append(opt.skipped_steps)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return out


def fp16_unscale_worker(stage: int, poison: str) -> dict:
    """fp16 parameters, dynamic loss scale, no clipping: step 0 clean, step 1 poisoned on the last rank only,
    step 2 clean.  ``poison``: "none", "loss" (a NaN loss), "after_unscale" (``opt.unscale_()``, then an inf
    written into the first owned gradient: the unscale's own answer no longer covers it).  Also the aten
    ops of each step that compute norms ([Note: finite check in the unscale] in optim/loss_scale.py)."""
    from zero_plugin.engines.engine import engine_of

    model = models.make_odd_mlp(dtype=torch.float32)
    config = zp.ZeroConfig(stage=stage, param_dtype="fp16", bucket_size_mb=1e-6)
    model, opt = zp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = models.make_batches("mlp", 3, world, 2, dtype=torch.float32)
    out = {"changed": [], "skipped": [], "scales": [], "norm_ops": []}
    for step, batch in enumerate(batches):
        before = _snapshot(model)
        loss = models.loss_fn(model, models.shard_batch(batch, rank, world))
        poisoned = step == 1 and rank == world - 1
        if poisoned and poison == "loss":
            loss = loss * float("nan")
        opt.scale_loss(loss).backward()
        if poison == "after_unscale" and step == 1:
            opt.unscale_()
            if poisoned:
                engine_of(model, "test").owned_grads()[0].view(-1)[0] = float("inf")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            opt.step()
        opt.zero_grad()
        out["norm_ops"].append(
            sorted({e.key for e in prof.key_averages() if "norm" in e.key and e.key.startswith("aten::")})
        )
        after = _snapshot(model)
        out["changed"].append(any(not torch.equal(before[k], after[k]) for k in before))
        out["skipped"].append(opt.skipped_steps)
        out["scales"].append(opt.loss_scale)
    return out
