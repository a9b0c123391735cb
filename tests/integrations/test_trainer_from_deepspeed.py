"""An unmodified HF Trainer script resumes a checkpoint the HF Trainer wrote under DeepSpeed ZeRO-3 (issue 40).

``tests/fixtures/deepspeed/hf_trainer/checkpoint-2`` was written by transformers' Trainer with DeepSpeed 0.19.8
at world size 2 (``make_hf_trainer_ckpt.py``): ``global_step2/`` + ``latest``, ``scheduler.pt``,
``trainer_state.json``, ``rng_state_<r>.pth``, no weights file.  ``zero-plugin launch --stage 3`` in one
process (the global batch kept) runs ``scripts/trainer_from_deepspeed.py`` with ``resume_from_checkpoint`` on
it: the weights and Adam state come from DeepSpeed's files, the schedule and step from the Trainer's, and the
losses of the steps after the resume equal those of DeepSpeed's own resumed run (2 ranks).  One process keeps
the launch short (~15 s); resuming at other world sizes and stages is checked in
``tests/unit/test_deepspeed_checkpoint.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from tests import launching

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "integrations" / "scripts" / "trainer_from_deepspeed.py"
FIXTURE = REPO / "tests" / "fixtures" / "deepspeed" / "hf_trainer"
CONSOLE = Path(sys.executable).parent / "zero-plugin"
ZERO_LAUNCH = [str(CONSOLE)] if CONSOLE.exists() else [sys.executable, "-m", "zero_plugin.launch.cli"]


def test_trainer_resumes_a_deepspeed_zero3_checkpoint_at_stage_3_in_one_process(tmp_path):
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(FIXTURE / "checkpoint-2", ckpt)
    out = tmp_path / "out"
    cmd = [*ZERO_LAUNCH, "launch", "--stage", "3", "--num_processes", "1", "--main_process_port", "0"]
    cmd += [str(SCRIPT), "--out", str(out), "--resume", str(ckpt)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_PLUGIN_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = launching.run(cmd, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads((out / "result.json").read_text())
    expected = json.loads((FIXTURE / "expected.json").read_text())["resumed_losses"]
    assert result["world_size"] == 1
    assert sorted(result["losses"]) == sorted(expected)  # steps 1-2 from trainer_state.json, 3-4 trained here
    for step, loss in expected.items():
        assert abs(result["losses"][step] - loss) <= 1e-4 * abs(loss), (step, result["losses"][step], loss)
