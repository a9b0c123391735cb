"""Micro-benchmark of the gloo collectives the engines use, at bucket size.

    python -m benchmarks.collectives --mb 25 --iters 10

Per collective: median wall time of issue (the async call returning) and of
issue + wait, and the process CPU time, on ``world_size`` ranks.  Answers
"what does one 25 MiB reduce-scatter cost next to an all-reduce on this machine".
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .compare import _cores, _free_port

__all__ = ["main"]


def _cases(numel: int, n: int) -> dict:
    full = torch.randn(numel)
    shard = torch.empty(numel // n)
    gathered = torch.empty(numel // n * n)
    return {
        "all_reduce (in place, full)": lambda: dist.all_reduce(full, async_op=True),
        "reduce_scatter_single (full in, 1/N out)": lambda: dist.reduce_scatter_single(
            shard, full[: numel // n * n], async_op=True
        ),
        "all_gather_single (1/N in, full out)": lambda: dist.all_gather_single(gathered, shard, async_op=True),
        "broadcast (full)": lambda: dist.broadcast(full, src=0, async_op=True),
        "reduce to one rank (full)": lambda: dist.reduce(full, dst=0, async_op=True),
    }


def _measure(fn, iters: int) -> tuple[float, float, float]:
    issue, total, cpu = [], [], []
    for _ in range(iters):
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        work = fn()
        t1 = time.perf_counter()
        work.wait()
        t2, c2 = time.perf_counter(), time.process_time()
        issue.append(t1 - t0)
        total.append(t2 - t0)
        cpu.append(c2 - c0)
    return statistics.median(issue), statistics.median(total), statistics.median(cpu)


def _worker(rank: int, world_size: int, port: int, numel: int, iters: int, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for name, fn in _cases(numel, world_size).items():
            fn().wait()  # warm up
            issue, total, cpu = _measure(fn, iters)
            if rank == 0:
                print(f"| {name} | {issue * 1e3:.1f} | {total * 1e3:.1f} | {cpu * 1e3:.1f} |", flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.collectives")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--mb", type=float, default=25.0, help="full buffer size in MiB (fp32)")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    numel = int(args.mb * 2**20 / 4)
    print(
        f"gloo, {args.world_size} ranks, {args.mb} MiB fp32 buffer, median of {args.iters}; "
        f"load average {os.getloadavg()[0]:.2f}\n"
    )
    print("| collective | issue (ms) | issue + wait (ms) | process CPU (ms) |\n|---|---|---|---|")
    mp.spawn(
        _worker,
        args=(args.world_size, _free_port(), numel, args.iters, max(1, _cores() // args.world_size)),
        nprocs=args.world_size,
        join=True,
    )


if __name__ == "__main__":
    main()
