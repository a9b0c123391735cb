"""Optimizer offload on a real device (issue: CPU-offload optimizer), run by tests/gpu/check.py part "offload".

* Peak CUDA memory of a bf16 model with fp32 AdamW at stage 2, world size 1: with ``offload_optimizer="cpu"``
  the device no longer holds the fp32 masters and both moments, so the peak falls by about 12 bytes per
  parameter (``drop_over_state`` at least ~1; more when the device step's temporaries set the peak).
* The offloaded step is the blocked one ([Note: cache-blocked offload step] in
  ``zero_plugin/optim/blocked_step.py``): it waits for each gradient's host copy alone and writes each block
  back without blocking.  Its result is bitwise that of the whole-tensor path (``opt.blocked = None``:
  wait for every copy, step everything, then copy everything back), and its step time is recorded next to
  that path's.
"""

from __future__ import annotations

import gc
import time

import torch

GiB = 2**30


def _model(hidden: int = 1024, layers: int = 12) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])


def _train(offload: bool, blocked: bool = True, steps: int = 4) -> dict:
    import zero_plugin as zp

    model = _model().cuda()
    psi = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zp.setup(
        model, opt, zp.ZeroConfig(stage=2, param_dtype="bf16", offload_optimizer="cpu" if offload else "none")
    )
    if not blocked:
        opt.blocked = None
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step_s = []
    for _ in range(steps):
        model(x).float().square().mean().backward()
        torch.cuda.synchronize()
        t = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t)
        opt.zero_grad()
    out = {
        "psi": psi,
        "peak": torch.cuda.max_memory_allocated(),
        "allocated_before": before,
        "step_s": sorted(step_s)[len(step_s) // 2],
        "blocked_used": opt.blocked is not None and blocked,
        "params": [p.detach().float().cpu() for p in model.parameters()],
    }
    del model, opt
    gc.collect()  # the engine's hooks and the model reference each other: freed by the cycle collector
    torch.cuda.empty_cache()
    return out


def part_offload() -> dict:
    from tests.gpu.check import _nccl_world1

    _nccl_world1()
    torch.manual_seed(1)
    off = _train(offload=False)
    torch.manual_seed(1)
    on = _train(offload=True)
    torch.manual_seed(1)
    whole = _train(offload=True, blocked=False)
    state_bytes = 12 * on["psi"]  # fp32 master + exp_avg + exp_avg_sq
    drop = off["peak"] - on["peak"]
    bitwise = all(torch.equal(a, b) for a, b in zip(on["params"], whole["params"]))
    return {
        "psi": on["psi"],
        "peak_gib": {"no_offload": off["peak"] / GiB, "offload": on["peak"] / GiB},
        "allocated_before_gib": {"no_offload": off["allocated_before"] / GiB, "offload": on["allocated_before"] / GiB},
        "drop_over_state": drop / state_bytes,
        "blocked_bitwise_whole_tensor": bitwise,
        "blocked_used": on["blocked_used"],
        "step_ms": {
            "no_offload": off["step_s"] * 1e3,
            "offload_blocked": on["step_s"] * 1e3,
            "offload_whole_tensor": whole["step_s"] * 1e3,
        },
        # at least the state: without offload the step's own temporaries (foreach AdamW) may add more
        "ok": bitwise and on["blocked_used"] and drop >= 0.9 * state_bytes,
    }
