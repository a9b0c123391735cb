"""Planner accuracy: predicted peak per-rank memory against the peak RSS increase of real CPU runs.

    python -m benchmarks.planner_accuracy                                   # smoke + small, stages 0-3, N 2 and 4
    python -m benchmarks.planner_accuracy --sizes smoke --stages 0 3 --world-sizes 2
    python -m benchmarks.planner_accuracy --render benchmarks/results/planner.json

Every measurement is a fresh set of ``N`` spawned gloo processes (one thread each), so nothing one
configuration leaves in the heap reaches the next.  Each rank:
  1. warms up: one zero_plugin step of a tiny model of the same architecture and stage, so that code
     pages and gloo's buffers are resident before the baseline (they are not model memory);
  2. frees memory (``gc`` + ``malloc_trim``) and samples the baseline RSS;
  3. builds the benchmark model (fp32, ``benchmarks/models.py``), ``zp.setup``, frees again and resets
     the kernel's high-water mark (``/proc/self/clear_refs``, see ``measure.py``), so the setup's own
     transient (the full fp32 model a stage-3 setup shards) is not what is measured;
  4. runs ``--steps`` training steps (forward, backward, AdamW step, zero_grad);
  5. reports VmHWM - baseline.
The prediction is ``zero_plugin.planner`` for the same model, batch, stage and world size on device
"cpu" (``peak.total``: on a CPU-only machine host and device are one memory), plus the allocator
slack term fitted on these runs (see the report).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from .measure import RssPeak, release_memory
from .models import SIZES, build_model, make_batch

__all__ = ["main", "measure", "predict"]

RESULTS = Path(__file__).resolve().parent / "results"
_MIB = 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=1, intermediate_size=128, vocab_size=256,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(cfg).float().train()


def _train(model, optimizer, vocab: int, job: dict, rank: int, steps: int) -> list[float]:
    """Training steps; returns each step's process CPU seconds (steadier than wall time on a shared machine)."""
    cpu = []
    for step in range(steps):
        ids = make_batch(vocab, job["batch"], job["seq"], 0, rank, step)
        t0 = time.process_time()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        cpu.append(time.process_time() - t0)
    return cpu


def _setup(model, job: dict):
    import zero_plugin as zp

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return zp.setup(model, optimizer, zp.ZeroConfig(**job["config"]))


def _rank_main(rank: int, world: int, port: int, job: dict, out_dir: str) -> None:
    import torch.distributed as dist
    import zero_plugin as zp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        warm, warm_opt = _setup(_tiny_llama(), job)
        _train(warm, warm_opt, 256, job, rank, 2)
        del warm, warm_opt
        release_memory()
        dist.barrier()
        baseline = _rss()
        model = build_model(job["size"], 0)
        model, optimizer = _setup(model, job)
        release_memory()
        after_setup = _rss() - baseline
        peak = RssPeak()
        peak.start()
        _train(model, optimizer, SIZES[job["size"]].vocab, job, rank, 1)
        first = peak.checkpoint() + after_setup
        cpu = _train(model, optimizer, SIZES[job["size"]].vocab, job, rank, job["steps"] - 1)
        steady = peak.stop() + after_setup
        report = zp.memory_report(model, optimizer)
        record = {"rank": rank, "baseline": baseline, "after_setup": after_setup, "first_step": first,
                  "peak": max(first, steady), "later_steps": steady, "rss_method": RssPeak.method,
                  "step_cpu_s": sorted(cpu)[len(cpu) // 2] if cpu else None,
                  "theory": report["theory"]["total"], "measured_states": report["measured"]["total"]}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# [Note: allocator modes]
# "exact": glibc with a fixed mmap threshold (every block >= 128 KiB is its own mapping, returned to the
# kernel when freed) and MKL's buffer cache off, so RSS follows the bytes of live tensors: this checks
# the planner's accounting.  "default": the allocators as a user gets them; glibc's dynamic mmap
# threshold rises to the largest freed block (up to 32 MiB), so activation-sized blocks come from the
# heap and their freed space stays resident, and MKL keeps gemm packing buffers (see planner.md).
ALLOCATOR_ENV = {
    "exact": {"MALLOC_MMAP_THRESHOLD_": "131072", "MKL_DISABLE_FAST_MM": "1"},
    "default": {},
}


def measure(job: dict, out_dir: Path) -> list[dict]:
    """Peak RSS increase on each rank of one fresh ``job['world_size']``-process run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("rank*.json"):
        stale.unlink()
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", *ALLOCATOR_ENV["exact"])}
    os.environ["OMP_NUM_THREADS"] = "1"
    for k in ALLOCATOR_ENV["exact"]:
        os.environ.pop(k, None)
    os.environ.update(ALLOCATOR_ENV[job["allocator"]])   # spawned ranks read it when they start
    try:
        mp.start_processes(_rank_main, args=(job["world_size"], _free_port(), job, str(out_dir)),
                           nprocs=job["world_size"], start_method="spawn", join=True)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(job["world_size"])]


def predict(job: dict, planner_cache: dict) -> dict:
    from zero_plugin.config import ZeroConfig
    from zero_plugin.planner import Planner

    key = (job["size"], job["batch"], job["seq"])
    if key not in planner_cache:
        with torch.device("meta"):
            meta = build_model(job["size"], 0)
        planner_cache[key] = Planner(meta, batch=job["batch"], seq=job["seq"], device="cpu",
                                     config=ZeroConfig(**{k: v for k, v in job["config"].items() if k != "stage"}))
    cfg = job["config"]
    return planner_cache[key].estimate(job["world_size"], cfg["stage"], offload=cfg.get("offload_optimizer", "none"),
                                       offload_params=cfg.get("offload_params", False))


def _jobs(args: argparse.Namespace) -> list[dict]:
    jobs = []
    allocators = ["exact", "default"] if args.allocator == "both" else [args.allocator]
    for size in args.sizes:
        for world in args.world_sizes:
            for stage in args.stages:
                configs = [{"stage": stage}] + ([{"stage": stage, "offload_optimizer": "cpu"}]
                                                if args.offload and stage >= 1 else [])
                for config in configs:
                    for allocator in allocators:
                        jobs.append({"size": size, "world_size": world, "batch": args.batch, "seq": args.seq,
                                     "steps": args.steps, "config": config, "allocator": allocator})
    return jobs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner_accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["smoke", "small"])
    p.add_argument("--stages", nargs="+", type=int, choices=[0, 1, 2, 3], default=[0, 1, 2, 3])
    p.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    p.add_argument("--offload", action="store_true", help="also run stages 1-3 with offload_optimizer='cpu'")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="training steps measured (glibc's heap settles by the 3rd)")
    p.add_argument("--allocator", choices=["exact", "default", "both"], default="both",
                   help="see [Note: allocator modes]")
    p.add_argument("--out", type=Path, default=RESULTS / "planner.md")
    p.add_argument("--render", type=Path, nargs="+", default=None, metavar="JSON",
                   help="only re-render saved measurements (predictions are recomputed with the current planner)")
    args = p.parse_args(argv)
    if args.render is not None:
        runs = [json.loads(path.read_text()) for path in args.render]
        data = {**runs[0], "measurements": [m for run in runs for m in run["measurements"]]}
    else:
        data = _run(args)
        args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    text = render(data)
    args.out.write_text(text)
    print(text)
    return 0


def _run(args: argparse.Namespace) -> dict:
    data = {"started": datetime.datetime.now().isoformat(timespec="seconds"), "measurements": [],
            "load_before": os.getloadavg(), "argv": sys.argv[1:]}
    cache: dict = {}
    scratch = Path(os.environ.get("TMPDIR", "/tmp"), f"planner-accuracy-{os.getpid()}")
    for job in _jobs(args):
        t0 = time.perf_counter()
        ranks = measure(job, scratch)
        data["measurements"].append({"job": job, "ranks": ranks})
        predicted = predict(job, cache)["peak"]["total"]
        print(f"[planner] {job['size']:>6} {job['allocator']:>7} {job['config']} N={job['world_size']}: predicted "
              f"{predicted / _MIB:8.1f} MiB, measured {ranks[0]['peak'] / _MIB:8.1f} MiB "
              f"({predicted / ranks[0]['peak'] - 1:+.1%}) in {time.perf_counter() - t0:.0f} s", flush=True)
    data["load_after"] = os.getloadavg()
    return data


def render(data: dict) -> str:
    """Markdown tables: the planner against the exact and the default allocators."""
    cache: dict = {}
    rows = []
    for m in data["measurements"]:
        pred = predict(m["job"], cache)
        rows.append({**m, "pred": pred, "measured": m["ranks"][0]["peak"],
                     "measured_max": max(r["peak"] for r in m["ranks"])})
    lines = []
    for allocator in ("exact", "default"):
        chosen = [r for r in rows if r["job"]["allocator"] == allocator]
        if chosen:
            lines += _table(allocator, chosen) + [""]
    return "\n".join(lines)


def _stage_name(job: dict) -> str:
    return f"{job['config']['stage']}" + (" +offload" if job["config"].get("offload_optimizer") == "cpu" else "")


def _table(allocator: str, rows: list[dict]) -> list[str]:
    lines = [f"allocator: {allocator}", "",
             "| size | Ψ | stage | N | predicted MiB | measured MiB, rank 0 / max | error | phase of peak | "
             "params+optim | grads | buffers | acts |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        job, pred = r["job"], r["pred"]
        at = pred["at_peak"]
        error = pred["peak"]["total"] / r["measured"] - 1
        lines.append(f"| {job['size']} | {pred['params']['total'] / 1e6:.1f}M | {_stage_name(job)} | "
                     f"{job['world_size']} | {pred['peak']['total'] / _MIB:.1f} | {r['measured'] / _MIB:.1f} / "
                     f"{r['measured_max'] / _MIB:.1f} | {error:+.1%} | {pred['peak']['phase']} | "
                     f"{(at['params'] + at['optimizer']) / _MIB:.1f} | {at['grads'] / _MIB:.1f} | "
                     f"{at['transient']['total'] / _MIB:.1f} | {at['activations'] / _MIB:.1f} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
