"""``scripts/trl_stages.py`` launched once per setting for the whole session, shared by the TRL modules:
``test_trl_stages.py`` (SFT, DPO, GRPO at every setting against DDP), ``test_trl_dpo.py`` (the DPO run's
reference model at stage 3 against DDP's) and ``test_trl_trainers.py`` (``trl_trainers.py``'s trainers, run by
the same launches with ``--more`` at DDP and stages 1 and 3).  Each launch starts 2 ranks that import TRL's
stack (~20 s of CPU before any training), so each setting is launched once, when a test first asks for it, and
what it wrote is read into memory (the conftest deletes a module's temporary folders when the module passes,
and the runs outlive the module that started them)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.integrations.launches import DDP, run_script, zero

SCRIPT = Path(__file__).resolve().parent / "scripts" / "trl_stages.py"
STEPS = 3
STAGE_TRAINERS = ("sft", "dpo", "grpo")
MORE_TRAINERS = (
    "rloo",
    "kto",
    "reward",
    "distill",
    "dpo_noref",
    "dpo_precompute",
    "sft_save_head",
    "sft_tokens",
    "sft_lora_embed",
    "sft_resized",
    "sft_bf16_weights",
)
SETTINGS = {
    "ddp": DDP,
    "stage1": zero(1),
    "stage2": zero(2),
    "stage3": zero(3),
    "stage3_offload": zero(3, "--offload", "cpu"),
}
# Stage 2 (gradients sharded as at stage 3, parameters whole as at stage 1) is bracketed by the two, and stage 3
# with offload by stage 3: trl_trainers.py's trainers are left out there to keep the suite's time.
WITH_MORE = ("ddp", "stage1", "stage3")
_ABORT_AT_EXIT = "terminate called without an active exception"


def _read(out: Path, trainers) -> SimpleNamespace:
    from safetensors.torch import load_file

    return SimpleNamespace(
        info=json.loads((out / "result.json").read_text()),
        adapters={t: load_file(out / t / "adapter_model.safetensors") for t in trainers},
        dpo_memory=[json.loads((out / "dpo" / f"memory-rank{r}.json").read_text()) for r in range(2)],
    )


class TrlStageRuns:
    """``get(setting)``: the launch's result, launched (one at a time: 2 ranks each on 2 cores) on first use."""

    def __init__(self, tmp_path_factory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.results: dict[str, SimpleNamespace | str] = {}
        self.lock = threading.Lock()

    def get(self, name: str) -> SimpleNamespace:
        with self.lock:
            if name not in self.results:
                self.results[name] = self._launch(name)
        result = self.results[name]
        if isinstance(result, str):
            pytest.fail(result)
        return result

    def _launch(self, name: str) -> SimpleNamespace | str:
        more = MORE_TRAINERS if name in WITH_MORE else ()
        args = ("--max_steps", str(STEPS), *(("--more", ",".join(more)) if more else ()))
        out = self.tmp_path_factory.mktemp(f"trl_{name}")
        proc = run_script(SETTINGS[name], SCRIPT, out, *args)
        if name == "ddp" and proc.returncode != 0 and _ABORT_AT_EXIT in proc.stdout + proc.stderr:
            # The plain-DDP reference (no zero_plugin code) trained and then aborted in torch's gloo teardown at
            # interpreter exit, now and then (CI stop 47 saw it once): run it again; our own launches get no retry.
            print(f"\nddp reference aborted at exit; its output:\n{proc.stderr[-3000:]}")
            out = self.tmp_path_factory.mktemp(f"trl_{name}_again")
            proc = run_script(SETTINGS[name], SCRIPT, out, *args)
        if proc.returncode != 0:
            return f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        return _read(out, STAGE_TRAINERS + more)
