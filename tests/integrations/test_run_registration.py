"""``python -m zero_plugin.run`` registers the Lightning strategy names before an unmodified script runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "lightning_env_strategy.py"


def test_pl_trainer_strategy_env_switches_an_unmodified_script():
    env = dict(os.environ, PL_TRAINER_STRATEGY="zero3")
    out = subprocess.run(
        [sys.executable, "-m", "zero_plugin.run", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "STRATEGY ZeroStrategy 3" in out.stdout, out.stdout + out.stderr[-2000:]
