"""Rank-side functions for test_faults.py and a standalone rank-death scenario."""

from __future__ import annotations

import os
import signal
import time
import traceback

import torch
import torch.distributed as dist

import zero_plugin as zp
from tests import models


def _expect_error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # the test inspects the message
        return f"{type(exc).__name__}: {exc}"
    return ""


def config_drift_worker(kind: str) -> str:
    rank = dist.get_rank()
    model = models.make_odd_mlp()
    stage = 2
    if kind == "config" and rank == 1:
        stage = 3
    if kind == "model" and rank == 1:
        model.head = torch.nn.Linear(15, 14, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters())
    return _expect_error(lambda: zp.setup(model, opt, zp.ZeroConfig(stage=stage)))


def bad_input_worker() -> dict:
    """Every public verb given something wrong: the error says what to do."""
    model = models.make_odd_mlp()
    opt = torch.optim.AdamW(model.parameters())
    other = torch.nn.Linear(3, 3)
    out = {
        "clip_unprepared": _expect_error(lambda: zp.clip_grad_norm_(model, 1.0)),
        "no_sync_unprepared": _expect_error(lambda: zp.no_sync(model).__enter__()),
        "full_sd_unprepared": _expect_error(lambda: zp.full_state_dict(model)),
        "memory_unprepared": _expect_error(lambda: zp.memory_report(model, opt)),
        "setup_not_module": _expect_error(lambda: zp.setup("model", opt, zp.ZeroConfig())),
        "setup_not_optimizer": _expect_error(lambda: zp.setup(model, [1, 2], zp.ZeroConfig())),
        "setup_bad_config": _expect_error(lambda: zp.setup(model, opt, {"stage": 3})),
        "setup_foreign_param": _expect_error(
            lambda: zp.setup(model, torch.optim.AdamW(other.parameters()), zp.ZeroConfig())
        ),
        "setup_missing_param": _expect_error(
            lambda: zp.setup(model, torch.optim.AdamW(list(model.parameters())[:1]), zp.ZeroConfig())
        ),
    }
    model, zopt = zp.setup(model, opt, zp.ZeroConfig(stage=2))
    out["setup_twice"] = _expect_error(
        lambda: zp.setup(model, torch.optim.AdamW(model.parameters()), zp.ZeroConfig(stage=2))
    )
    out["clip_bad_norm"] = _expect_error(lambda: zp.clip_grad_norm_(model, -1.0))
    out["load_full_not_dict"] = _expect_error(lambda: zp.load_full_state_dict(model, [1], src_rank=None))
    out["add_param_group"] = _expect_error(lambda: zopt.add_param_group({"params": [torch.zeros(1)]}))
    out["pickle_optimizer"] = _expect_error(lambda: __import__("pickle").dumps(zopt))
    return out


class BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(7, 5, dtype=torch.float64)
        self.bn = torch.nn.BatchNorm1d(5, dtype=torch.float64)
        self.empty = torch.nn.Parameter(torch.zeros(0, dtype=torch.float64))  # zero-size parameter

    def forward(self, x):
        return self.bn(self.lin(x)).sum(-1) + self.empty.sum()


def buffers_worker(stage: int) -> dict:
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=stage))
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        model(torch.randn(6, 7, generator=g, dtype=torch.float64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {
        "running_mean": model.bn.running_mean.clone(),
        "running_var": model.bn.running_var.clone(),
        "tracked": int(model.bn.num_batches_tracked),
    }


def rank_death_main(rank: int, world: int, port: int, result_dir: str, stage: int) -> None:
    """Rank 1 SIGKILLs itself in the middle of a backward; the others must fail with an error, not hang."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    model = models.make_tiny_llama(layers=2)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=stage, timeout_s=30.0))
    batch = models.make_batches("llama", 1, world, 2)[0]
    start = time.time()
    try:
        for step in range(3):
            loss = models.loss_fn(model, models.shard_batch(batch, rank, world))
            if step == 1 and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            opt.step()
            opt.zero_grad()
        outcome = "finished"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{time.time() - start:.1f}\n{outcome}")
    os._exit(0)  # the process group is broken; do not wait on it
