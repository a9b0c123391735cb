"""``benchmarks/host_ops.py`` (issue #39's measurement) runs end to end on a small Llama in a few seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_host_ops_counts_every_variant(tmp_path):
    out = tmp_path / "host_ops.md"
    command = [sys.executable, "-m", "benchmarks.host_ops", "--layers", "1", "--hidden", "32", "--vocab", "256"]
    command += ["--seq", "16", "--steps", "1", "--out", str(out)]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {(r["variant"], r["model"]): r for r in map(json.loads, filter(None, _json_lines(run.stdout)))}
    assert set(rows) == {(v, "base") for v in ("plain", "zp3", "fsdp2", "zp1", "zp2", "ddp")} | {
        (v, m) for v in ("plain", "zp3", "fsdp2") for m in ("deep", "bias")
    }
    assert rows[("plain", "base")]["collectives"] == 0 and rows[("plain", "base")]["hooks"] == 0
    for variant in ("zp3", "fsdp2", "zp1", "zp2", "ddp"):
        row = rows[(variant, "base")]
        assert row["collectives"] > 0 and row["ops"] > rows[("plain", "base")]["ops"], row
    # a deeper model costs a framework more ops: the per-layer figure is measurable
    assert rows[("zp3", "deep")]["ops"] > rows[("zp3", "base")]["ops"]
    # issue #39's bar, on counts (no timing): stage 3 adds no more ops than FSDP2 on every model, stages 1-2 no
    # more than DDP, and a unit's ops do not grow with its parameters (biases: 16 per layer instead of 9)
    plain = {m: rows[("plain", m)]["ops"] for m in ("base", "deep", "bias")}
    for model in ("base", "deep", "bias"):
        zp3, fsdp2 = rows[("zp3", model)]["ops"] - plain[model], rows[("fsdp2", model)]["ops"] - plain[model]
        assert zp3 <= fsdp2, f"{model}: stage 3 adds {zp3} ops per step, FSDP2 {fsdp2}"
    for variant in ("zp1", "zp2"):
        assert rows[(variant, "base")]["ops"] <= rows[("ddp", "base")]["ops"], (variant, rows[(variant, "base")])
    assert rows[("zp3", "bias")]["ops"] - plain["bias"] == rows[("zp3", "base")]["ops"] - plain["base"]
    text = out.read_text()
    assert "| base | zp3 |" in text and "per decoder layer" in text


def _json_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("{")]
