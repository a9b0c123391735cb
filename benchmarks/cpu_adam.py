"""CPU optimizer-step throughput: zero_plugin's offload kernel against torch AdamW and DeepSpeedCPUAdam.

Run ``python -m benchmarks.cpu_adam [--sizes 10e6 100e6 500e6] [--threads 2] [--repeats 5]``.

Variants (same hyper-parameters: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01, AdamW):

* ``zero_plugin``: what an offloaded step runs: ``torch.optim.AdamW`` switched to torch's fused CPU
  kernel by ``zero_plugin.optim.offload.use_fast_cpu_kernels`` and stepped by
  ``zero_plugin.optim.cpu_step.fused_cpu_step`` (the kernel called directly, [Note: direct fused step]);
* ``torch foreach``: ``torch.optim.AdamW(foreach=True)``;
* ``torch for-loop``: ``torch.optim.AdamW(foreach=False)``;
* ``DeepSpeedCPUAdam``: ``deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)`` with
  ``DS_ACCELERATOR=cpu`` (its C++ op is JIT-compiled with ninja/g++ on first use, then cached).

Layouts: ``flat`` is one 1-D fp32 parameter of N elements; ``list`` is N elements as 4096x4096
tensors (plus one 4096xk tensor and a 1-D tail for the remainder).

[Note: same memory]
By default every variant steps the *same* parameter, gradient and optimizer-state tensors: the first
variant's warm-up step allocates exp_avg / exp_avg_sq, every other optimizer's state is pointed at them
(with the same step count), and the variants then take turns, one step each, the order rotated every
step.  The kernels are memory-bound from about 10M parameters, and separately allocated copies of the
same 16 bytes/param run measurably apart (up to ~10% in either direction between runs, with the same
kernel: page placement and the arrays' relative alignment), which is larger than the differences being
measured.  Shared tensors remove that, and let 500M run step-interleaved (8 GB instead of 8 GB per
variant).  The values drift apart from any single optimizer's trajectory; only time is measured here
(the numerical check below uses separate tensors).

[Note: timing protocol]
With ``--no-same-memory`` every variant starts from the same seeded parameters and gradients.  The first step (which allocates
the optimizer state) is a warm-up and is not timed.  When all variants fit in memory at once
(``--resident-fraction`` of available RAM), they are built together and timed one step at a time,
round-robin, with the order rotated every round.  Otherwise (500M fp32 x AdamW is 8 GB per variant)
one variant at a time is built, warmed up, timed for ``--repeats`` steps and freed (``gc.collect`` +
``malloc_trim``) before the next; this repeats for ``--rounds`` rounds with the variant order rotated.
The reported figure is the median over all timed steps; the spread column is min-max of per-round
medians.  Parameters per second is N / median step time.

Thread count: ``torch.set_num_threads(threads)``.  DeepSpeed's op is built with ``-fopenmp`` but does not
link a libgomp of its own: its ``GOMP_parallel`` resolves to torch's bundled ``torch/lib/libgomp.so.1``
(the only OpenMP runtime in the process), so the same call caps it.  ``OMP_NUM_THREADS`` is also set
before torch is imported, in case a build does pull in a second runtime.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.cpu_adam_report import report_text

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
VARIANTS = ("zero_plugin", "torch foreach", "torch for-loop", "DeepSpeedCPUAdam")
LABELS = {
    "zero_plugin": "zero_plugin offload (`fused_cpu_step`)",
    "torch foreach": "torch `AdamW(foreach=True)`",
    "torch for-loop": "torch `AdamW(foreach=False)`",
    "DeepSpeedCPUAdam": "DeepSpeed `DeepSpeedCPUAdam`",
}
BLOCK = 4096
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cpu_adam.md"


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_adam", description=__doc__.splitlines()[0])
    p.add_argument(
        "--sizes", type=float, nargs="+", default=[10e6, 100e6, 500e6], help="parameter counts (fp32 elements)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="timed steps per variant per round")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (rebuild mode)")
    p.add_argument("--layouts", nargs="+", choices=("flat", "list"), default=["flat", "list"])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument(
        "--resident-fraction",
        type=float,
        default=0.4,
        help="build all variants at once when their state fits in this fraction of available RAM",
    )
    p.add_argument(
        "--check-size", type=int, default=3_000_017, help="elements for the 3-step numerical check (0 to skip)"
    )
    p.add_argument(
        "--same-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every variant steps the same tensors ([Note: same memory]); --no-same-memory gives "
        "each its own (built together when they fit, else one at a time)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown report ('-' for none)")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- helpers (torch imported lazily)


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _available_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001
        return 0


def _release() -> None:
    from benchmarks.measure import release_memory

    release_memory()


def _shapes(n: int, layout: str) -> list[tuple[int, ...]]:
    if layout == "flat":
        return [(n,)]
    shapes: list[tuple[int, ...]] = [(BLOCK, BLOCK)] * (n // (BLOCK * BLOCK))
    rest = n - len(shapes) * BLOCK * BLOCK
    if rest >= BLOCK:
        shapes.append((rest // BLOCK, BLOCK))
        rest -= (rest // BLOCK) * BLOCK
    if rest:
        shapes.append((rest,))
    return shapes


def _layout_desc(n: int, layout: str) -> str:
    shapes = _shapes(n, layout)
    if layout == "flat":
        return f"1 x ({n},)"
    full = sum(1 for s in shapes if s == (BLOCK, BLOCK))
    rest = [s for s in shapes if s != (BLOCK, BLOCK)]
    parts = [f"{full} x 4096x4096"] if full else []
    parts += ["x".join(map(str, s)) for s in rest]
    return " + ".join(parts)


def _make_params(n: int, layout: str, seed: int):
    """Seeded fp32 parameters with gradients attached (identical for every variant)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in _shapes(n, layout):
        p = torch.nn.Parameter(torch.randn(shape, generator=g))
        p.grad = torch.randn(shape, generator=g).mul_(1e-2)
        params.append(p)
    return params


def _ds_available() -> tuple[bool, str]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import torch
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = torch.nn.Parameter(torch.zeros(8))
        p.grad = torch.ones(8)
        opt = DeepSpeedCPUAdam([p], adamw_mode=True, **HYPER)  # builds / loads the C++ op
        opt.step()
        del opt
        import deepspeed

        return True, f"deepspeed {deepspeed.__version__}"
    except Exception as e:  # noqa: BLE001
        return False, f"{type(e).__name__}: {e}".splitlines()[0][:300]


def _make_optimizer(name: str, params):
    import torch

    if name == "zero_plugin":
        from zero_plugin.optim.offload import use_fast_cpu_kernels

        opt = torch.optim.AdamW(params, **HYPER)
        if not use_fast_cpu_kernels(opt):
            raise RuntimeError("use_fast_cpu_kernels declined AdamW on CPU")
        assert all(g["fused"] for g in opt.param_groups)
        return _OffloadStep(opt)
    if name == "torch foreach":
        return torch.optim.AdamW(params, foreach=True, **HYPER)
    if name == "torch for-loop":
        return torch.optim.AdamW(params, foreach=False, fused=False, **HYPER)
    if name == "DeepSpeedCPUAdam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, bias_correction=True, **HYPER)
    raise ValueError(name)


class _OffloadStep:
    """What an offloaded ``ZeroOptimizer.step`` runs on the host: ``fused_cpu_step`` on the AdamW that
    ``use_fast_cpu_kernels`` switched to the fused kernel ([Note: direct fused step] in
    ``zero_plugin/optim/cpu_step.py``)."""

    def __init__(self, opt) -> None:
        self.opt, self.state = opt, opt.state

    def step(self) -> None:
        from zero_plugin.optim.cpu_step import fused_cpu_step

        if not fused_cpu_step(self.opt):
            raise RuntimeError("fused_cpu_step declined the offload AdamW")


def _timed_step(opt) -> tuple[float, float]:
    """(wall seconds, process CPU seconds summed over all threads) of one step."""
    c0, t0 = time.process_time(), time.perf_counter()
    opt.step()
    t1, c1 = time.perf_counter(), time.process_time()
    return t1 - t0, c1 - c0


# --------------------------------------------------------------------------- numerical check


def numerical_check(n: int, layout: str, variants: list[str]) -> dict[str, tuple[float, float]]:
    """Max |param - fp32 for-loop param| and max |param - fp64 for-loop param| after 3 steps.

    Parameters are ``randn`` (|p| up to ~4.5, where one fp32 ulp is 4.8e-7); gradients are fresh each step.
    The fp64 run is the for-loop AdamW on float64 copies of the same data: it shows whether a kernel
    that disagrees with the fp32 for-loop is any less accurate, or just rounds differently.
    """
    import torch

    shapes = _shapes(n, layout) if layout == "flat" else [(1024, 1024), (1024, 1024), (n // 1024 // 4, 1024), (17,)]
    g = torch.Generator().manual_seed(1234)
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) * 1e-2 for s in shapes] for _ in range(3)]

    def run(name: str, dtype=torch.float32) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(t.to(dtype, copy=True)) for t in init]
        opt = _make_optimizer(name, params)
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                p.grad = gr.to(dtype, copy=True)
            opt.step()
        return [p.detach().double() for p in params]

    def maxdiff(a, b) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(a, b))

    ref64 = run("torch for-loop", torch.float64)
    ref = run("torch for-loop")
    out = {"torch for-loop": (0.0, maxdiff(ref, ref64))}
    for name in variants:
        if name != "torch for-loop":
            got = run(name)
            out[name] = (maxdiff(got, ref), maxdiff(got, ref64))
    # how far the 3 steps moved the parameters, for scale
    out["_update"] = (maxdiff(ref64, [t.double() for t in init]), 0.0)
    return out


# --------------------------------------------------------------------------- throughput


def _share_state(opts: dict, params: list) -> None:
    """[Note: same memory] Point every optimizer's state at the first one's exp_avg / exp_avg_sq, so all
    variants step over the very same parameter, gradient and state tensors."""
    import torch

    first = next(iter(opts.values()))
    for _v, opt in opts.items():
        if opt is first:
            continue
        for p in params:
            src = first.state[p]
            step = src["step"]
            steps = int(step.item()) if isinstance(step, torch.Tensor) else int(step)
            state = opt.state[p]
            state.clear()
            # DeepSpeedCPUAdam counts steps in a Python int, torch's optimizers in a tensor
            state["step"] = steps if type(opt).__name__ == "DeepSpeedCPUAdam" else torch.tensor(float(steps))
            state["exp_avg"], state["exp_avg_sq"] = src["exp_avg"], src["exp_avg_sq"]


def bench_size(n: int, layout: str, variants: list[str], args) -> dict:
    if args.same_memory:
        return _bench_same_memory(n, layout, variants, args)
    per_variant_bytes = 16 * n  # param + grad + exp_avg + exp_avg_sq, fp32
    avail = _available_bytes()
    resident = avail > 0 and len(variants) * per_variant_bytes * 1.25 <= args.resident_fraction * avail
    times: dict[str, list[list[tuple[float, float]]]] = {v: [] for v in variants}  # per round: (wall, cpu)
    errors: dict[str, str] = {}

    if resident:
        opts = {}
        for v in variants:
            try:
                opts[v] = _make_optimizer(v, _make_params(n, layout, seed=0))
                opts[v].step()  # warm-up: allocates state
            except Exception as e:  # noqa: BLE001
                errors[v] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        live = [v for v in variants if v in opts]
        for v in live:
            times[v] = [[] for _ in range(args.rounds)]
        for r in range(args.rounds):
            for k in range(args.repeats):
                shift = (r * args.repeats + k) % max(len(live), 1)
                for v in live[shift:] + live[:shift]:
                    times[v][r].append(_timed_step(opts[v]))
        del opts
        _release()
    else:
        for r in range(args.rounds):
            shift = r % len(variants)
            for v in variants[shift:] + variants[:shift]:
                if v in errors:
                    continue
                try:
                    params = _make_params(n, layout, seed=0)
                    opt = _make_optimizer(v, params)
                    opt.step()  # warm-up: allocates state
                    times[v].append([_timed_step(opt) for _ in range(args.repeats)])
                except Exception as e:  # noqa: BLE001
                    errors[v] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
                finally:
                    opt = params = None  # noqa: F841
                    _release()
    return {
        "times": times,
        "errors": errors,
        "resident": resident,
        "mode": "resident, step-interleaved" if resident else "one variant at a time, round-interleaved",
    }


def _bench_same_memory(n: int, layout: str, variants: list[str], args) -> dict:
    """Every variant steps the same tensors ([Note: same memory]), one step at a time, round-robin with the
    order rotated every step: what differs between variants is only the kernel."""
    params = _make_params(n, layout, seed=0)
    opts, errors = {}, {}
    for v in variants:
        try:
            opts[v] = _make_optimizer(v, params)
        except Exception as e:  # noqa: BLE001
            errors[v] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    live = list(opts)
    if live:
        opts[live[0]].step()  # warm-up: allocates the state every variant then shares
        _share_state(opts, params)
        for v in live[1:]:
            opts[v].step()  # each kernel's own warm-up, untimed
    times: dict[str, list] = {v: [[] for _ in range(args.rounds)] for v in live}
    for r in range(args.rounds):
        for k in range(args.repeats):
            shift = (r * args.repeats + k) % max(len(live), 1)
            for v in live[shift:] + live[:shift]:
                times[v][r].append(_timed_step(opts[v]))
    del opts, params
    _release()
    return {"times": times, "errors": errors, "resident": True, "mode": "same tensors, step-interleaved"}


def paired_ratio(ref: list[list[tuple[float, float]]], other: list[list[tuple[float, float]]], resident: bool) -> float:
    """Median of ref/other over time-adjacent pairs, so that load drifting over the run cancels.

    Resident: step k of ``other`` against step k of ``ref`` (timed back to back).  Otherwise: the
    per-round median of ``other`` against that of ``ref`` (built and timed in the same round).
    """
    if resident:
        pairs = [(a[0], b[0]) for ra, rb in zip(ref, other) for a, b in zip(ra, rb)]
    else:
        pairs = [
            (statistics.median(w for w, _ in ra), statistics.median(w for w, _ in rb))
            for ra, rb in zip(ref, other)
            if ra and rb
        ]
    return statistics.median(a / b for a, b in pairs)


def _fmt_size(n: int) -> str:
    return f"{n / 1e6:g}M"


def main(argv=None) -> int:
    args = _parse(argv)
    # Before torch (and its OpenMP runtime) loads; torch.set_num_threads below is what caps both torch and DeepSpeed.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    load_before = _loadavg()
    import torch

    torch.set_num_threads(args.threads)

    sizes = [int(s) for s in args.sizes]
    variants = list(args.variants)
    ds_note = ""
    if "DeepSpeedCPUAdam" in variants:
        t0 = time.perf_counter()
        ok, ds_note = _ds_available()
        print(
            f"# DeepSpeedCPUAdam: {'ok' if ok else 'UNAVAILABLE'} ({ds_note}; "
            f"load/build {time.perf_counter() - t0:.1f}s)",
            flush=True,
        )
        if not ok:
            variants.remove("DeepSpeedCPUAdam")

    check_lines: list[str] = []
    if args.check_size:
        check_lines += [
            "| layout | variant | max abs diff vs fp32 for-loop | max abs diff vs fp64 for-loop "
            "| max abs update in 3 steps (scale) |",
            "|---|---|---|---|---|",
        ]
        for layout in args.layouts:
            res = numerical_check(args.check_size, layout, variants)
            scale = res.pop("_update")[0]
            for v, (d32, d64) in res.items():
                check_lines.append(f"| {layout} | {LABELS[v]} | {d32:.2e} | {d64:.2e} | {scale:.2e} |")
                print(
                    f"# check {layout:4s} {v:18s} max|diff| vs fp32 for-loop {d32:.2e}, vs fp64 {d64:.2e} "
                    f"(update {scale:.2e})",
                    flush=True,
                )

    rows = [
        "| params | layout | variant | median step (ms) | G params/s | x DeepSpeedCPUAdam | per-round medians (ms) "
        "| x DeepSpeedCPUAdam, paired | median CPU time / step (ms) | x DeepSpeedCPUAdam by CPU time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdict: list[str] = []
    modes: list[str] = []
    for n in sizes:
        for layout in args.layouts:
            t0 = time.perf_counter()
            res = bench_size(n, layout, variants, args)
            modes.append(f"{_fmt_size(n)} {layout}: {res['mode']} ({_layout_desc(n, layout)})")
            med, cpu = {}, {}
            for v in variants:
                flat = [t for rnd in res["times"].get(v, []) for t in rnd]
                if flat:
                    med[v] = statistics.median(w for w, _ in flat)
                    cpu[v] = statistics.median(c for _, c in flat)
            ds, ds_cpu = med.get("DeepSpeedCPUAdam"), cpu.get("DeepSpeedCPUAdam")
            for v in variants:
                if v not in med:
                    rows.append(
                        f"| {_fmt_size(n)} | {layout} | {LABELS[v]} | failed: {res['errors'].get(v, '?')} | | | | | | |"
                    )
                    continue
                rate = n / med[v] / 1e9
                ratio = f"{ds / med[v]:.2f}x" if ds else "n/a"
                cpu_ratio = f"{ds_cpu / cpu[v]:.2f}x" if ds_cpu else "n/a"
                paired = (
                    f"{paired_ratio(res['times']['DeepSpeedCPUAdam'], res['times'][v], res['resident']):.2f}x"
                    if ds
                    else "n/a"
                )
                rounds = ", ".join(f"{statistics.median(w for w, _ in r) * 1e3:.0f}" for r in res["times"][v] if r)
                rows.append(
                    f"| {_fmt_size(n)} | {layout} | {LABELS[v]} | {med[v] * 1e3:.1f} | {rate:.3f} | {ratio} "
                    f"| {rounds} | {paired} | {cpu[v] * 1e3:.1f} | {cpu_ratio} |"
                )
            if ds and "zero_plugin" in med:
                pr = paired_ratio(res["times"]["DeepSpeedCPUAdam"], res["times"]["zero_plugin"], res["resident"])
                verdict.append(
                    f"{_fmt_size(n)} {layout}: {ds / med['zero_plugin']:.2f}x (paired {pr:.2f}x, "
                    f"CPU time {ds_cpu / cpu['zero_plugin']:.2f}x)"
                )
            print("\n".join(rows[-len(variants) :]), f"  [{time.perf_counter() - t0:.0f}s]", flush=True)

    text = report_text(
        args, argv, torch.__version__, (load_before, _loadavg()), modes, ds_note, variants, rows, verdict, check_lines
    )
    print()
    print(text)
    if str(args.out) != "-":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
