"""The engine's own cost at stages 0-2, this tree against another revision, without the model's compute.

    python -m benchmarks.replicated_overhead --base main --size blocks34m --stages 0 1 2 --rounds 3

The parameters of a benchmark model get a backward whose compute is one multiply per element
(``sum_i (p_i * c).sum()``), so what a step costs beyond it is the engine's: hooks, copies, collectives,
waits, the parameter sync after the step.  Each rank measures process CPU time (all threads, gloo's
included), minor page faults and the torch.distributed calls issued, per phase, for ``zpN`` (this tree),
``zpN_base`` (``--base``, exported as in ``benchmarks.ab``) and tuned DDP, interleaved round by round so
that load from other jobs hits all alike.  CPU time, counts and faults move far less than wall time on
a shared machine.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .ab import PACKAGE, _export
from .models import build_model

PHASES = ("backward", "step", "zero_grad")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CheapLoss(torch.nn.Module):
    """The model's parameters with a forward of one multiply per element."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return sum((p * c).sum() for p in self.model.parameters())


def _setup(name: str, model: torch.nn.Module):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, gradient_as_bucket_view=True, broadcast_buffers=False), opt, None
    package = PACKAGE if name.endswith("_base") else "zero_plugin"
    zp = importlib.import_module(package)
    stage = int(name[2])
    wrapped, zopt = zp.setup(model, opt, zp.ZeroConfig(stage=stage))
    return wrapped, zopt, zp


def _calls(zp) -> int:
    if zp is None:
        return 0
    return sum(importlib.import_module(zp.__name__ + ".comm.collectives").physical_calls().values())


def _run(name: str, size: str, steps: int, warmup: int) -> dict:
    model = CheapLoss(build_model(size, 0))
    wrapped, opt, zp = _setup(name, model)
    c = torch.tensor(1e-3)
    out = {p: [] for p in PHASES}
    faults = {p: [] for p in PHASES}
    calls = {p: [] for p in PHASES}
    for step in range(warmup + steps):
        dist.barrier()
        for phase in PHASES:
            f0, n0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, _calls(zp), time.process_time()
            if phase == "backward":
                wrapped(c).backward()
            elif phase == "step":
                opt.step()
            else:
                opt.zero_grad()
            if step >= warmup:
                out[phase].append(time.process_time() - t0)
                faults[phase].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
                calls[phase].append(_calls(zp) - n0)
    if zp is not None:
        importlib.import_module(zp.__name__ + ".api").engine_of(model, "bench").remove()
    return {"cpu": out, "faults": faults, "calls": calls}


def worker(rank: int, args: argparse.Namespace, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    variants = ["ddp"] + [n for s in args.stages for n in (f"zp{s}_base", f"zp{s}")]
    records = []
    try:
        for rnd in range(args.rounds):
            for name in variants:
                rec = _run(name, args.size, args.steps, args.warmup)
                records.append({"variant": name, "round": rnd, **rec})
                if rank == 0:
                    total = [sum(x) for x in zip(*rec["cpu"].values())]
                    print(f"round {rnd} {name:>9}: CPU {statistics.median(total) * 1e3:.1f} ms/step", flush=True)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


def _summary(records: list[dict], stages: list[int]) -> str:
    by = {}
    for rec in records:
        by.setdefault(rec["variant"], []).append(rec)

    def med(name: str, key: str, phase: str | None = None) -> float:
        vals = []
        for rec in by[name]:
            series = rec[key].values() if phase is None else [rec[key][phase]]
            vals.extend(sum(x) for x in zip(*series))
        return statistics.median(vals)

    lines = ["| variant | CPU ms/step | backward | step | zero_grad | minor faults/step | dist calls/step |"]
    lines.append("|---|---|---|---|---|---|---|")
    for name in by:
        lines.append(
            f"| {name} | {med(name, 'cpu') * 1e3:.1f} | "
            + " | ".join(f"{med(name, 'cpu', p) * 1e3:.1f}" for p in PHASES)
            + f" | {med(name, 'faults'):.0f} | {med(name, 'calls'):.0f} |"
        )
    for s in stages:
        new, base = f"zp{s}", f"zp{s}_base"
        rounds = sorted({r["round"] for r in by[new]})
        paired = []
        for r in rounds:
            n = statistics.median(sum(x) for rec in by[new] if rec["round"] == r for x in zip(*rec["cpu"].values()))
            b = statistics.median(sum(x) for rec in by[base] if rec["round"] == r for x in zip(*rec["cpu"].values()))
            paired.append(n - b)
        lines.append(
            f"\nstage {s}: engine CPU this tree - base, per round (ms/step): {', '.join(f'{x * 1e3:+.1f}' for x in paired)}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.replicated_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True)
    p.add_argument("--size", default="blocks34m")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="zp-ovh-") as tmp:
        _export(args.base, Path(tmp))
        sys.path.insert(0, tmp)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))
        mp.spawn(worker, args=(args, _free_port(), tmp), nprocs=2, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    print(_summary([rec for recs in ranks for rec in recs], args.stages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
