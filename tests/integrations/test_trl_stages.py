"""TRL's trainers, unchanged, at stages 1, 2, 3 and 3 + offload against their DDP run (issue 37): one launch per
setting (``scripts/trl_stages.py``: ``SFTTrainer``, ``DPOTrainer``, then ``GRPOTrainer`` generating in the trainer;
LoRA, TRL's fused LM head, gradient checkpointing on as TRL defaults), 2 CPU processes, same seed, real-shaped
Llamas (vocab 4096 x hidden 256: the SFT and GRPO models' untied heads are stage-3 units of their own, the DPO
model's tied head is in the root unit).  Losses, DPO and GRPO rewards (GRPO's: equal only if the sampled
completions are) and grad norms step for step, and the saved adapters.  Before stage 3 read the head outside its
forward ([Note: direct reads of the output embedding] in zero_plugin/stage3/direct_reads.py) its SFT run failed
at step 1 with ``RuntimeError: mat2 must be a matrix``.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.integrations.launches import DDP, run_script, zero

SCRIPT = Path(__file__).resolve().parent / "scripts" / "trl_stages.py"
STEPS = 3
SETTINGS = {
    "ddp": DDP,
    "stage1": zero(1),
    "stage2": zero(2),
    "stage3": zero(3),
    "stage3_offload": zero(3, "--offload", "cpu"),
}
KEYS = {
    "sft": ("loss", "grad_norm", "entropy", "mean_token_accuracy"),
    "dpo": ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"),
    "grpo": ("loss", "grad_norm", "reward", "reward_std", "entropy"),
}


def _launch(name: str, out: Path) -> subprocess.CompletedProcess:
    return run_script(SETTINGS[name], SCRIPT, out, "--max_steps", str(STEPS))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_stages")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # 2 ranks each: one launch at a time on 2 cores
        futures = {name: pool.submit(_launch, name, root / name) for name in SETTINGS}
        done = {name: f.result() for name, f in futures.items()}
    for name, proc in done.items():
        assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return root


def _steps(root: Path, name: str, trainer: str) -> list[dict]:
    info = json.loads((root / name / "result.json").read_text())
    assert info["world_size"] == 2
    # zero_plugin.run patched TRL's vLLM weight sync (integrations/trl_vllm.py) in every launch it ran
    assert info["vllm_sync"].startswith("zero_plugin" if name != "ddp" else "trl"), info["vllm_sync"]
    return [h for h in info[trainer] if "loss" in h]


def _adapter(root: Path, name: str, trainer: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(root / name / trainer / "adapter_model.safetensors")


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s != "ddp"])
@pytest.mark.parametrize("trainer", list(KEYS))
def test_trl_trainer_equals_ddp(runs, setting, trainer):
    want, got = _steps(runs, "ddp", trainer), _steps(runs, setting, trainer)
    assert len(want) == len(got) == STEPS
    for step, (w, g) in enumerate(zip(want, got)):
        for key in KEYS[trainer]:
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), (trainer, setting, step, key, w, g)
    assert [want[0][k] for k in KEYS[trainer]] != [want[-1][k] for k in KEYS[trainer]]
    ref, adapter = _adapter(runs, "ddp", trainer), _adapter(runs, setting, trainer)
    assert adapter.keys() == ref.keys() and len(ref) > 0
    for name, value in ref.items():
        diff = (adapter[name] - value).abs().max().item()
        assert diff <= 1e-5 * max(1.0, value.abs().max().item()), (trainer, setting, name, diff)
