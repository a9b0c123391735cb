"""Where a large-model run's memory goes over time: per-rank RSS split into anonymous and file-backed pages.

    python -m benchmarks.rss_trace --model /data/llama-3b --out /tmp/trace-default
    python -m benchmarks.rss_trace --model /data/llama-3b --out /tmp/trace-p0 --env ZERO_PLUGIN_PREFETCH_DEPTH=0

Runs the unmodified ``examples/finetune_trainer.py`` (LoRA) under ``zero-plugin launch --stage 3`` on 2
processes, as ``benchmarks/large_model.py`` does, and samples ``/proc/PID/status`` of every rank every 0.2 s
(``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile``, MiB) into ``OUT.tsv``, with the launcher's output lines
timestamped on the same clock in ``OUT.log``.  The run is stopped once the Trainer printed its
end-of-training metrics (the example's epilogue reloads a full base model on rank 0, which is not training).
At the end it prints, per rank, the peak during setup (before the first step line), the peak through
training, and the resting RSS between steps (the lowest sample after the first step).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from .large_model import _descendants, _rank_of, script_args

_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def _sample(pid: int) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            return {k: int(v.split()[0]) // 1024 for k, v in (line.split(":", 1) for line in f) if k in _KEYS}
    except (OSError, ValueError):
        return {}


def _command(args: argparse.Namespace) -> list[str]:
    """``benchmarks/large_model.py``'s zero3 command: the same script options, 1 x 64 tokens per rank."""
    launch = [sys.executable, "-m", "zero_plugin.launch.cli", "launch", "--stage", "3", "--num_processes", "2"]
    options = argparse.Namespace(model=args.model, steps=args.steps, batch_size=1, max_length=64)
    return [*launch, "--main_process_port", "0", *script_args(options, Path(f"{args.out}_run"))]


def trace(args: argparse.Namespace) -> list[tuple[float, int, dict[str, int]]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.update(kv.split("=", 1) for kv in args.env)
    t0 = time.time()
    proc = subprocess.Popen(
        _command(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    marks: dict[str, float] = {}
    log = open(f"{args.out}.log", "w", encoding="utf-8")

    def read() -> None:
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            now = time.time() - t0
            log.write(f"{now:8.2f} {line}")
            log.flush()
            if "'loss': " in line and "'train_loss'" not in line:
                marks.setdefault("first_step", now)
            if "'train_loss'" in line:
                marks.setdefault("end", now)

    threading.Thread(target=read, daemon=True).start()
    ranks: dict[int, int] = {}
    samples = []
    with open(f"{args.out}.tsv", "w", encoding="ascii") as out:
        out.write("t\trank\t" + "\t".join(_KEYS) + "\n")
        while proc.poll() is None and ("end" not in marks or time.time() - t0 < marks["end"] + 2):
            for pid in _descendants(proc.pid):
                if pid not in ranks and (rank := _rank_of(pid)) is not None:
                    ranks[pid] = rank
            for pid, rank in ranks.items():
                if s := _sample(pid):
                    now = time.time() - t0
                    samples.append((now, rank, s))
                    out.write(f"{now:.2f}\t{rank}\t" + "\t".join(str(s.get(k, 0)) for k in _KEYS) + "\n")
            time.sleep(0.2)
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
    return _summary(samples, marks)


def _summary(samples, marks: dict[str, float]):
    first = marks.get("first_step", float("inf"))
    for rank in sorted({r for _, r, _ in samples}):
        mine = [(t, s) for t, r, s in samples if r == rank]
        setup = max((s["VmRSS"] for t, s in mine if t < first), default=0)
        training = max((s["VmHWM"] for _, s in mine), default=0)
        rest = min((s["VmRSS"] for t, s in mine if t > first), default=0)
        file_peak = max((s["RssFile"] for _, s in mine), default=0)
        print(
            f"rank {rank}: setup peak {setup} MiB, peak through training {training} MiB, resting between "
            f"steps {rest} MiB, largest file-backed RSS {file_peak} MiB"
        )
    return samples


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rss_trace", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="prefix of OUT.tsv and OUT.log")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--env", nargs="*", default=[], help="VAR=VALUE for the run (e.g. ZERO_PLUGIN_PREFETCH_DEPTH=0)")
    trace(p.parse_args(argv))


if __name__ == "__main__":
    main()
