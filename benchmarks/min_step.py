"""Fastest step of one variant in fresh ranks: a noise-robust A/B probe for this shared 2-core machine.

    torchrun --nproc_per_node 2 -m benchmarks.min_step --variant zp3 --size blocks34m
    torchrun --nproc_per_node 2 -m benchmarks.min_step --variant ddp --size blocks34m

Other jobs on the machine (and the VM's steal time) only ever slow a step down, by up to ~25% here, so
medians of a few steps move more between runs than the effects worth measuring (3-7%).  This runs
``--steps`` steps (the first 3 untimed) of tuned DDP (``gradient_as_bucket_view=True``,
``broadcast_buffers=False``) or ``zp.setup`` at stage N (``zpN``, ``--set FIELD=VALUE`` for ``ZeroConfig``), and
prints one JSON line from rank 0 with the slowest rank's fastest step (wall and process CPU), the 25th
percentile of CPU, the median minor page faults per step (``ru_minflt``: ~1.4 us each on this VM, machine-load
independent), and the peak RSS above the RSS before the model was built (VmHWM, including setup).
Interleave configurations round by round (a shell loop) and compare their minima; ``--package`` runs another
revision of zero_plugin exported as ``benchmarks/ab.py`` does (``git archive REV zero_plugin``, renamed).
"""

from __future__ import annotations

import argparse
import importlib
import json
import resource
import statistics
import time

import torch
import torch.distributed as dist

from .measure import _reset_hwm, exit_rank
from .models import SIZES, build_model, make_batch
from .step_memory import _status


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="zp3", help="ddp or zpN")
    ap.add_argument("--size", default="blocks34m", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="ZeroConfig fields (zpN)")
    ap.add_argument(
        "--package",
        default="zero_plugin",
        help="import zero_plugin under this name: another revision exported as in benchmarks/ab.py, on PYTHONPATH",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = _status()["VmRSS"]
    _reset_hwm()
    model = build_model(args.size, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if args.variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, gradient_as_bucket_view=True, broadcast_buffers=False)
    else:
        zp = importlib.import_module(args.package)
        fields = {"stage": int(args.variant.removeprefix("zp")), **dict(kv.split("=", 1) for kv in args.set)}
        model, optimizer = zp.setup(model, optimizer, zp.ZeroConfig.from_dict(fields))
    rows = []
    for step in range(args.steps):
        ids = make_batch(SIZES[args.size].vocab, 4, 128, 0, rank, step)
        dist.barrier()
        faults, wall, cpu = _faults(), time.perf_counter(), time.process_time()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        rows.append((time.perf_counter() - wall, time.process_time() - cpu, _faults() - faults))
    timed = rows[3:]
    cpus = sorted(r[1] for r in timed)
    mine = [min(r[0] for r in timed), cpus[0], cpus[len(cpus) // 4], statistics.median(r[2] for r in timed)]
    mine.append(_status()["VmHWM"] - base)
    slowest = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        keys = ("min_wall_s", "min_cpu_s", "p25_cpu_s", "faults_per_step", "peak_rss_increase_MiB")
        print(
            json.dumps(
                {"variant": args.variant, "package": args.package, "set": args.set, **dict(zip(keys, slowest.tolist()))}
            ),
            flush=True,
        )
    dist.destroy_process_group()
    exit_rank()


if __name__ == "__main__":
    main()
