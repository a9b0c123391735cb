"""Functions that run inside the ranks of ``tests/unit/test_comm_time.py``: one optimizer step's comm_stats."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import zero_plugin as zp
from tests import models
from tests.unit.memory_comm_workers import collectives_layout

ROWS_PER_RANK = 3


def _micro_batch(step: int, i: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1000 * step + 10 * i + dist.get_rank())
    x = torch.randn(ROWS_PER_RANK, models.MLP_IN, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randn(ROWS_PER_RANK, models.MLP_OUT, generator=gen, dtype=torch.float64).to(dtype)
    return x, y


def step_stats(config: dict, accum: int, buffered: bool, model_dtype: torch.dtype = torch.float64) -> dict:
    """Train two steps of ``accum`` micro-batches (all but the last under ``zp.no_sync``); the second step's
    ``zp.comm_stats()`` (the first forward of a run still learns the unit order)."""
    model = models.make_odd_mlp(model_dtype)
    with collectives_layout(buffered):
        model, opt = zp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zp.ZeroConfig(**config))
    for step in range(2):
        if step == 1:
            zp.reset_comm_stats()
        for i in range(accum):
            sync = contextlib.nullcontext() if i == accum - 1 else zp.no_sync(model)
            x, y = _micro_batch(step, i, next(model.parameters()).dtype)
            with sync:
                torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return zp.comm_stats()
