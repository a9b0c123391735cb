"""``benchmarks/heap_budget.py`` and ``benchmarks/min_step.py`` run under torchrun and report what issue #21's
readings rely on."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests import launching

REPO = Path(__file__).resolve().parents[2]
# port 0: launching.run gives the launch a port of its own (tests/launching.py)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0"]


@pytest.mark.parametrize("variant", ["ddp", "zp"])
def test_heap_budget_reports_each_step(variant):
    command = [*TORCHRUN, "-m", "benchmarks.heap_budget", "--variant", variant, "--size", "smoke", "--steps", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = launching.run(command, cwd=REPO, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["variant"] == ("ddp" if variant == "ddp" else "zp3")
        assert r["saved_activations_MiB"] > 0 or r["forward_end_heap_in_use_MiB"] > 0
        assert r["peak_MiB"] >= r["forward_end_MiB"] - 1  # the step's peak includes the forward's end


@pytest.mark.parametrize("variant", ["ddp", "zp3"])
def test_min_step_reports_the_fastest_step(variant):
    """``benchmarks/min_step.py`` (the A/B probe of issue #21's step-time work) runs and reports one line."""
    command = [*TORCHRUN, "-m", "benchmarks.min_step", "--variant", variant, "--size", "smoke", "--steps", "5"]
    if variant != "ddp":
        command += ["--set", "trim_host_heap=false"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = launching.run(command, cwd=REPO, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert row["variant"] == variant
    assert 0 < row["min_cpu_s"] <= row["p25_cpu_s"] and row["min_wall_s"] > 0
    assert row["peak_rss_increase_MiB"] > 0
