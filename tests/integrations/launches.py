"""How the integration tests start a script on 2 CPU processes: plain DDP (``accelerate launch --multi_gpu``) or
``zero-plugin launch --stage S``, and one launch of a script with its output folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import launching

PY = sys.executable
CONSOLE = Path(PY).parent / "zero-plugin"
ZERO_LAUNCH = [str(CONSOLE)] if CONSOLE.exists() else [PY, "-m", "zero_plugin.launch.cli"]
TWO = ["--num_processes", "2", "--main_process_port", "0"]
DDP = ([PY, "-m", "accelerate.commands.launch", "--multi_gpu", *TWO], {"ACCELERATE_USE_CPU": "true"})


def zero(stage: int, *options: str) -> tuple[list[str], dict]:
    """``zero-plugin launch --stage S`` on 2 processes (``options``: e.g. ``--offload cpu``), no extra env."""
    return [*ZERO_LAUNCH, "launch", "--stage", str(stage), *options, *TWO], {}


def run_script(
    launcher: tuple[list[str], dict], script: Path, out: Path, *args: str, timeout: int = 900, threads: int | None = 1
) -> subprocess.CompletedProcess:
    """``launcher`` running ``script --out OUT *args``; ``threads``: OMP_NUM_THREADS of the ranks (None: inherited)."""
    cmd, env = launcher
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **env, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    return launching.run([*cmd, str(script), "--out", str(out), *args], timeout=timeout, env=env)
