"""Stage-3 overlap on a real CUDA device ([Note: side streams] in zero_plugin/comm/streams.py).

World size 1 over NCCL: a unit's "all-gather" is then a device copy, far too short to see.  Each
collective issued through the engine's ``Comm`` is therefore preceded by ``torch.cuda._sleep`` on the
stream that issues it (the gather or reduce stream), standing in for the wire time of a real collective.
Measured with CUDA timing events:
  * overlap: the stand-in wire time of unit i+1's prefetched all-gather lies inside unit i's forward
    compute (fraction of the sleep that overlaps, per unit, median); as a control the same run with
    every stream operation a no-op (``NO_STREAMS``: collectives on the compute stream) must not overlap;
  * step time: with side streams the sleeps hide behind compute, without them they add up;
  * memory: per-step peak ``max_memory_allocated`` identical over the measured steps (events, not
    ``record_stream``: when memory is freed does not depend on GPU timing), and at most the full gradients
    of the in-flight reductions above the control's peak.
"""

from __future__ import annotations

import gc
import statistics

import torch
from torch import nn

HIDDEN, ROWS, BLOCKS = 4096, 2048, 6
SLEEP_MS = 1.0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return torch.tanh(self.fc2(torch.relu(self.fc1(x))))


class Chain(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(HIDDEN, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _slow_collectives(comm, cycles: int, spans: dict) -> None:
    """Sleep on the issuing stream before each unit collective; keep (start, end) timing events per tag."""
    for name in ("all_gather", "reduce_scatter"):
        original = getattr(comm, name)

        def slow(out, inp, *args, _original=original, _name=name, tag="", **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()  # on the current stream: the gather/reduce stream, or compute under NO_STREAMS
            torch.cuda._sleep(cycles)
            end.record()
            spans.setdefault((_name, tag), []).append((start, end))
            return _original(out, inp, *args, tag=tag, **kwargs)

        setattr(comm, name, slow)


def _forward_spans(engine, spans: dict) -> list:
    handles = []
    for unit in engine.units[1:]:

        def pre(module, args, unit=unit):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            spans.setdefault(("forward", unit.name), []).append([event, None])

        def post(module, args, output, unit=unit):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            spans[("forward", unit.name)][-1][1] = event

        handles += [unit.module.register_forward_pre_hook(pre), unit.module.register_forward_hook(post)]
    return handles


def _overlap_fraction(spans: dict, order: list, origin) -> float:
    """Median over units i of |sleep of unit i+1's last forward-time gather ∩ unit i's last forward| / sleep."""
    t = lambda ev: origin.elapsed_time(ev)  # noqa: E731
    fractions = []
    for cur, nxt in zip(order, order[1:]):
        f0, f1 = spans[("forward", cur)][-1]
        gathers = [(t(a), t(b)) for a, b in spans.get(("all_gather", nxt), [])]
        inside = [g for g in gathers if g[0] <= t(f1)]  # launched before unit i's forward ended
        if not inside:
            fractions.append(0.0)
            continue
        g0, g1 = inside[-1]
        fractions.append(max(0.0, min(g1, t(f1)) - max(g0, t(f0))) / max(g1 - g0, 1e-9))
    return statistics.median(fractions)


def _run(use_side_streams: bool, cycles: int, steps: int = 5) -> dict:
    import zero_plugin as zp
    from zero_plugin.comm.streams import NO_STREAMS, CudaStreams
    from zero_plugin.engines.engine import engine_of
    from zero_plugin.stage3.hooks import _MAX_INFLIGHT_REDUCES

    torch.manual_seed(0)
    model = Chain().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=3, prefetch_depth=1))
    engine = engine_of(model, "overlap")
    kind = type(engine.units[0].streams).__name__
    if not use_side_streams:
        engine.set_streams(NO_STREAMS)
    x = torch.randn(ROWS, HIDDEN, device="cuda")
    spans: dict = {}
    _slow_collectives(engine.comm, cycles, spans)
    handles = _forward_spans(engine, spans)
    times, peaks = [], []
    for _ in range(steps):
        spans.clear()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        origin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        origin.record()
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        end.record()
        torch.cuda.synchronize()
        times.append(origin.elapsed_time(end))
        peaks.append(torch.cuda.max_memory_allocated())
    order = [u.name for u in engine.runtime.forward_order]
    overlap = _overlap_fraction(spans, order, origin)
    for h in handles:
        h.remove()
    unit_grad_bytes = max(
        sum(sp.layout.padded_numel * sp.unsharded.element_size() for sp in u.trainable) for u in engine.units
    )
    del model, opt, engine
    gc.collect()  # the engine's hooks and the model reference each other: freed by the cycle collector
    torch.cuda.empty_cache()
    return {
        "engine_streams": kind,
        "side_streams": use_side_streams,
        "overlap": overlap,
        "step_ms": statistics.median(times[2:]),
        "peaks": peaks[2:],
        "gathers_per_step": 2 * BLOCKS - 1,
        "held_grads_bound": (_MAX_INFLIGHT_REDUCES + 1) * unit_grad_bytes,
        "is_cuda_streams": kind == CudaStreams.__name__,
    }


def part_overlap() -> dict:
    from tests.gpu.check import _nccl_world1

    _nccl_world1()
    cycles = int(SLEEP_MS * _cycles_per_ms())
    side = _run(True, cycles)
    serial = _run(False, cycles)
    total_sleep = (2 * BLOCKS + BLOCKS) * SLEEP_MS  # gathers (forward + backward) and reductions, roughly
    checks = {
        "engine uses CudaStreams": side["is_cuda_streams"],
        "prefetched gather overlaps compute (>= 0.8 of its time)": side["overlap"] >= 0.8,
        "control without side streams does not overlap (<= 0.2)": serial["overlap"] <= 0.2,
        "side streams save at least half the stand-in wire time": side["step_ms"]
        <= serial["step_ms"] - 0.5 * total_sleep,
        "peak memory identical on every measured step": len(set(side["peaks"])) == 1,
        "peak memory within the held gradients of the control": max(side["peaks"])
        <= max(serial["peaks"]) + side["held_grads_bound"],
    }
    return {
        "side_streams": side,
        "no_side_streams": serial,
        "sleep_ms": SLEEP_MS,
        "checks": checks,
        "ok": all(checks.values()),
    }
