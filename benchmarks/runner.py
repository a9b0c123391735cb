"""What each spawned rank runs: the variants it is given, round-robin over rounds, measured alike.

``benchmarks.compare`` spawns fresh ranks for every (round, variant) by default, so no variant inherits
another's heap ([Note: fresh ranks per variant] in ``compare.py``); DDP's final parameters then reach the
other variants of its round through ``ref-round<N>.pt`` in the run's folder.

Per variant and round: free memory, reset the RSS high-water mark, build a
fresh model from the seed, wrap it, run warm-up then timed steps on
pre-generated batches, and record phase times, model-state bytes (after the
first timed backward, before its step; untimed), minor page faults per
phase, logical communication of the timed steps, peak RSS increase and the
parameters' distance to DDP's at the end of the same round.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .measure import RssPeak, release_memory, state_bytes
from .models import SIZES, build_model, make_batch
from .variants import SkipVariant, make_variant

__all__ = ["RunConfig", "worker"]

PHASES = ("forward", "backward", "step", "zero_grad")


@dataclass(frozen=True)
class RunConfig:
    size: str
    world_size: int
    variants: tuple[str, ...]
    steps: int
    warmup: int
    rounds: int
    batch: int
    seq: int
    seed: int
    lr: float
    threads: int
    port: int
    out_dir: str
    profile: bool
    first_round: int = 0  # the rounds run are first_round .. first_round + rounds - 1
    tag: str = ""  # distinguishes the rank files of one spawn from another's in out_dir


def worker(rank: int, cfg: RunConfig) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg.port))
    torch.set_num_threads(cfg.threads)
    dist.init_process_group("gloo", rank=rank, world_size=cfg.world_size)
    try:
        records, skipped = [], {}
        for rnd in range(cfg.first_round, cfg.first_round + cfg.rounds):
            ref = None
            for name in cfg.variants:
                if name in skipped:
                    continue
                rec, ref = _run_variant(name, rnd, cfg, rank, ref)
                if rec.get("skipped"):
                    skipped[name] = rec["skipped"]
                records.append(rec)
                if rank == 0:
                    _progress(rec)
        Path(cfg.out_dir, f"rank{rank}{cfg.tag}.json").write_text(
            json.dumps({"rss_method": RssPeak.method, "records": records})
        )
    finally:
        dist.destroy_process_group()


def _progress(rec: dict) -> None:
    if rec.get("skipped"):
        print(f"[bench] {rec['variant']}: skipped ({rec['skipped']})", flush=True)
        return
    totals = sorted(rec["times"]["total"])
    print(
        f"[bench] round {rec['round']} {rec['variant']:>16}: median step {totals[len(totals) // 2]:.3f} s, "
        f"loss {rec['loss_first']:.4f} -> {rec['loss_last']:.4f}",
        flush=True,
    )


def _run_variant(name: str, rnd: int, cfg: RunConfig, rank: int, ref):
    vocab = SIZES[cfg.size].vocab
    batches = [make_batch(vocab, cfg.batch, cfg.seq, cfg.seed, rank, s) for s in range(cfg.warmup + cfg.steps)]
    release_memory()
    dist.barrier()
    rss = RssPeak()
    rss.start()
    raw = build_model(cfg.size, cfg.seed)
    psi = sum(p.numel() for p in raw.parameters())
    try:
        variant = make_variant(name, raw, cfg.lr, cfg.batch)
    except SkipVariant as exc:
        rss.stop()
        return {"variant": name, "round": rnd, "rank": rank, "skipped": str(exc)}, ref
    profiler = _profiler(variant) if cfg.profile else None
    rec = {"variant": name, "round": rnd, "rank": rank, "psi": psi, "theory_stage": variant.theory_stage}
    if profiler is not None:
        rec["rss_setup"] = rss.checkpoint()
    rec.update(_train(variant, batches, cfg, profiler, rss if profiler is not None else None))
    rec["rss_delta"] = rss.stop()
    if profiler is not None:
        rec["profile"] = profiler.per_step(cfg.steps)
    ref = _compare_to_ddp(name, variant, cfg, rec, ref if ref is not None else _saved_ref(cfg, rnd))
    if name == "ddp" and rank == 0 and cfg.variants == ("ddp",):
        torch.save(ref, _ref_path(cfg, rnd))  # a spawn of its own: the round's other variants run in later spawns
    variant.teardown()
    del variant, raw
    release_memory()
    return rec, ref


def _profiler(variant):
    from .profile import PhaseProfiler

    return PhaseProfiler(variant)


def _train(variant, batches: list[torch.Tensor], cfg: RunConfig, profiler, rss: RssPeak | None) -> dict:
    times: dict[str, list[float]] = defaultdict(list)
    losses, state = [], {}
    with variant.counting():
        for step, ids in enumerate(batches):
            if step == cfg.warmup:
                dist.barrier()
                variant.reset_comm()
                if profiler is not None:
                    profiler.reset()
            measure = step == cfg.warmup  # >= 1 step done: optimizer state exists
            durations, loss, state_now = _one_step(variant, ids, measure, rss)
            state = state_now if measure else state
            losses.append(loss)
            if step >= cfg.warmup:
                for k, d in durations.items():
                    times[k].append(d)
        comm = variant.comm()
    return {
        "times": times,
        "state": state,
        "comm": {k: v / cfg.steps for k, v in comm.items()},
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def _faults() -> int:
    """Minor page faults of this process so far, all threads (``ru_minflt``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _one_step(variant, ids: torch.Tensor, measure: bool, rss: RssPeak | None) -> tuple[dict[str, float], float, dict]:
    """forward, backward, step, zero_grad, each timed in wall and process-CPU seconds, and the minor page
    faults each took (``faults_<phase>``, ``faults``).

    CPU time counts all threads of this process (gloo's included); unlike wall time it barely
    moves when other jobs share the cores.  A page fault is the kernel handing the process a fresh page,
    mostly memory the allocator took from the OS for this step (a buffer allocated afresh rather than
    reused): a count that the machine's load does not move.  Model states are measured, untimed, before
    the step.  With ``rss`` (--profile), ``rss_<phase>`` is the phase's peak RSS above the variant's baseline.
    """
    box: dict = {}
    actions = {
        "forward": lambda: box.setdefault("loss", variant.loss(ids)),
        "backward": lambda: variant.backward(box["loss"]),
        "step": variant.step,
        "zero_grad": variant.zero_grad,
    }
    out, state = {}, {}
    for phase in PHASES:
        if phase == "step" and measure:
            state = _measure_state(variant)
        f0, c0, t0 = _faults(), time.process_time(), time.perf_counter()
        actions[phase]()
        out[phase], out[f"cpu_{phase}"] = time.perf_counter() - t0, time.process_time() - c0
        out[f"faults_{phase}"] = _faults() - f0
        if rss is not None:
            out[f"rss_{phase}"] = rss.checkpoint()
    out["total"] = sum(out[p] for p in PHASES)
    out["cpu"] = sum(out[f"cpu_{p}"] for p in PHASES)
    out["faults"] = sum(out[f"faults_{p}"] for p in PHASES)
    return out, float(box["loss"].detach()), state


def _measure_state(variant) -> dict:
    out = state_bytes(variant.state_groups())
    reported = getattr(variant, "reported_state_bytes", None)
    if reported is not None:
        out["zp_reported_total"] = reported()
    return out


def _ref_path(cfg: RunConfig, rnd: int) -> Path:
    return Path(cfg.out_dir, f"ref-round{rnd}.pt")


def _saved_ref(cfg: RunConfig, rnd: int):
    """DDP's (final parameters, update norm) of this round when another spawn saved them; mapped, not read in."""
    path = _ref_path(cfg, rnd)
    return torch.load(path, mmap=True) if path.exists() else None


def _compare_to_ddp(name: str, variant, cfg: RunConfig, rec: dict, ref):
    params = variant.full_params()
    if name == "ddp":
        theta0 = dict(build_model(cfg.size, cfg.seed).named_parameters())
        norm = math.sqrt(sum(float((params[n] - theta0[n].detach()).double().pow(2).sum()) for n in params))
        rec["max_abs_diff"], rec["rel_update_diff"] = 0.0, 0.0
        return params, norm
    if ref is None:
        return ref
    ref_params, ref_norm = ref
    diffs = [(params[n] - ref_params[n]) for n in ref_params]
    rec["max_abs_diff"] = max(float(d.abs().max()) for d in diffs)
    rec["rel_update_diff"] = math.sqrt(sum(float(d.double().pow(2).sum()) for d in diffs)) / max(ref_norm, 1e-30)
    return ref
