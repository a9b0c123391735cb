"""Rank-side functions for ``test_offload.py`` (module-level so the worker pool can pickle them)."""
from __future__ import annotations

import torch

import zero_plugin as zp
from tests import models
from tests.parity import workers as W


def build(kind: str):
    return models.make_odd_mlp(dtype=torch.float32) if kind == "mlp32" else W.build_model(kind)


def train_worker(kind: str, stage: int, offload: bool, batches: list, steps: int, accum: int,
                 param_dtype: str | None = None) -> dict:
    model = build(kind)
    cfg = zp.ZeroConfig(stage=stage, offload_optimizer="cpu" if offload else "none", param_dtype=param_dtype,
                        reduce_dtype="fp32" if param_dtype else None)
    model, opt = zp.setup(model, W.build_optimizer(model), cfg)
    out = W._train(model, opt, batches, steps, accum, 1.0)
    full = zp.full_state_dict(model)
    out["params"] = {k: v.double() for k, v in full.items()}
    optim = opt.consolidate_state_dict()
    out["optim"] = {(i, k): v for i, e in optim.get("state", {}).items() for k, v in e.items()
                    if isinstance(v, torch.Tensor) and v.dim() > 0}
    out["fused"] = [g.get("fused") for g in opt.param_groups]
    return out


def memory_worker(stage: int, offload: bool, param_dtype: str | None) -> dict:
    """Placement of model states after backward (Adam state exists from a first step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    cfg = zp.ZeroConfig(stage=stage, offload_optimizer="cpu" if offload else "none", param_dtype=param_dtype)
    model, opt = zp.setup(model, torch.optim.AdamW(model.parameters()), cfg)
    dtype = cfg.param_dtype or torch.float32
    x = torch.randn(8, 256, dtype=dtype)
    for _ in range(2):
        model(x).float().pow(2).mean().backward()
        if _ == 0:
            opt.step()
            opt.zero_grad()
    return zp.memory_report(model, opt)


def bf16_reference(kind: str, batches: list, steps: int, accum: int) -> dict:
    """Single process: bf16 compute, fp32 master weights, same loop as the distributed run."""
    master = build(kind)
    opt = W.build_optimizer(master)
    model = build(kind).to(torch.bfloat16)
    losses = []
    for step in range(steps):
        with torch.no_grad():
            for p, m in zip(model.parameters(), master.parameters()):
                p.copy_(m)
        total = 0.0
        for micro in batches[step * accum:(step + 1) * accum]:
            x, y = micro
            loss = models.loss_fn(model, (x.to(torch.bfloat16), y.to(torch.bfloat16)))
            (loss / accum).backward()
            total += loss.item() / accum
        for p, m in zip(model.parameters(), master.parameters()):
            m.grad = p.grad.float() if p.grad is not None else None
            p.grad = None
        torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "params": {n: p.detach().double() for n, p in master.named_parameters()}}
