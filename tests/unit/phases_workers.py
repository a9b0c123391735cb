"""Rank functions of ``tests/unit/test_profiler_phases.py``."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import zero_plugin as zp
from tests import models
from zero_plugin.tensors import phases


def _step(model, opt, x, y) -> None:
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def profiled_step_worker(config: dict, path: str) -> dict:
    """Two warm-up steps, then one step and a checkpoint save profiled: the ``zero_plugin::`` ranges seen, and
    the aten ops of that step with the phases on and (patched to the null context) off."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = models.make_odd_mlp(dtype=torch.float32)
    model, opt = zp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), zp.ZeroConfig(**config))
    x, y = models.shard_batch(models.make_batches("mlp", 1, world, 2, dtype=torch.float32)[0], rank, world)
    for _ in range(2):
        _step(model, opt, x, y)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model, opt, x, y)
        zp.save_checkpoint(os.path.join(path, "on"), model, opt)
    names = sorted({e.name for e in prof.events() if e.name.startswith(phases.PREFIX)})
    on = sorted(e.name for e in prof.events() if e.name.startswith("aten::"))
    real = phases.phase
    phases_off = {m: m.phase for m in _users() if getattr(m, "phase", None) is real}
    try:
        for module in phases_off:
            module.phase = lambda name: phases._OFF
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(model, opt, x, y)
            zp.save_checkpoint(os.path.join(path, "off"), model, opt)
    finally:
        for module, fn in phases_off.items():
            module.phase = fn
    off = sorted(e.name for e in prof.events() if e.name.startswith("aten::"))
    return {"names": names, "same_ops": on == off, "ops": len(on), "null": phases.phase("x") is phases._OFF}


def _users():
    import sys

    return [m for name, m in list(sys.modules.items()) if name.startswith("zero_plugin.") and m is not None]
