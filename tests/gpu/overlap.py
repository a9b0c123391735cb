"""Stage-3 overlap on a real CUDA device, for a host-bound model ([Note: side streams] in zero_plugin/comm/streams.py).

On a GPU a model of small layers is host-bound: a step lasts as long as the host takes to issue its kernels
(issue #39: zero_plugin and FSDP2 both are).  A collective's wire time is hidden when the host keeps issuing
compute while it runs, which needs the collective on a side stream and no host wait for it before its
result is used.  World size 1 over NCCL: a unit's "all-gather" is a device copy, far too short to see, so
every collective the engine issues, through every ``Comm`` it uses (the gathers' group and the reductions'
own one, [Note: reductions on their own group] in stage3/hooks.py: a different ``Comm`` above world size
1), is preceded by ``torch.cuda._sleep`` on the issuing stream, standing in for wire time.

Measured per phase, forward and backward (with the optimizer step), from host timestamps after a
synchronize at each phase's end: the exposed fraction = (phase time with sleeps - phase time without) /
(sleep time issued in that phase).  The sleep is half of the host's time per collective in the run without
sleeps, so a step that overlaps can hide all of it.
  * side streams: exposed <= 0.3 in forward and in backward (the first gather of each phase and the last
    reduction have nothing to hide behind);
  * control: the same run with the host synchronizing after every collective it launches (a host stall,
    as the gather-tag checks did in the run of 2026-12-04): exposed >= 0.7 in both phases.  It shows that
    the sleeps are on the timeline and that the measure sees an exposed one, so the first check cannot pass
    by construction;
  * memory: per-step peak ``max_memory_allocated`` identical over the measured steps, and at most the full
    gradients of the in-flight reductions above the peak without side streams.
``tests/gpu/test_overlap_cpu.py`` checks on the CPU that the stand-ins reach every collective of both phases.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable

import torch
from torch import nn

HIDDEN, ROWS, BLOCKS = 256, 16, 16  # small layers: the host, not the GPU, sets the step time
STALL_FREE_EXPOSED, STALLED_EXPOSED = 0.3, 0.7
_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


class Block(nn.Module):
    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.fc2(torch.relu(self.fc1(self.norm(x))))
        return x + torch.tanh(self.fc3(h))


class Chain(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self, hidden: int = HIDDEN, blocks: int = BLOCKS) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(hidden) for _ in range(blocks)])
        self.head = nn.Linear(hidden, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def comms_of(engine) -> list:
    """Every ``Comm`` the engine's units issue collectives through, once each."""
    comms: dict[int, object] = {id(engine.comm): engine.comm}
    for unit in engine.units:
        comms.setdefault(id(unit.reduce_comm), unit.reduce_comm)
    return list(comms.values())


def patch_collectives(engine, before: Callable[[str, str], None], after: Callable[[], None] | None = None) -> None:
    """``before(kind, tag)`` on the issuing stream before each collective of every ``comms_of(engine)``,
    ``after()`` once it is launched; instance attributes only."""
    for comm in comms_of(engine):
        for kind in _COLLECTIVES:
            original = getattr(comm, kind)

            def patched(*args, _original=original, _kind=kind, tag="", **kwargs):
                before(_kind, tag)
                work = _original(*args, tag=tag, **kwargs)
                if after is not None:
                    after()
                return work

            setattr(comm, kind, patched)


class _StandIn:
    """Sleeps before each collective and counts them per phase; ``stall``: the host waits after each."""

    def __init__(self, cycles: int, stall: bool) -> None:
        self.cycles, self.stall, self.phase = cycles, stall, "forward"
        self.issued: dict[str, int] = {"forward": 0, "backward": 0}

    def before(self, kind: str, tag: str) -> None:
        self.issued[self.phase] += 1
        if self.cycles:
            torch.cuda._sleep(self.cycles)

    def after(self) -> None:
        if self.stall:
            torch.cuda.current_stream().synchronize()  # the stream that issued it: the host waits for it


def _cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _phase_times(model, opt, x, stand_in: _StandIn, steps: int) -> tuple[dict, list]:
    """Median ms of forward and of backward + step over the last ``steps - 2`` steps; each step's peak."""
    times: dict[str, list[float]] = {"forward": [], "backward": []}
    peaks = []
    for _ in range(steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        stand_in.issued = {"forward": 0, "backward": 0}
        stand_in.phase = "forward"
        t0 = time.perf_counter()
        loss = model(x).float().pow(2).mean()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        stand_in.phase = "backward"
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        times["forward"].append(1e3 * (t1 - t0))
        times["backward"].append(1e3 * (t2 - t1))
        peaks.append(torch.cuda.max_memory_allocated())
    return {k: statistics.median(v[2:]) for k, v in times.items()}, peaks[2:]


def _run(mode: str, sleep_ms: float | None, cycles_per_ms: float, steps: int = 8) -> dict:
    """``mode``: ``side_streams``, ``stalled`` (side streams, the host waits after each collective) or
    ``no_side_streams``.  Phase times without and with the stand-in sleeps; ``sleep_ms`` None: half of the
    host's time per collective without sleeps."""
    import zero_plugin as zp
    from zero_plugin.comm.streams import NO_STREAMS, CudaStreams
    from zero_plugin.engines.engine import engine_of
    from zero_plugin.stage3.hooks import MAX_INFLIGHT_REDUCES

    torch.manual_seed(0)
    model = Chain().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=3, prefetch_depth=1))
    engine = engine_of(model, "overlap")
    kind = type(engine.units[0].streams).__name__
    if mode == "no_side_streams":
        engine.set_streams(NO_STREAMS)
    stand_in = _StandIn(0, stall=mode == "stalled")
    patch_collectives(engine, stand_in.before, stand_in.after)
    x = torch.randn(ROWS, HIDDEN, device="cuda")
    base, _ = _phase_times(model, opt, x, stand_in, steps)
    issued = dict(stand_in.issued)
    if sleep_ms is None:
        sleep_ms = 0.5 * min(base[p] / max(issued[p], 1) for p in base)
    stand_in.cycles = int(sleep_ms * cycles_per_ms)
    slept, peaks = _phase_times(model, opt, x, stand_in, steps)
    unit_grad_bytes = max(
        sum(sp.layout.padded_numel * sp.unsharded.element_size() for sp in u.trainable) for u in engine.units
    )
    del model, opt, engine
    gc.collect()  # the engine's hooks and the model reference each other: freed by the cycle collector
    torch.cuda.empty_cache()
    return {
        "mode": mode,
        "engine_streams": kind,
        "is_cuda_streams": kind == CudaStreams.__name__,
        "sleep_ms": sleep_ms,
        "collectives": issued,
        "ms_without_sleeps": base,
        "ms_with_sleeps": slept,
        "exposed": {p: (slept[p] - base[p]) / max(issued[p] * sleep_ms, 1e-9) for p in base},
        "peaks": peaks,
        "held_grads_bound": (MAX_INFLIGHT_REDUCES + 1) * unit_grad_bytes,
    }


def part_overlap() -> dict:
    from tests.gpu.check import _nccl_world1

    _nccl_world1()
    cycles_per_ms = _cycles_per_ms()
    side = _run("side_streams", None, cycles_per_ms)
    stalled = _run("stalled", side["sleep_ms"], cycles_per_ms)
    serial = _run("no_side_streams", side["sleep_ms"], cycles_per_ms)
    checks = {
        "engine uses CudaStreams": side["is_cuda_streams"],
        "collectives in both phases": all(side["collectives"].values()),
        f"side streams hide the stand-in wire time (exposed <= {STALL_FREE_EXPOSED}), forward": side["exposed"][
            "forward"
        ]
        <= STALL_FREE_EXPOSED,
        f"... backward (exposed <= {STALL_FREE_EXPOSED})": side["exposed"]["backward"] <= STALL_FREE_EXPOSED,
        f"control: a host stall after each collective exposes it (>= {STALLED_EXPOSED}), both phases": min(
            stalled["exposed"].values()
        )
        >= STALLED_EXPOSED,
        "peak memory identical on every measured step": len(set(side["peaks"])) == 1,
        "peak memory within the held gradients of the run without side streams": max(side["peaks"])
        <= max(serial["peaks"]) + side["held_grads_bound"],
    }
    return {
        "side_streams": side,
        "stalled": stalled,
        "no_side_streams": serial,
        "checks": checks,
        "ok": all(checks.values()),
    }
