"""TRL's ``DPOTrainer`` (PEFT policy, separate reference model) under ``zero-plugin launch --stage 3`` against
its plain DDP run (``accelerate launch --multi_gpu``), 2 CPU processes, same seed (issue 19, item 6).

TRL prepares the reference model with ``accelerator.prepare_model(ref_model, evaluation_mode=True)``; at stage
3 that shards it for evaluation only ([Note: evaluation-only models] in zero_plugin/stage3/inference.py).
The script (``scripts/dpo_trl.py``, no zero_plugin in it) reports the bytes each rank's reference model
holds: half the model at stage 3 on 2 ranks, the whole model under DDP.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
from pathlib import Path

import pytest

from tests.integrations.launches import DDP, run_script, zero

SCRIPT = Path(__file__).resolve().parent / "scripts" / "dpo_trl.py"
LAUNCHES = {"ddp": DDP, "stage3": zero(3)}


def _launch(name: str, out: Path) -> subprocess.CompletedProcess:
    return run_script(LAUNCHES[name], SCRIPT, out, "--max_steps", "4", timeout=600, threads=None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(_launch, name, root / name) for name in LAUNCHES}
        done = {name: f.result() for name, f in futures.items()}
    for name, proc in done.items():
        assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return root


def _result(root: Path, name: str) -> tuple[dict, list[dict]]:
    info = json.loads((root / name / "result.json").read_text())
    memory = [json.loads((root / name / f"memory-rank{r}.json").read_text()) for r in range(2)]
    return info, memory


def test_dpo_losses_equal_ddp(runs):
    ddp, _ = _result(runs, "ddp")
    zero, _ = _result(runs, "stage3")
    assert ddp["world_size"] == zero["world_size"] == 2
    assert ddp["accelerator_class"] == "accelerate.accelerator"
    assert zero["accelerator_class"] == "zero_plugin.integrations.accelerate"
    steps = [h for h in ddp["log_history"] if "loss" in h]
    got = [h for h in zero["log_history"] if "loss" in h]
    assert len(steps) == len(got) == 4
    for want, have in zip(steps, got):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "grad_norm"):
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (key, want, have)
    assert steps[0]["rewards/margins"] != 0  # the reference differs from the policy: it moves the loss


def test_reference_model_is_sharded(runs):
    _, ddp = _result(runs, "ddp")
    _, zero = _result(runs, "stage3")
    full = ddp[0]["ref_full_bytes"]
    assert all(m["ref_param_bytes"] == full for m in ddp)
    for m in zero:  # 1/2 of the model, padding at most one element per parameter (21 tensors)
        assert full / 2 - 21 * 4 <= m["ref_param_bytes"] <= full / 2 + 21 * 4, (m, full)
