"""Step time of zero_plugin against itself at another revision, in the same run.

    python -m benchmarks.ab --base ce2f6e3 --size blocks34m --stages 1 2 3

Exports ``zero_plugin/`` at ``--base`` (``git archive``) into a temporary folder as the package
``zero_plugin_base`` (the package imports itself only relatively), then runs ``benchmarks.compare`` with
the variants ``zpN`` (this tree) and ``zpN_base`` interleaved round by round, so that machine noise hits
both alike.  The report (``benchmarks/results/ab-<size>.md`` unless ``--out``) has one row per variant;
the ratio that matters is ``zpN`` / ``zpN_base``, printed at the end.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from . import compare
from .variants import BASELINE_ENV

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "zero_plugin_base"


def _export(rev: str, into: Path) -> None:
    tar = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "zero_plugin"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(into, filter="data")
    (into / "zero_plugin").rename(into / PACKAGE)


def _per_round(raw: dict, variant: str, kind: str) -> dict[int, float]:
    """Median step of ``variant`` in each round (``kind``: "total" wall seconds, "cpu" process CPU seconds or
    "faults" minor page faults), over all its timed steps and ranks."""
    steps: dict[int, list[float]] = {}
    for rec in raw["records"]:
        if rec["variant"] == variant:
            steps.setdefault(rec["round"], []).extend(rec.get("times", {}).get(kind, []))
    return {r: statistics.median(v) for r, v in steps.items() if v}


def _ratios(report: Path, stages: list[int]) -> list[str]:
    """Both the ratio of medians over all rounds and the paired ratio per round (this tree and the base ran
    back to back in each round, so a round's ratio cancels the load that round had); CPU time as well as
    wall time, since other jobs on the machine disturb CPU time far less."""
    raw = json.loads(report.with_suffix(".json").read_text())
    lines = []
    for stage in stages:
        for kind, label in (("total", "wall"), ("cpu", "CPU")):
            new, base = _per_round(raw, f"zp{stage}", kind), _per_round(raw, f"zp{stage}_base", kind)
            rounds = sorted(set(new) & set(base))
            if not rounds:
                continue
            paired = [new[r] / base[r] for r in rounds]
            overall = statistics.median(new.values()) / statistics.median(base.values())
            lines.append(
                f"stage {stage} {label}: {statistics.median(new.values()):.4f} s vs "
                f"{statistics.median(base.values()):.4f} s at the base revision: {overall:.3f}x; "
                f"per round {', '.join(f'{x:.3f}' for x in paired)} (median {statistics.median(paired):.3f}x)"
            )
        lines += _fault_line(raw, stage)
    return lines


def _fault_line(raw: dict, stage: int) -> list[str]:
    """Minor page faults per step and rank (median), this tree, the base and DDP: not moved by the load."""
    medians = {}
    for name in (f"zp{stage}", f"zp{stage}_base", "ddp"):
        per_round = _per_round(raw, name, "faults")
        if not per_round:
            return []  # a report recorded before faults were counted
        medians[name] = statistics.median(per_round.values())
    new, base, ddp = medians.values()
    return [
        f"stage {stage} page faults per step and rank: {new / 1e3:.1f}k vs {base / 1e3:.1f}k at the base "
        f"revision ({new / base:.3f}x); DDP {ddp / 1e3:.1f}k ({new / ddp:.2f}x DDP, base {base / ddp:.2f}x DDP)"
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="git revision to compare against")
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--out", type=Path, default=None)
    args, rest = p.parse_known_args(argv)
    size = next((rest[i + 1] for i, a in enumerate(rest[:-1]) if a == "--size"), "small")
    out = args.out or compare.RESULTS / f"ab-{size}.md"
    variants = ["ddp"] + [name for s in args.stages for name in (f"zp{s}_base", f"zp{s}")]
    with tempfile.TemporaryDirectory(prefix="zp-ab-") as tmp:
        _export(args.base, Path(tmp))
        sys.path.insert(0, tmp)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))
        os.environ[BASELINE_ENV] = PACKAGE
        compare.main([*rest, "--variants", *variants, "--out", str(out)])
    lines = _ratios(out, args.stages)
    with out.open("a") as f:
        f.write(f"\nBase revision: `{args.base}`.\n\n" + "".join(f"- {line}\n" for line in lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
