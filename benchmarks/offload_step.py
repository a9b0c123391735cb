"""Mixed-precision offload step on the host: zero_plugin's blocked step against DeepSpeed's and torch's.

Run ``python -m benchmarks.offload_step [--sizes 10e6 100e6 500e6] [--threads 2] [--repeats 5] [--rounds 2]``.

What ZeRO-Offload does on the host for every optimizer step with bf16 parameters and fp32 masters, all
of it timed: cast this rank's reduced bf16 gradient to fp32, AdamW over the fp32 master and moments,
cast the updated master back into the bf16 parameter.  Variants (AdamW lr 1e-3, betas (0.9, 0.999),
eps 1e-8, weight_decay 0.01):

* ``zero_plugin``: the engine's own objects -- one ``MasterParam`` per parameter, ``set_grad(blocked=True)``,
  ``BlockedStep.step`` ([Note: cache-blocked offload step] in ``zero_plugin/optim/blocked_step.py``);
* ``zero_plugin whole-tensor``: the same ``MasterParam``s through the whole-tensor path (``set_grad`` casts
  into a fresh fp32 gradient, ``fused_cpu_step``, ``write_back``): what the engine ran before the blocked step;
* ``DeepSpeed``: what DeepSpeed's ZeRO-Offload (stages 1-2) does: the bf16 gradient copied into a persistent
  fp32 gradient buffer (DeepSpeed does this copy during backward; it is host work of the step all the same),
  ``DeepSpeedCPUAdam.step()``, the fp32 partition copied into the bf16 one;
* ``torch fused`` / ``torch foreach``: the same pipeline as DeepSpeed's with ``torch.optim.AdamW(fused=True)``
  / ``AdamW(foreach=True)``.

Every variant steps the same masters, moments and bf16 tensors ([Note: same memory] in ``cpu_adam.py``):
one step each in turn, the order rotated every step.  Ratios are against DeepSpeed; "paired" is the
median of DeepSpeed/variant over steps timed back to back.  The numerical check runs each pipeline for 3
steps on its own copy and reports the max |difference| of the bf16 parameters and fp32 masters from
``torch fused`` (zero_plugin's blocked step is bitwise the same as torch's fused kernel).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from benchmarks.cpu_adam import (
    HYPER,
    _cpu_name,
    _ds_available,
    _ds_version,
    _fmt_size,
    _loadavg,
    _release,
    _shapes,
    _share_state,
    paired_ratio,
)

VARIANTS = ("zero_plugin", "zero_plugin whole-tensor", "DeepSpeed", "torch fused", "torch foreach")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "offload_step.md"


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.offload_step", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[10e6, 100e6, 500e6])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="timed steps per variant per round, at least")
    p.add_argument(
        "--round-seconds",
        type=float,
        default=1.0,
        help="more steps per round for small sizes: as many as one step of the first variant says "
        "fit in this many seconds per variant (short steps are noisier, so they get more samples)",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layouts", nargs="+", choices=("flat", "list"), default=["flat", "list"])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--check-size", type=int, default=3_000_017, help="elements for the numerical check (0: skip)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown report ('-' for none)")
    return p.parse_args(argv)


class Tensors:
    """bf16 parameters and gradients, their fp32 masters (one ``MasterParam`` each) and one AdamW state."""

    def __init__(self, n: int, layout: str, seed: int = 0) -> None:
        import torch

        from zero_plugin.optim.master import MasterParam
        from zero_plugin.tensors.flat import ShardLayout

        g = torch.Generator().manual_seed(seed)
        self.slots, self.grads = [], []
        for i, shape in enumerate(_shapes(n, layout)):
            full = torch.randn(shape, generator=g)
            param = torch.nn.Parameter(full.to(torch.bfloat16))
            self.slots.append(
                MasterParam(f"p{i}", param, ShardLayout(param.numel(), 1, 0), param.data, torch.float32, source=full)
            )
            self.grads.append(torch.randn(shape, generator=g).mul_(1e-2).to(torch.bfloat16))
        self.masters = [s.master for s in self.slots]
        self.buffers: list | None = None  # persistent fp32 gradients, as DeepSpeed keeps them

    def fp32_buffers(self) -> list:
        import torch

        if self.buffers is None:
            self.buffers = [torch.empty_like(m) for m in self.masters]
        return self.buffers


class Pipeline:
    """One variant's step over ``Tensors``; ``opt.state`` is shared between variants after the first step."""

    def __init__(self, name: str, t: Tensors) -> None:
        import torch

        self.name, self.t = name, t
        if name == "DeepSpeed":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            self.opt = DeepSpeedCPUAdam(t.masters, adamw_mode=True, bias_correction=True, **HYPER)
        elif name == "torch foreach":
            self.opt = torch.optim.AdamW(t.masters, foreach=True, **HYPER)
        else:
            self.opt = torch.optim.AdamW(t.masters, fused=True, **HYPER)
        if name == "zero_plugin":
            from zero_plugin.optim.blocked_step import BlockedStep

            self.blocked = BlockedStep(t.slots)

    def step(self) -> None:
        from zero_plugin.optim.cpu_step import fused_cpu_step

        t = self.t
        if self.name == "zero_plugin":
            for s, g in zip(t.slots, t.grads):
                s.set_grad(g, blocked=True)
            if not self.blocked.applies(self.opt):
                raise RuntimeError("the blocked step declined AdamW(fused=True)")
            self.blocked.step(self.opt)
        elif self.name == "zero_plugin whole-tensor":
            for s, g in zip(t.slots, t.grads):
                s.set_grad(g)
            if not fused_cpu_step(self.opt):
                raise RuntimeError("fused_cpu_step declined AdamW(fused=True)")
        else:
            for m, buf, g in zip(t.masters, t.fp32_buffers(), t.grads):
                buf.copy_(g)
                m.grad = buf
            self.opt.step()
        for s in t.slots:
            s.write_back()
            s.master.grad = None


def _timed(pipe: Pipeline) -> float:
    t0 = time.perf_counter()
    pipe.step()
    return time.perf_counter() - t0


def bench(n: int, layout: str, variants: list[str], args) -> dict[str, list[list[float]]]:
    t = Tensors(n, layout)
    pipes = {v: Pipeline(v, t) for v in variants}
    first = next(iter(pipes.values()))
    first.step()  # allocates the moments every variant then shares
    _share_state({v: pipe.opt for v, pipe in pipes.items()}, t.masters)  # [Note: same memory] in cpu_adam.py
    for pipe in list(pipes.values())[1:]:
        pipe.step()  # each variant's own warm-up, untimed
    repeats = max(args.repeats, int(args.round_seconds / _timed(first)))
    times = {v: [[] for _ in range(args.rounds)] for v in variants}
    for r in range(args.rounds):
        for k in range(repeats):
            shift = (r * repeats + k) % len(variants)
            for v in variants[shift:] + variants[:shift]:
                times[v][r].append(_timed(pipes[v]))
    del pipes, t, first
    _release()
    return times


def numerical_check(n: int, variants: list[str]) -> dict[str, tuple[float, float]]:
    """Max |bf16 param - torch fused's| and max |fp32 master - torch fused's| after 3 steps, own tensors each."""
    import torch

    out = {}
    ref = None
    for v in ["torch fused"] + [v for v in variants if v != "torch fused"]:
        t = Tensors(n, "flat", seed=7)
        pipe = Pipeline(v, t)
        for step in range(3):
            g = torch.Generator().manual_seed(100 + step)
            t.grads = [torch.randn(gr.shape, generator=g).mul_(1e-2).to(torch.bfloat16) for gr in t.grads]
            pipe.step()
        got = ([s.param.detach().float() for s in t.slots], [m.detach().clone() for m in t.masters])
        if ref is None:
            ref = got
        out[v] = tuple(max(float((a - b).abs().max()) for a, b in zip(x, y)) for x, y in zip(got, ref))
    return out


def main(argv=None) -> int:
    args = _parse(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch loads (see cpu_adam.py)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    load_before = _loadavg()
    import torch

    torch.set_num_threads(args.threads)
    variants = list(args.variants)
    ds_note = ""
    if "DeepSpeed" in variants:
        ok, ds_note = _ds_available()
        print(f"# DeepSpeedCPUAdam: {'ok' if ok else 'UNAVAILABLE'} ({ds_note})", flush=True)
        if not ok:
            variants.remove("DeepSpeed")
    rows = [
        "| params | layout | variant | median step (ms) | G params/s | x DeepSpeed | x DeepSpeed, paired "
        "| per-round medians (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    verdict, counts = [], []
    for n in [int(s) for s in args.sizes]:
        for layout in args.layouts:
            t0 = time.perf_counter()
            times = bench(n, layout, variants, args)
            counts.append(f"{_fmt_size(n)} {layout} {len(times[variants[0]][0])}")
            med = {v: statistics.median(x for r in times[v] for x in r) for v in variants}
            ds = med.get("DeepSpeed")
            for v in variants:
                ratio = f"{ds / med[v]:.2f}x" if ds else "n/a"
                paired = f"{paired_ratio(_pairs(times['DeepSpeed']), _pairs(times[v]), True):.2f}x" if ds else "n/a"
                rounds = ", ".join(f"{statistics.median(r) * 1e3:.0f}" for r in times[v])
                rows.append(
                    f"| {_fmt_size(n)} | {layout} | {v} | {med[v] * 1e3:.1f} | {n / med[v] / 1e9:.3f} "
                    f"| {ratio} | {paired} | {rounds} |"
                )
            if ds and "zero_plugin" in med:
                pr = paired_ratio(_pairs(times["DeepSpeed"]), _pairs(times["zero_plugin"]), True)
                verdict.append(f"{_fmt_size(n)} {layout} {ds / med['zero_plugin']:.2f}x (paired {pr:.2f}x)")
            print("\n".join(rows[-len(variants) :]), f"  [{time.perf_counter() - t0:.0f}s]", flush=True)
    check = numerical_check(args.check_size, variants) if args.check_size else {}
    ds_ver = _ds_version()
    lines = [
        "# Mixed-precision offload step on the host (bf16 gradients in, fp32 AdamW, bf16 parameters out)",
        "",
        f"Generated by `python -m benchmarks.offload_step {' '.join(argv if argv is not None else sys.argv[1:])}`".rstrip()
        + ".",
        "",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- torch {torch.__version__}, deepspeed {ds_ver}, python {platform.python_version()}",
        f"- CPU: {_cpu_name()}, {os.cpu_count()} logical cores; threads: {args.threads}",
        f"- load average (1/5/15 min) before: {load_before}; after: {_loadavg()}",
        f"- protocol: same tensors for every variant, one step each in turn, order rotated every step; "
        f"at least {args.repeats} timed steps (as many as fit in {args.round_seconds:g} s per variant at small sizes) "
        f"x {args.rounds} rounds; each step = gradient cast in + AdamW + parameter "
        f"cast out (see the module docstring of `benchmarks/offload_step.py`). Ratio > 1: faster than DeepSpeed.",
    ]
    lines.append("- timed steps per variant per round: " + ", ".join(counts))
    if ds_note and "DeepSpeed" not in variants:
        lines.append(f"- DeepSpeed unavailable: {ds_note}")
    text = "\n".join(lines + ["", "## Throughput", ""] + rows)
    if verdict:
        text += "\n\nzero_plugin vs DeepSpeed (target >= 1.0x): " + "; ".join(verdict) + "."
    if check:
        text += (
            f"\n\n## Numerical check ({args.check_size} elements, 3 steps)\n\n"
            "| variant | max abs diff of bf16 params vs torch fused | of fp32 masters |\n|---|---|---|\n"
            + "\n".join(f"| {v} | {a:.2e} | {b:.2e} |" for v, (a, b) in check.items())
        )
    text += "\n"
    print("\n" + text)
    if str(args.out) != "-":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"# wrote {args.out}")
    return 0


def _pairs(rounds: list[list[float]]) -> list[list[tuple[float, float]]]:
    """``paired_ratio`` (cpu_adam.py) takes (wall, cpu) tuples."""
    return [[(w, 0.0) for w in r] for r in rounds]


if __name__ == "__main__":
    sys.exit(main())
