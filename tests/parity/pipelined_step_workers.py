"""Model, data, reference and rank function of ``tests/parity/test_pipelined_step.py``.

Stages 1-2 on gloo step one bucket at a time with each bucket's gather in flight ([Note: pipelined step] in
``zero_plugin/optim/pipelined_step.py``).  ``bucket_view_workers``' float64 model (odd shapes, shards
padded at 2 and 3 ranks, a head used on rank 0 only and a parameter used by none), a tiny
``bucket_size_mb`` so that every parameter is a bucket of its own, two param groups with different
options; each step's parameters are compared with a single-process reference and, bit for bit, with the
same run stepping whole (a no-op step hook on the optimizer turns the pipelining off).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero_plugin as zp
from tests.parity.bucket_view_workers import IN, OUT, TwoHeads  # 15 hidden units: padded shards at 2 and 3 ranks
from zero_plugin.api import engine_of

ROWS_PER_RANK, STEPS = 4, 4
OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1),
    "adam_foreach": lambda groups: torch.optim.Adam(groups, lr=0.05, foreach=True),
    "sgd_momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
}


def _groups(model: TwoHeads) -> list[dict]:
    """Two groups, the second with its own learning rate."""
    second = {id(p) for p in model.head.parameters()}
    return [
        {"params": [p for p in model.parameters() if id(p) not in second]},
        {"params": list(model.head.parameters()), "lr": 0.02},
    ]


def _batches(world_size: int) -> list:
    gen = torch.Generator().manual_seed(1)
    rows = world_size * ROWS_PER_RANK
    return [
        (
            torch.randn(rows, IN, generator=gen, dtype=torch.float64),
            torch.randn(rows, OUT, generator=gen, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def _rank_loss(model, x, y, rank: int):
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    return F.mse_loss(model(x[rows], use_side=rank == 0), y[rows])


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference(world_size: int, optimizer: str) -> list[dict]:
    """The parameters after each step: mean over ranks of each rank's mean loss, one process."""
    model = TwoHeads().double()
    opt = OPTIMIZERS[optimizer](_groups(model))
    out = []
    for x, y in _batches(world_size):
        opt.zero_grad()
        (sum(_rank_loss(model, x, y, r) for r in range(world_size)) / world_size).backward()
        opt.step()
        out.append(_params(model))
    return out


def train_worker(stage: int, optimizer: str, pipelined: bool) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = TwoHeads().double()
    inner = OPTIMIZERS[optimizer](_groups(model))
    calls = []
    if not pipelined:
        inner.register_step_pre_hook(lambda *_: calls.append(1))  # any step hook: the whole step at once
    model, opt = zp.setup(model, inner, zp.ZeroConfig(stage=stage, bucket_size_mb=1e-6))
    engine = engine_of(model, "test")
    out = {"params": [], "pipelined": engine.can_step_pipelined(opt.inner), "buckets": len(engine.param_sync.buckets)}
    for x, y in _batches(world_size):
        opt.zero_grad()
        _rank_loss(model, x, y, rank).backward()
        opt.step()
        out["params"].append(_params(model))
    out["hook_calls"] = len(calls)
    out["groups"] = [len(g["params"]) for g in opt.inner.param_groups]
    return out
