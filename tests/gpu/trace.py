"""Profiler traces of stage 3 on a CUDA device, summarised as text (``python -m tests.gpu.trace``).

Two diagnostics for the GPU checks that miss their targets:
  * ``overlap``: the side-stream run of ``tests/gpu/overlap.py`` (stand-in sleeps before each collective),
    one profiled step: per stream, the kernels of the first forward in launch order with start and duration,
    and the host-side synchronisations (``cudaStreamSynchronize``, ``cudaEventSynchronize``, ...), which
    would serialise a prefetch with compute;
  * ``speed``: the ~1B Llama step of ``check.part_speed_vs_fsdp2`` under zero_plugin stage 3 and under FSDP2,
    one profiled step each: the top operators by self CUDA and by self CPU time.
Chrome traces are written (gzipped) next to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import shutil

import torch
from torch.profiler import ProfilerActivity, profile

SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaStreamWaitEvent")


def _export(prof, path: str) -> list:
    raw = path + ".json"
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(path + ".json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    with open(raw) as f:
        events = json.load(f)["traceEvents"]
    os.remove(raw)
    return events


def _timeline(events: list, limit: int = 70) -> None:
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not kernels:
        print("no kernels")
        return
    t0 = min(e["ts"] for e in kernels)
    kernels.sort(key=lambda e: e["ts"])
    print(f"{'stream':>6} {'start_ms':>9} {'dur_ms':>7}  kernel")
    for e in kernels[:limit]:
        stream = e.get("args", {}).get("stream", "?")
        print(f"{stream!s:>6} {(e['ts'] - t0) / 1e3:9.3f} {e['dur'] / 1e3:7.3f}  {e['name'][:70]}")
    syncs: dict = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and e.get("name") in SYNCS:
            c = syncs.setdefault(e["name"], [0, 0.0])
            c[0] += 1
            c[1] += e.get("dur", 0) / 1e3
    print("host syncs (count, total ms):", {k: (v[0], round(v[1], 3)) for k, v in syncs.items()})
    streams: dict = {}
    for e in kernels:
        s = e.get("args", {}).get("stream", "?")
        streams[s] = streams.get(s, 0.0) + e["dur"] / 1e3
    print("busy ms per stream:", {k: round(v, 3) for k, v in streams.items()})


def _step(model, opt, x) -> None:
    out = model(input_ids=x, labels=x).loss if x.dtype == torch.long else model(x).float().pow(2).mean()
    out.backward()
    opt.step()
    opt.zero_grad()


def _profiled_step(model, opt, x, warmup: int, path: str):
    """``warmup`` steps, then one profiled step; the profile and its exported trace events."""
    for _ in range(warmup):
        _step(model, opt, x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step(model, opt, x)
        torch.cuda.synchronize()
    return prof, _export(prof, path)


def trace_overlap(out_dir: str) -> None:
    import zero_plugin as zp
    from tests.gpu import overlap as O
    from tests.gpu.check import _nccl_world1
    from zero_plugin.engines.engine import engine_of

    _nccl_world1()
    sleep_ms = 0.2  # about half of the host-bound model's host time per collective (overlap.py picks it per run)
    cycles = int(sleep_ms * O._cycles_per_ms())
    torch.manual_seed(0)
    model = O.Chain().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=3, prefetch_depth=1))
    engine = engine_of(model, "trace")
    stand_in = O._StandIn(cycles, stall=False)
    O.patch_collectives(engine, stand_in.before, stand_in.after)
    x = torch.randn(O.ROWS, O.HIDDEN, device="cuda")

    _, events = _profiled_step(model, opt, x, warmup=2, path=os.path.join(out_dir, "trace_overlap"))
    print(f"== overlap: one stage-3 step, side streams, {sleep_ms} ms stand-in sleep before each collective")
    _timeline(events)
    del model, opt, engine
    gc.collect()
    torch.cuda.empty_cache()


def trace_speed(out_dir: str) -> None:
    from tests.gpu.check import _llama, _nccl_world1
    from tests.gpu.speed import speed_variant

    _nccl_world1()
    cfg, build = _llama(2048, 16, 5504, 16)
    ids = torch.randint(0, 32000, (4, 512), device="cuda")
    for name in ("zp3", "fsdp2"):
        model, opt = speed_variant(name, build, "cuda")
        prof, events = _profiled_step(model, opt, ids, warmup=3, path=os.path.join(out_dir, f"trace_speed_{name}"))
        span = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
        gpu_busy = sum(e["dur"] for e in span) / 1e3
        wall = (max(e["ts"] + e["dur"] for e in span) - min(e["ts"] for e in span)) / 1e3 if span else 0.0
        print(f"== speed {name}: kernel span {wall:.1f} ms, kernel busy {gpu_busy:.1f} ms")
        ka = prof.key_averages()
        print(ka.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=48))
        print(ka.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))
        syncs = {k.key: k.count for k in ka if k.key in SYNCS}
        print("host syncs:", syncs)
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", nargs="*", default=["overlap", "speed"])
    args = ap.parse_args()
    for part in args.parts:
        try:
            {"overlap": trace_overlap, "speed": trace_speed}[part](args.out)
        except Exception as exc:  # one part's failure must not hide the other's output
            print(f"== {part} failed: {exc!r}")


if __name__ == "__main__":
    main()
