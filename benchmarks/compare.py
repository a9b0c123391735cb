"""Compare zero_plugin with torch DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed in one multi-process run.

    python -m benchmarks.compare --size small --world-size 2
    python -m benchmarks.compare --size smoke --variants ddp zp1 zp2 --profile

The variants run round-robin over ``--rounds`` so that machine noise hits all alike, each (round,
variant) in ``world_size`` freshly spawned gloo ranks.

[Note: fresh ranks per variant]
Variants used to share one set of ranks for the whole run.  The host allocator then carried each
variant's heap into the next: the first variant of a round ran on a fresh heap (DDP 17.7 s in round 0
against 14.5 s in round 1 at 370M) and the others on whatever the one before left, and at 370M the
memory DeepSpeed found already taken got the run OOM-killed.  A user runs one engine per process, so
each variant now gets its own processes (about 5-10 s more per variant and round for the spawn and
imports, untimed), and a variant whose ranks die (the OOM killer) is reported as skipped, with the
reason, instead of ending the run; ``--shared-ranks`` restores the old behaviour.  The report
is printed and written to ``benchmarks/results/<size>-ws<N>.md`` (plus a PNG
when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import socket
import sys
import tempfile
import time
import unittest.mock
from pathlib import Path

import torch
import torch.multiprocessing as mp

from zero_plugin.launch.allocator import preload_environment

from .models import SIZES
from .report import bar_chart, markdown, summarise
from .runner import RunConfig, worker
from .variants import DEFAULT_VARIANTS, VARIANTS

__all__ = ["main"]

RESULTS = Path(__file__).resolve().parent / "results"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=list(SIZES), default="small")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant per round (default 10; smoke 5)")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps first, >= 2 (default 3; smoke 2): the forward right after the first optimizer step "
        "runs 1.6-2x a steady one at 370m (benchmarks/results/ab-host-cost-370m-forward.md)",
    )
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument(
        "--shared-ranks",
        action="store_true",
        help="run every variant in the same ranks instead of fresh ones per variant ([Note: fresh ranks per variant])",
    )
    p.add_argument("--profile", action="store_true", help="time the engine's internal phases (small overhead)")
    p.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="VARIANT=ALLOCATOR",
        help="run VARIANT's ranks with another host allocator preloaded (tcmalloc, jemalloc or a library path, as "
        "zero-plugin launch --allocator): e.g. --preload zp3=tcmalloc beside a ddp on glibc's; repeatable; not "
        "with --shared-ranks",
    )
    p.add_argument("--out", type=Path, default=None, help="report path (default benchmarks/results/<size>-ws<N>.md)")
    p.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="JSON",
        help="only re-render the report from a saved <report>.json (no training)",
    )
    args = p.parse_args(argv)
    quick = args.size == "smoke"  # a quick check: under ~3 minutes on 2 cores
    args.steps = args.steps if args.steps is not None else (5 if quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (2 if quick else 3)
    if args.warmup < 2:
        p.error("--warmup must be >= 2: the forward after the first optimizer step is not a steady one")
    if args.steps < 1 or args.rounds < 1 or args.world_size < 1:
        p.error("--steps, --rounds and --world-size must be >= 1")
    args.preloads = {}
    for item in args.preload:
        name, _, choice = item.partition("=")
        if name not in args.variants or not choice:
            p.error(f"--preload {item!r}: expected VARIANT=ALLOCATOR with VARIANT one of --variants")
        if args.shared_ranks:
            p.error("--preload needs fresh ranks per variant: drop --shared-ranks")
        try:  # =glibc: that variant without the preload the benchmark itself may run under
            args.preloads[name] = preload_environment(choice, os.environ).get("LD_PRELOAD", "")
        except ValueError as exc:
            p.error(f"--preload {item!r}: {exc}")
    return args


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def _header(args: argparse.Namespace, threads: int, rss_method: str, wall: float, load_before: str) -> dict:
    import transformers

    return {
        "size": args.size,
        "world_size": args.world_size,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": f"{_cores()} cores ({platform.machine()}), gloo, {threads} torch thread(s) per rank",
        "workload": f"fp32 AdamW(lr={args.lr}), batch {args.batch} × {args.seq} tokens per rank, "
        f"{args.warmup} warm-up + {args.steps} timed steps × {args.rounds} interleaved rounds",
        "processes": "one set of ranks for every variant (--shared-ranks)"
        if args.shared_ranks
        else "fresh ranks for each variant and round (no heap carried over)",
        "peak RSS method": rss_method,
        "host allocator": _allocators(args),
        "wall time": f"{wall:.0f} s",
        "load average (1/5/15 min) before / after": f"{load_before}  /  {_load()} (> {args.world_size} means "
        "other jobs shared the cores: trust CPU s more than step s)",
    }


def _allocators(args: argparse.Namespace) -> str:
    default = os.environ.get("LD_PRELOAD") or "glibc"
    preloaded = "; ".join(f"{name}: {lib or 'glibc'}" for name, lib in args.preloads.items())
    return default + (f" except {preloaded} (LD_PRELOAD, --preload)" if preloaded else "")


def _preloaded(library: str | None) -> contextlib.AbstractContextManager:
    """``LD_PRELOAD=library`` for the ranks spawned inside (spawned ranks are fresh interpreters)."""
    if library is None:
        return contextlib.nullcontext()
    return unittest.mock.patch.dict(os.environ, {"LD_PRELOAD": library})


def _run(args: argparse.Namespace, variants: list[str]) -> dict:
    """Spawn the ranks; returns what the report is made from (also saved as JSON)."""
    threads = max(1, _cores() // args.world_size)
    if any(v.startswith("ds") for v in variants):
        # read by deepspeed at its first import, in the spawned ranks (which inherit it)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory(prefix="zp-bench-") as tmp:
        cfg = RunConfig(
            size=args.size,
            world_size=args.world_size,
            variants=tuple(variants),
            steps=args.steps,
            warmup=args.warmup,
            rounds=args.rounds,
            batch=args.batch,
            seq=args.seq,
            seed=args.seed,
            lr=args.lr,
            threads=threads,
            port=_free_port(),
            out_dir=tmp,
            profile=args.profile,
        )
        load_before, t0 = _load(), time.perf_counter()
        if args.shared_ranks:
            spawns = [cfg]
        else:  # [Note: fresh ranks per variant]
            spawns = [
                dataclasses.replace(
                    cfg, variants=(name,), rounds=1, first_round=rnd, tag=f"-{rnd}-{name}", port=_free_port()
                )
                for rnd in range(args.rounds)
                for name in variants
            ]
        dumps, died = [], {}
        for spawn in spawns:
            if died.keys() & set(spawn.variants):
                continue  # it died in an earlier round: it would again
            try:
                with _preloaded(args.preloads.get(spawn.variants[0])):  # empty under --shared-ranks
                    mp.spawn(worker, args=(spawn,), nprocs=args.world_size, join=True)
            except mp.ProcessExitedException as exc:
                if args.shared_ranks:
                    raise
                # [Note: fresh ranks per variant]: one variant's death (the OOM killer) costs only its row
                died[spawn.variants[0]] = _death(exc)
                print(f"[bench] {spawn.variants[0]}: {died[spawn.variants[0]]}", flush=True)
                continue
            dumps += [json.loads(Path(tmp, f"rank{r}{spawn.tag}.json").read_text()) for r in range(args.world_size)]
        wall = time.perf_counter() - t0
    records = [rec for d in dumps for rec in d["records"]]
    records += [{"variant": name, "round": 0, "rank": 0, "skipped": why} for name, why in died.items()]
    rss_method = dumps[0]["rss_method"] if dumps else "none"
    return {
        "variants": variants,
        "world_size": args.world_size,
        "header": _header(args, threads, rss_method, wall, load_before),
        "records": records,
    }


def _death(exc: mp.ProcessExitedException) -> str:
    """Why a variant's ranks died, for its row of the report."""
    signal_name = getattr(exc, "signal_name", None)
    if signal_name == "SIGKILL":
        return (
            f"rank {exc.error_index} was killed (SIGKILL, most likely from the kernel's OOM killer: see `dmesg`); "
            "the variant probably does not fit in host memory at this size"
        )
    return f"rank {exc.error_index} exited abnormally ({signal_name or f'exit code {exc.exit_code}'})"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.render is not None:
        out = args.out or args.render.with_suffix(".md")
        raw = json.loads(args.render.read_text())
    else:
        out = args.out or RESULTS / f"{args.size}-ws{args.world_size}.md"
        raw = _run(args, list(dict.fromkeys(args.variants)))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(raw))
    rows, skipped = summarise(raw["records"], raw["variants"], raw["world_size"])
    text = markdown(rows, skipped, raw["header"])
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    png = bar_chart(rows, out.with_suffix(".png")) if rows else None
    print(f"wrote {out}" + (f" and {png}" if png else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
