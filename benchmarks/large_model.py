"""LoRA on a model larger than one process's share of the machine: zero_plugin stage 3 against plain DDP.

    python -m benchmarks.write_llama_checkpoint /data/llama-3b          # once: ~3.0B parameters, 12 GB fp32
    python -m benchmarks.large_model --model /data/llama-3b             # -> results/large_model.md + .json

Both runs are the UNMODIFIED ``examples/finetune_trainer.py`` (HF Trainer + PEFT LoRA) for ``--steps``
optimizer steps on 2 processes, launched as a user would:
  * ``zero3``: ``zero-plugin launch --stage 3 --num_processes 2 examples/finetune_trainer.py --model ...``
    (its printed memory estimate is kept in the report);
  * ``ddp``: ``accelerate launch --num_processes 2 examples/finetune_trainer.py --model ...`` (on a
    machine without GPUs with ``--multi_gpu`` and ``ACCELERATE_USE_CPU=true``, which is how Accelerate
    starts 2 CPU processes: see [Note: Accelerate on a CPU-only machine] in zero_plugin/run.py).
Script options: ``--max_steps --batch_size --max_length`` as given, ``--log_every 1`` (a log line per
step), ``--warmup_steps 0``, ``--max_new_tokens 1`` (the example generates samples before and after
training; one token keeps that short), a temporary ``--output_dir``.

Measured per rank, from outside (the ranks are the launcher's descendants with ``RANK`` in their
environment): ``VmHWM`` (the kernel's peak RSS) read when the first step's log line appears (the
load), when the Trainer prints its end-of-training metrics (``train_loss``: through training), and at
the last poll before the rank exits (the whole script: after training rank 0 also reloads a fresh full
base model to check the saved adapter, an example feature that is not part of the training).  Times
come from the time each log line of rank 0 arrives: step time is the median gap between consecutive
step lines, load time the first step line's time minus one step time.  The ratio is the training
peak per rank over one full copy of the weights (the index's ``total_size``; target <= 0.6).

A watchdog polls the machine's ``MemAvailable`` every 0.1 s and kills a run's whole process group when
it falls under ``--min_available_gib`` (default 2): DDP holds one full copy per rank and is expected not
to fit, which is recorded as "failed" with what it would need (2 full copies, and the planner's
estimate), never by letting the kernel's OOM killer pick a process of the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "finetune_trainer.py"
RESULTS = REPO / "benchmarks" / "results"
GIB = 2**30
_STEP_LINE = re.compile(r"^\{'loss': ")
_END_LINE = re.compile(r"'train_loss': ")  # the Trainer's end-of-training metrics (step lines have 'loss')
_ESTIMATE_PREFIXES = ("zero-plugin launch:", "  --stage", "  same with a frozen base", "  this machine:")


# -- /proc ----------------------------------------------------------------------------------------------
def _status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of ``pid`` in bytes ({} once it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            return {
                k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")
            }
    except (OSError, ValueError):
        return {}


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env and b"LOCAL_RANK" in env else None


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += children
        frontier = children
    return found


def available_memory() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


# -- one run --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Watch:
    """What the poller and the output reader collect about one run."""

    started: float
    ranks: dict[int, int] = dataclasses.field(default_factory=dict)  # pid -> rank
    hwm: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> last VmHWM seen
    marks: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)  # "load"/"train" -> rank -> VmHWM
    lines: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    min_available: int | None = None
    killed: str | None = None

    def poll(self, root: int) -> None:
        for pid in _descendants(root):
            if pid not in self.ranks and (rank := _rank_of(pid)) is not None:
                self.ranks[pid] = rank
        for pid, rank in self.ranks.items():
            if (hwm := _status(pid).get("VmHWM")) is not None:
                self.hwm[rank] = max(self.hwm.get(rank, 0), hwm)

    def mark(self, name: str) -> None:
        if name not in self.marks:
            self.marks[name] = {
                rank: _status(pid).get("VmHWM", self.hwm.get(rank, 0)) for pid, rank in self.ranks.items()
            }


def _read_output(proc: subprocess.Popen, watch: Watch, log) -> None:
    """Timestamps every line (tqdm's carriage returns split lines too) and marks load and training end."""
    buffer = b""
    while chunk := proc.stdout.read1(65536):
        log.write(chunk)
        buffer += chunk
        *complete, buffer = re.split(rb"[\r\n]", buffer)
        for raw in complete:
            text = raw.decode("utf-8", "replace")
            watch.lines.append((time.monotonic() - watch.started, text))
            if _STEP_LINE.match(text):
                watch.mark("load")
            elif _END_LINE.search(text):
                watch.mark("train")


def _poll_until_exit(proc: subprocess.Popen, watch: Watch, timeout_s: float, min_available: int) -> None:
    while proc.poll() is None:
        watch.poll(proc.pid)
        available = available_memory()
        watch.min_available = min(available, watch.min_available or available)
        elapsed = time.monotonic() - watch.started
        reason = (
            f"MemAvailable fell to {available / GIB:.2f} GiB"
            if available < min_available
            else f"still running after {timeout_s:.0f} s"
            if elapsed > timeout_s
            else None
        )
        if reason:
            rss = {watch.ranks[pid]: _status(pid).get("VmRSS", 0) for pid in watch.ranks}
            watch.killed = f"killed by the watchdog after {elapsed:.0f} s: {reason}; ranks at RSS " + ", ".join(
                f"r{r} {b / GIB:.2f} GiB" for r, b in sorted(rss.items())
            )
            # the launcher's ranks run in sessions of their own: the group kill does not reach them
            for pid in {*_descendants(proc.pid), *watch.ranks}:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.1)


def run_one(
    name: str, cmd: list[str], env: dict[str, str], log_path: Path, *, timeout_s: float, min_available: int
) -> dict:
    """Runs ``cmd`` in its own session under the watchdog; returns the raw measurements."""
    watch = Watch(started=time.monotonic())
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        reader = threading.Thread(target=_read_output, args=(proc, watch, log), daemon=True)
        reader.start()
        _poll_until_exit(proc, watch, timeout_s, min_available)
        returncode = proc.wait()
        reader.join(timeout=30)
    return {
        "name": name,
        "cmd": cmd,
        "env": env,
        "returncode": returncode,
        "killed": watch.killed,
        "seconds": round(time.monotonic() - watch.started, 1),
        "min_available": watch.min_available,
        "hwm": watch.hwm,
        "marks": watch.marks,
        "timing": timings(watch.lines),
        "estimate": [t for _, t in watch.lines if t.startswith(_ESTIMATE_PREFIXES)],
        "tail": [t for _, t in watch.lines if t.strip()][-25:],
        "log": str(log_path),
    }


def timings(lines: list[tuple[float, str]]) -> dict:
    """Step and load times from when rank 0's step log lines arrived (see the module docstring)."""
    steps = [t for t, text in lines if _STEP_LINE.match(text)]
    if not steps:
        return {"steps_logged": 0}
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    step = statistics.median(gaps) if gaps else None
    return {
        "steps_logged": len(steps),
        "first_step_line_s": round(steps[0], 2),
        "step_s": round(step, 2) if step is not None else None,
        "load_s": round(steps[0] - step, 2) if step is not None else None,
    }


# -- the two commands -------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_args(args: argparse.Namespace, output_dir: Path) -> list[str]:
    return [
        str(SCRIPT),
        "--model",
        str(args.model),
        "--max_steps",
        str(args.steps),
        "--batch_size",
        str(args.batch_size),
        "--max_length",
        str(args.max_length),
        "--log_every",
        "1",
        "--warmup_steps",
        "0",
        "--max_new_tokens",
        "1",
        "--output_dir",
        str(output_dir),
    ]


def commands(args: argparse.Namespace, work: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    import torch

    gpus = torch.cuda.is_available()
    zero = [
        sys.executable,
        "-m",
        "zero_plugin.launch.cli",
        "launch",
        "--stage",
        "3",
        "--num_processes",
        "2",
        "--main_process_port",
        str(_free_port()),
        *script_args(args, work / "zero3"),
    ]
    ddp = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--main_process_port",
        str(_free_port()),
        *script_args(args, work / "ddp"),
    ]
    return {"zero3": (zero, {}), "ddp": (ddp, {} if gpus else {"ACCELERATE_USE_CPU": "true"})}


# -- report ---------------------------------------------------------------------------------------------
def summarize(raw: dict, full_copy: int) -> dict:
    """Per-rank peaks, status and the ratio of the training peak to one full copy of the weights."""
    load, train = raw["marks"].get("load", {}), raw["marks"].get("train", {})
    ranks = [
        {"rank": r, "load_peak": load.get(r), "train_peak": train.get(r), "script_peak": raw["hwm"][r]}
        for r in sorted(raw["hwm"])
    ]
    failure = raw["killed"] or (f"exit code {raw['returncode']}" if raw["returncode"] != 0 else None)
    if failure is None:
        status = "ok"
    elif train:
        status = f"trained; then {failure} in the example's epilogue (after training)"
    else:
        status = f"failed: {failure}"
    peak = max((r["train_peak"] for r in ranks if r["train_peak"]), default=None)
    return {
        "name": raw["name"],
        "status": status,
        "trained": bool(train),
        "ranks": ranks,
        "train_peak_max": peak,
        "ratio_to_full_copy": round(peak / full_copy, 3) if peak else None,
        "timing": raw["timing"],
    }


def planner_peaks(model: Path, batch: int, seq: int) -> dict[int, float]:
    """The planner's per-rank peak for a frozen base (LoRA-like, [Note: two rows at launch]) at stages 0 and 3."""
    import torch

    from zero_plugin.config import ZeroConfig
    from zero_plugin.launch.estimate import Machine, _model_config, launched_row, plan_launch

    gpu = torch.cuda.is_available()
    machine = Machine(host_bytes=float("inf"), gpu_bytes=float("inf") if gpu else None)
    peaks = {}
    for stage in (0, 3):
        plan = plan_launch(_model_config(str(model)), ZeroConfig(stage=stage), 2, machine, batch=batch, seq=seq)
        row = launched_row(plan["frozen"], plan["setting"])
        peaks[stage] = row["peak"]["device" if gpu else "total"]
    return peaks


def _gib(n: float | None) -> str:
    return "—" if n is None else f"{n / GIB:.2f}"


def render(report: dict) -> str:
    m, full = report["machine"], report["model"]["full_copy_bytes"]
    params = report["model"]["params"]
    size = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params:,}"
    lines = [
        f"# LoRA on a {size}-parameter Llama ({full / 1e9:.2f} GB fp32): zero_plugin stage 3 against DDP, 2 processes",
        "",
        f"{report['date']}; {m['cpus']} cores, MemTotal {_gib(m['mem_total'])} GiB, load averages "
        f"{m['loadavg_before']} before / {m['loadavg_after']} after; torch {m['torch']}, transformers "
        f"{m['transformers']}, peft {m['peft']}.",
        f"Model `{report['model']['path']}` (benchmarks/write_llama_checkpoint.py); one full fp32 copy "
        f"{_gib(full)} GiB. Script: the unmodified `examples/finetune_trainer.py` (LoRA r=16 on every "
        f"linear layer), {report['args']['steps']} steps of batch {report['args']['batch_size']} x "
        f"{report['args']['max_length']} tokens per rank.",
        "",
        "| run | status | rank | peak RSS at first step, GiB | through training, GiB | whole script, GiB | "
        "training peak / full copy | load s | step s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        t = run["timing"]
        for i, r in enumerate(
            run["ranks"] or [{"rank": "—", "load_peak": None, "train_peak": None, "script_peak": None}]
        ):
            ratio = f"{r['train_peak'] / full:.2f}" if r["train_peak"] else "—"
            lines.append(
                f"| {run['name'] if i == 0 else ''} | {run['status'] if i == 0 else ''} | {r['rank']} | "
                f"{_gib(r['load_peak'])} | {_gib(r['train_peak'])} | {_gib(r['script_peak'])} | {ratio} | "
                f"{t.get('load_s', '—') if i == 0 else ''} | {t.get('step_s', '—') if i == 0 else ''} |"
            )
    lines += ["", *_verdict(report), "", *_definitions(report)]
    return "\n".join(lines) + "\n"


def _verdict(report: dict) -> list[str]:
    full, planned = report["model"]["full_copy_bytes"], report.get("planner") or {}
    out = []
    for run in report["runs"]:
        if run["name"] == "zero3" and run["ratio_to_full_copy"] is not None:
            out.append(
                f"**zero3: the highest rank's training peak is {run['ratio_to_full_copy']:.2f} of one full "
                f"copy** (target <= 0.6)."
            )
        if not run["trained"]:
            need = f"at least 2 x {_gib(full)} = {_gib(2 * full)} GiB for the weights alone"
            if planned.get(0):
                need += f"; the planner's stage-0 frozen-base peak is {_gib(planned[0])} GiB per rank"
            out.append(
                f"{run['name']}: {run['status']}: would need {need} "
                f"(MemTotal {_gib(report['machine']['mem_total'])} GiB)."
            )
    if planned:
        out.append(
            f"Planner (frozen base, as under LoRA): {_gib(planned.get(3))} GiB per rank at stage 3, "
            f"{_gib(planned.get(0))} GiB at stage 0 (DDP)."
        )
    for run in report["runs"]:
        if run.get("estimate"):
            out += [
                "",
                f"`zero-plugin launch` printed before starting the {run['name']} processes:",
                "```",
                *run["estimate"],
                "```",
            ]
    return out


def _definitions(report: dict) -> list[str]:
    return [
        "Columns: peaks are each rank's VmHWM (kernel peak RSS) read when rank 0 logged the first step (the "
        "load, including that step), when the Trainer printed its end-of-training metrics (through training), "
        "and at the rank's exit (the whole script: rank 0 then also reloads a full base model to check the "
        "adapter). "
        "Each peak includes the interpreter, torch and transformers (~0.4 GiB per process here). "
        "step s: median gap between step log lines; load s: first step line minus one step, from the launch. "
        f"A watchdog kills a run when MemAvailable falls under {report['args']['min_available_gib']} GiB.",
        "",
        "Commands:",
        "",
        *[f"    {' '.join(c)}" for c in report["commands"]],
    ]


def _machine(before: str) -> dict:
    import peft
    import torch
    import transformers

    with open("/proc/meminfo", encoding="ascii") as f:
        total = int(dict(line.split(":", 1) for line in f)["MemTotal"].split()[0]) * 1024
    return {
        "cpus": os.cpu_count(),
        "mem_total": total,
        "loadavg_before": before,
        "loadavg_after": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a folder written by write_llama_checkpoint.py")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps (>= 2 for a step time)")
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--max_length", type=int, default=64)
    ap.add_argument("--runs", nargs="+", choices=("zero3", "ddp"), default=["zero3", "ddp"])
    ap.add_argument("--min_available_gib", type=float, default=2.0, help="watchdog: kill a run under this")
    ap.add_argument("--timeout_s", type=float, default=3600.0, help="watchdog: kill a run after this")
    ap.add_argument("--out", type=Path, default=RESULTS / "large_model", help="writes OUT.md and OUT.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    index = json.loads((args.model / "model.safetensors.index.json").read_text(encoding="utf-8"))
    full_copy = int(index["metadata"]["total_size"])
    before = " ".join(f"{v:.2f}" for v in os.getloadavg())
    try:
        planned = planner_peaks(args.model, args.batch_size, args.max_length)
    except Exception as exc:  # noqa: BLE001 - the planner's figure is context; the runs are the result
        print(f"large_model: no planner estimate: {exc}", file=sys.stderr)
        planned = {}
    work = Path(tempfile.mkdtemp(prefix="large_model_"))
    cmds = commands(args, work)
    runs = []
    for name in args.runs:
        cmd, env = cmds[name]
        print(f"large_model: {name}: {' '.join(cmd)}  (log {work / f'{name}.log'})", flush=True)
        raw = run_one(
            name,
            cmd,
            env,
            work / f"{name}.log",
            timeout_s=args.timeout_s,
            min_available=int(args.min_available_gib * GIB),
        )
        runs.append({**summarize(raw, full_copy), "raw": raw, "estimate": raw["estimate"]})
        print(f"large_model: {name}: {runs[-1]['status']}", flush=True)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": _machine(before),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": {"path": str(args.model), "params": full_copy // 4, "full_copy_bytes": full_copy},
        "planner": planned,
        "runs": runs,
        "commands": [[*(f"{k}={v}" for k, v in cmds[n][1].items()), *cmds[n][0]] for n in args.runs],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text(render(report), encoding="utf-8")
    print(f"large_model: wrote {args.out.with_suffix('.md')} and .json; logs and outputs in {work}")
    return report


if __name__ == "__main__":
    main()
