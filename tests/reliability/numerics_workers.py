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
