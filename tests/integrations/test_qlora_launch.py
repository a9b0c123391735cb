"""QLoRA under ``zero-plugin launch --stage 3`` (issue 19, item 9): ``scripts/qlora_accelerate.py``, a plain
Accelerate script with a bitsandbytes 4-bit base and PEFT LoRA, on 2 CPU processes against the same script in
one process on the concatenated batches (bitsandbytes' CPU backend runs the 4-bit matmuls).  Losses rtol 1e-5;
the saved adapters (``save_pretrained`` on every rank) to 1e-5 of their update.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
from pathlib import Path

import torch

from tests import launching, qlora
from tests.unit import qlora_workers as w

SCRIPT = Path(__file__).resolve().parent / "scripts" / "qlora_accelerate.py"
PY = sys.executable
CONSOLE = Path(PY).parent / "zero-plugin"
ZERO_LAUNCH = [str(CONSOLE)] if CONSOLE.exists() else [PY, "-m", "zero_plugin.launch.cli"]


def _run(cmd: list[str], cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_PLUGIN_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = launching.run(cmd, env=env, cwd=cwd, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}"


def test_qlora_script_under_zero_plugin_launch_stage3_matches_one_process(tmp_path):
    from peft import PeftModel

    base = tmp_path / "base"
    qlora.save_base(str(base))
    single, sharded = tmp_path / "single", tmp_path / "stage3"
    single.mkdir(), sharded.mkdir()
    one_process = [PY, str(SCRIPT), "--base", str(base), "--out", str(single), "--batch_size", "4"]
    stage3 = (
        [
            *ZERO_LAUNCH,
            "launch",
            "--cpu",
            "--stage",
            "3",
            "--num_processes",
            "2",
            "--main_process_port",
            "0",
            str(SCRIPT),
            "--base",
            str(base),
            "--out",
            str(sharded),
            "--batch_size",
            "2",
        ],
        sharded,
    )
    # Side by side: one after the other, the one-process reference (one thread) left a core of two idle.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(_run, one_process, single), pool.submit(_run, *stage3)]:
            future.result()
    want, got = (json.loads((d / "losses.json").read_text()) for d in (single, sharded))
    assert len(got) == len(want) == 3
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: stage-3 loss {a} != one-process loss {b}"
    initial = w.lora_weights(qlora.load_qlora(str(base)).state_dict())
    adapters = [
        w.lora_weights(PeftModel.from_pretrained(qlora.load_base(str(base)), d / "adapter").state_dict())
        for d in (single, sharded)
    ]
    num = sum(float((adapters[1][k] - adapters[0][k]).norm() ** 2) for k in initial) ** 0.5
    den = sum(float((adapters[0][k] - initial[k]).norm() ** 2) for k in initial) ** 0.5
    assert den > 0 and num / den < 1e-5, f"saved adapters differ by {num / den:.3g} of their update"
    assert all(torch.isfinite(v).all() for v in adapters[1].values())
