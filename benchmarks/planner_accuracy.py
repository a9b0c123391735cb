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


def engine_fingerprint() -> str:
    """sha256 (12 hex) of the engine's sources: measurements of different engines must not be mixed."""
    import hashlib

    root = Path(__file__).resolve().parent.parent / "zero_plugin"
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] != "planner" and path.name != "cli.py":
            digest.update(path.relative_to(root).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=1,
        intermediate_size=128,
        vocab_size=256,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        use_cache=False,
    )
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
        record = {
            "rank": rank,
            "baseline": baseline,
            "after_setup": after_setup,
            "first_step": first,
            "peak": max(first, steady),
            "later_steps": steady,
            "rss_method": RssPeak.method,
            "step_cpu_s": sorted(cpu)[len(cpu) // 2] if cpu else None,
            "theory": report["theory"]["total"],
            "measured_states": report["measured"]["total"],
        }
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
    os.environ.update(ALLOCATOR_ENV[job["allocator"]])  # spawned ranks read it when they start
    try:
        mp.start_processes(
            _rank_main,
            args=(job["world_size"], _free_port(), job, str(out_dir)),
            nprocs=job["world_size"],
            start_method="spawn",
            join=True,
        )
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
        planner_cache[key] = Planner(
            meta,
            batch=job["batch"],
            seq=job["seq"],
            device="cpu",
            config=ZeroConfig(**{k: v for k, v in job["config"].items() if k != "stage"}),
        )
    cfg = job["config"]
    return planner_cache[key].estimate(
        job["world_size"],
        cfg["stage"],
        offload=cfg.get("offload_optimizer", "none"),
        offload_params=cfg.get("offload_params", False),
    )


def _jobs(args: argparse.Namespace) -> list[dict]:
    jobs = []
    allocators = ["exact", "default"] if args.allocator == "both" else [args.allocator]
    for size in args.sizes:
        for world in args.world_sizes:
            for stage in args.stages:
                configs = [{"stage": stage}] + (
                    [{"stage": stage, "offload_optimizer": "cpu"}] if args.offload and stage >= 1 else []
                )
                for config in configs:
                    for allocator in allocators:
                        jobs.append(
                            {
                                "size": size,
                                "world_size": world,
                                "batch": args.batch,
                                "seq": args.seq,
                                "steps": args.steps,
                                "config": config,
                                "allocator": allocator,
                            }
                        )
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
    p.add_argument(
        "--allocator", choices=["exact", "default", "both"], default="both", help="see [Note: allocator modes]"
    )
    p.add_argument("--out", type=Path, default=RESULTS / "planner.md")
    p.add_argument(
        "--render",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="only re-render saved measurements (predictions are recomputed with the current planner)",
    )
    args = p.parse_args(argv)
    if args.render is not None:
        runs = [json.loads(path.read_text()) for path in args.render]
        data = {
            "runs": [
                h for run in runs for h in run.get("runs") or [{k: v for k, v in run.items() if k != "measurements"}]
            ],
            "measurements": [m for run in runs for m in run["measurements"]],
        }
        if args.out.suffix == ".md":
            args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    else:
        run = _run(args)
        args.out.with_suffix(".json").write_text(json.dumps(run, indent=1))
        data = {"runs": [{k: v for k, v in run.items() if k != "measurements"}], "measurements": run["measurements"]}
    text = render(data)
    args.out.write_text(text)
    print(text)
    return 0


def _run(args: argparse.Namespace) -> dict:
    data = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "measurements": [],
        "load_before": os.getloadavg(),
        "argv": sys.argv[1:],
    }
    cache: dict = {}
    scratch = Path(os.environ.get("TMPDIR", "/tmp"), f"planner-accuracy-{os.getpid()}")
    for job in _jobs(args):
        t0 = time.perf_counter()
        engine = engine_fingerprint()
        ranks = measure(job, scratch)
        if engine_fingerprint() != engine:
            print(f"[planner] the engine changed during {job}: measurement dropped", flush=True)
            continue
        data["measurements"].append({"job": job, "ranks": ranks, "engine": engine})
        predicted = predict(job, cache)["peak"]["total"]
        print(
            f"[planner] {job['size']:>6} {job['allocator']:>7} {job['config']} N={job['world_size']}: predicted "
            f"{predicted / _MIB:8.1f} MiB, measured {ranks[0]['peak'] / _MIB:8.1f} MiB "
            f"({predicted / ranks[0]['peak'] - 1:+.1%}) in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    data["load_after"] = os.getloadavg()
    return data


def render(data: dict) -> str:
    """Markdown: the planner (recomputed now) against each allocator mode's measurements."""
    cache: dict = {}
    rows = []
    for m in data["measurements"]:
        pred = predict(m["job"], cache)
        rows.append(
            {**m, "pred": pred, "measured": m["ranks"][0]["peak"], "measured_max": max(r["peak"] for r in m["ranks"])}
        )
    engines = sorted({r.get("engine", "?") for r in rows})
    lines = ["# Memory planner against measured peak RSS", ""]
    for run in data["runs"]:
        load = " / ".join(f"{x:.1f}" for x in run.get("load_before", [])) or "?"
        lines.append(
            f"- {run.get('started', '?')}: `python -m benchmarks.planner_accuracy "
            f"{' '.join(run.get('argv', []))}`, load average before {load} ({os.cpu_count()} cores)"
        )
    lines += [
        "",
        f"Engine sources measured: {', '.join(engines)} (sha256 of `zero_plugin/` without the planner); "
        f"the planner replays {engine_fingerprint()}"
        + ("." if engines == [engine_fingerprint()] else ": DIFFERENT, re-measure."),
        "",
        _ABOUT,
        "",
    ]
    for allocator in ("exact", "default"):
        chosen = [r for r in rows if r["job"]["allocator"] == allocator]
        if chosen:
            lines += [f"## Allocator: {allocator}", ""] + _table(allocator, chosen) + [""]
    return "\n".join(lines + [_cpu_cost(rows), "", _slack_summary(rows), "", _FINDINGS])


def _pairs(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """Rows of the same configuration, by allocator."""
    out: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["job"]["size"], r["job"]["world_size"], json.dumps(r["job"]["config"], sort_keys=True))
        out.setdefault(key, {})[r["job"]["allocator"]] = r
    return out


def _slack_summary(rows: list[dict]) -> str:
    """Default-allocator RSS above the exact one, in activation peaks, per model size; spread over ranks."""
    by_size: dict[str, list[float]] = {}
    spread: dict[str, list[float]] = {"exact": [], "default": []}
    for (size, _, _), pair in _pairs(rows).items():
        if "exact" in pair and "default" in pair:
            acts = pair["exact"]["pred"]["activations"]["peak"]
            by_size.setdefault(size, []).append((pair["default"]["measured"] - pair["exact"]["measured"]) / acts)
            for allocator in spread:
                peaks = [r["peak"] for r in pair[allocator]["ranks"]]
                spread[allocator].append(max(peaks) / min(peaks) - 1)
    if not by_size:
        return ""
    sizes = "; ".join(f"{size} {min(v):.2f}-{max(v):.2f}" for size, v in by_size.items())
    return (
        f"Default-allocator RSS above the exact allocator's, in activation peaks of the same run: {sizes}. "
        f"The ranks of one run differ in peak RSS by up to {max(spread['default']):.0%} with the default "
        f"allocator, {max(spread['exact']):.1%} with the exact one."
    )


def _cpu_cost(rows: list[dict]) -> str:
    """Median ratio of step CPU time, exact over default allocator, over the configurations run in both."""
    cpu = {k: {a: r["ranks"][0].get("step_cpu_s") for a, r in v.items()} for k, v in _pairs(rows).items()}
    ratios = sorted(v["exact"] / v["default"] for v in cpu.values() if v.get("exact") and v.get("default"))
    if not ratios:
        return ""
    return (
        f"Step CPU time with the exact allocator over the default: median {ratios[len(ratios) // 2]:.2f}x "
        f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}x over {len(ratios)} configurations; every freed block "
        "goes back to the kernel and every new one is page-faulted in again)."
    )


_ABOUT = """\
Each row is one fresh set of N gloo processes (one thread each) training the random-init Llama of
`benchmarks/models.py` (fp32, AdamW, batch 4 x 128 tokens per rank, 4 steps), measured as described
in `benchmarks/planner_accuracy.py`: VmHWM minus the RSS before the model was built, with the
high-water mark reset after `zp.setup` (so the setup's own transient is not the peak measured).
*predicted* is `zero_plugin.planner` for the same model, batch, stage and world size on device
"cpu", recomputed when this file is rendered; *error* = predicted / measured - 1 on rank 0 (the rank
the planner models: it owns the largest shards); *phase* and the last columns say where the
predicted peak falls and what is alive then (params+optim: persistent states; grads: full or
sharded gradients alive; buffers: gathered units, bucket/unit collective buffers, gloo temporaries,
optimizer temporaries; acts: activations).  *step CPU s*: median process CPU seconds of steps 2-4.

Two allocator modes ([Note: allocator modes] in the script):
- **exact**: `MALLOC_MMAP_THRESHOLD_=131072 MKL_DISABLE_FAST_MM=1`. Every block of 128 KiB or more is
  its own mapping, returned to the kernel when freed, and MKL keeps no gemm buffer cache, so RSS follows
  the bytes of live tensors. This checks the planner's accounting; the 10% bar applies here.
- **default**: glibc and MKL as a user gets them, compared with `rss_glibc` = the live peak plus the
  documented slack term (one activation peak, [Note: glibc slack] in `zero_plugin/planner/plan.py`)."""

_FINDINGS = """\
## What the measurements taught the planner

- **In-place collectives on gloo** ([Note: in-place region gather] in `zero_plugin/comm/collectives.py`): the
  stage 1-2 parameter sync after the step and every stage-3 unit gather broadcast each rank's region
  straight into the parameters, and gradients are summed in place, so on CPU there are no bucket or
  gather buffers left to count (the table's *buffers* column at stages 1-2 is 0; at stage 3 it is the
  gathered units). Before that engine change stage 1 peaked at the parameter all-gather after the
  step (the full gradients with up to three buckets' all-gather buffers and gloo's temporary of the
  output's size); the planner still replays that buffered layout for NCCL (device "cuda") and for
  `ZERO_PLUGIN_BUFFERED_COLLECTIVES=1`.
- **gloo temporaries** (2 and 4 ranks, torch 2.13, 32 MiB tensors): `all_gather_into_tensor` adds the
  output's size to the peak RSS and `reduce_scatter_tensor` the input's; `all_reduce` and `broadcast`,
  the only collectives the in-place layout issues, add nothing.
- **Pages count when written**: a tensor from `torch.empty` becomes resident when written, so on CPU a
  buffer counts at its first write, on CUDA at its allocation.
- **What stays gathered at stage 3**: the root unit for the whole step and the last unit of the
  forward order (the LM head) from its forward through its backward ([Note: last unit kept]).
- **Where the peak falls**: at the start of backward (logits, log-softmax and its gradient) for most
  rows; for the 120M model at stages 0-1 in the optimizer step, where the full gradients meet the
  for-loop AdamW's temporaries (two parameter-sized tensors of the largest parameter).
- **Allocator slack** (default mode): glibc's mmap threshold rises to the largest block freed (up to
  32 MiB); from then on activation- and bucket-sized blocks come from the heap, which does not shrink
  below blocks allocated later. MKL keeps its gemm packing buffers and every gloo thread its own
  arena. The excess over live bytes (summary above) is 0.3-0.9 activation peaks at stages 0-2 and
  smaller at stage 3, whose hooks trim the heap after each unit's reshard on CPU ([Note: heap
  trimming] in `zero_plugin/engines/hostmem.py`); it differs between the ranks of one run. `rss_glibc` (live
  peak + one activation peak) is an upper estimate for it, loose at stage 3; the 10% bar applies to
  the exact allocator, and a CPU run that must match the plan can set `MALLOC_MMAP_THRESHOLD_=131072`
  at the CPU cost above."""


def _stage_name(job: dict) -> str:
    return f"{job['config']['stage']}" + (" +offload" if job["config"].get("offload_optimizer") == "cpu" else "")


def _table(allocator: str, rows: list[dict]) -> list[str]:
    """One allocator's runs.  exact: against ``peak.total``; default: against ``rss_glibc`` (the live
    peak plus the documented slack term, see [Note: glibc slack] in zero_plugin/planner/plan.py)."""
    key = "rss_glibc" if allocator == "default" else "total"
    head = "predicted + slack MiB" if allocator == "default" else "predicted MiB"
    lines = [
        f"Compared with `{key}`.",
        "",
        f"| size | Ψ | stage | N | {head} | measured MiB, rank 0 / max | error | live peak MiB | phase | "
        "params+optim | grads | buffers | acts | step CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    errors = []
    for r in rows:
        job, pred = r["job"], r["pred"]
        at, predicted = pred["at_peak"], pred["peak"][key] if key == "total" else pred[key]
        errors.append(predicted / r["measured"] - 1)
        cpu = r["ranks"][0].get("step_cpu_s")
        lines.append(
            f"| {job['size']} | {pred['params']['total'] / 1e6:.1f}M | {_stage_name(job)} | "
            f"{job['world_size']} | {predicted / _MIB:.1f} | {r['measured'] / _MIB:.1f} / "
            f"{r['measured_max'] / _MIB:.1f} | {errors[-1]:+.1%} | {pred['peak']['total'] / _MIB:.1f} | "
            f"{pred['peak']['phase']} | {(at['params'] + at['optimizer']) / _MIB:.1f} | "
            f"{at['grads'] / _MIB:.1f} | {at['transient']['total'] / _MIB:.1f} | "
            f"{at['activations'] / _MIB:.1f} | {'-' if cpu is None else f'{cpu:.2f}'} |"
        )
    worst = max(errors, key=abs)
    lines += [
        "",
        f"{len(rows)} runs; error = predicted / measured - 1: worst {worst:+.1%}, mean |error| "
        f"{sum(abs(e) for e in errors) / len(errors):.1%}",
    ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
