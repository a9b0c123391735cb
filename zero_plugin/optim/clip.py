"""Global-norm gradient clipping over every rank's owned gradients.

The norm is over the *reduced* gradients the optimizer will see: for sharded
stages each rank holds a disjoint region, so the per-rank sums of |g|^p are
all-reduced (a per-rank norm, pytorch/pytorch#170862, would be wrong).  With hierarchical sharding
``engine.comm`` is the shard group: every replica group holds the same reduced shards, bit for bit
([Note: sum across replicas] in ``comm/layout.py``), so the sum over the shard group counts each element
once and is the same on every rank; over the whole world it would count each N/k times.
"""

from __future__ import annotations

import math

import torch

__all__ = ["clip_owned_grads"]


@torch.no_grad()
def clip_owned_grads(engine, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    grads = engine.owned_grads()
    device = grads[0].device if grads else torch.device("cpu")
    if engine.comm.device.type == "cuda" and device.type != "cuda":
        device = engine.comm.device  # NCCL reduces CUDA tensors only
    norm_type = float(norm_type)
    if math.isinf(norm_type):
        local = max((g.detach().abs().max().float() for g in grads if g.numel()), default=torch.tensor(0.0))
        total = torch.as_tensor(local, dtype=torch.float32, device=device).reshape(1).clone()
        if engine.grads_sharded:
            engine.comm.all_reduce(total, op="max")
        total_norm = total[0]
    else:
        acc = torch.zeros(1, dtype=torch.float64, device=device)
        for g in grads:
            if g.numel():
                acc += g.detach().double().norm(norm_type) ** norm_type
        if engine.grads_sharded:
            engine.comm.all_reduce(acc)
        total_norm = acc[0] ** (1.0 / norm_type)
    engine.note_grad_norm(float(total_norm))  # global, same on every rank: the step's finite check reuses it
    coef = float(max_norm) / (float(total_norm) + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total_norm.to(grads[0].dtype if grads else torch.float32)
