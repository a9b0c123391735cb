"""HF Trainer checkpoints under zero_plugin, end to end with the real launchers and 2 CPU processes (gloo).

``scripts/trainer_best.py`` (a plain ``transformers.Trainer`` full fine-tune, no zero_plugin in it) saves and
evaluates every step with ``load_best_model_at_end=True`` and a metric that makes checkpoint-2 the best.

* ``load_best_model_at_end`` at stages 0, 1 and 3: training matches the same script under plain DDP, and at
  the end the model holds exactly the weights saved at checkpoint-2 (not those of the last step).
* A checkpoint written under zero_plugin (stage 2) keeps its optimizer state in ``checkpoint-N/zero_plugin/``.
  Resumed by a plain single-process Trainer (no zero_plugin), the run fails with a message naming
  zero_plugin and the fix instead of silently restarting the optimizer; resumed under
  ``zero-plugin launch`` it continues exactly.

All launches start together in a small thread pool (module fixture); tests wait for the ones they need.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests import launching

SCRIPT = Path(__file__).resolve().parent / "scripts" / "trainer_best.py"
PY = sys.executable
CONSOLE = Path(PY).parent / "zero-plugin"
ZERO_LAUNCH = [str(CONSOLE)] if CONSOLE.exists() else [PY, "-m", "zero_plugin.launch.cli"]
TWO = ["--num_processes", "2", "--main_process_port", "0"]
LAUNCH_TIMEOUT_S = 600
LOSS_RTOL = 1e-4
STAGES = (0, 1, 3)


def _zero(stage: int) -> list[str]:
    return [*ZERO_LAUNCH, "launch", "--stage", str(stage), *TWO]


# name -> (launch command before the script, script arguments, extra environment); {tmp} is filled in.
LAUNCHES = {
    "ddp": ([PY, "-m", "accelerate.commands.launch", "--multi_gpu", *TWO], [], {"ACCELERATE_USE_CPU": "true"}),
    **{f"stage{s}": (_zero(s), [], {}) for s in STAGES},
    # Checkpoints without load_best_model_at_end, resumed under zero_plugin and by a plain Trainer.
    "stage2": (_zero(2), ["--no_load_best"], {}),
    "stage2_resumed": (_zero(2), ["--no_load_best", "--resume", "{tmp}/stage2/checkpoint-2"], {}),
    "plain_resumed": ([PY], ["--no_load_best", "--resume", "{tmp}/stage2/checkpoint-2"], {}),
}
CHAINS = [["stage2", "plain_resumed", "stage2_resumed"], ["stage1", "stage0"], ["ddp", "stage3"]]


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_PLUGIN_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def _launch(tmp: Path, name: str) -> SimpleNamespace:
    prefix, args, extra = LAUNCHES[name]
    out = tmp / name
    out.mkdir()
    cmd = [*prefix, str(SCRIPT), "--out", str(out), *(a.format(tmp=tmp) for a in args)]
    start = time.monotonic()
    proc = launching.run(cmd, env=_env(extra), cwd=out, timeout=LAUNCH_TIMEOUT_S)
    return SimpleNamespace(
        name=name,
        out=out,
        cmd=cmd,
        returncode=proc.returncode,
        output=proc.stdout + proc.stderr,
        seconds=time.monotonic() - start,
    )


class Runs:
    """Each chain runs in order on its own thread; results are handed out by name."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=3)
        self.futures = {name: concurrent.futures.Future() for chain in CHAINS for name in chain}
        for chain in CHAINS:
            self.pool.submit(self._chain, chain)

    def _chain(self, chain: list[str]) -> None:
        for name in chain:
            try:
                self.futures[name].set_result(_launch(self.tmp, name))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting test
                self.futures[name].set_exception(exc)

    def any(self, name: str) -> SimpleNamespace:
        return self.futures[name].result(timeout=3 * LAUNCH_TIMEOUT_S)

    def ok(self, name: str) -> SimpleNamespace:
        result = self.any(name)
        if result.returncode != 0:
            pytest.fail(f"{name} failed (exit {result.returncode}): {' '.join(result.cmd)}\n{result.output[-6000:]}")
        return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    runner = Runs(tmp_path_factory.mktemp("trainer_ckpt"))
    yield runner
    runner.pool.shutdown(wait=True)


def _info(result) -> dict:
    return json.loads((result.out / "result.json").read_text())


def _history(info: dict, key: str) -> dict[int, float]:
    return {h["step"]: h[key] for h in info["log_history"] if key in h}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# -- load_best_model_at_end --------------------------------------------------------------------
@pytest.mark.parametrize("stage", STAGES)
def test_load_best_model_at_end_loads_the_best_checkpoint(runs, stage):
    run, ddp = runs.ok(f"stage{stage}"), runs.ok("ddp")
    info, ddp_info = _info(run), _info(ddp)
    assert info["accelerator_class"] == "zero_plugin.integrations.accelerate"
    assert info["world_size"] == ddp_info["world_size"] == 2 and info["global_step"] == 4
    assert info["best_model_checkpoint"] == str(run.out / "checkpoint-2")
    # Training is the DDP run's: losses, clipped grad norms, eval losses, the score that picks the best.
    for key in ("loss", "grad_norm", "eval_loss", "eval_score"):
        got, want = _history(info, key), _history(ddp_info, key)
        assert got.keys() == want.keys() == {1, 2, 3, 4}, key
        worst = max(abs(got[s] - want[s]) / max(abs(want[s]), 1e-12) for s in want)
        assert worst <= LOSS_RTOL, f"stage {stage} {key}: {got} vs DDP {want}"
    # The final model is checkpoint-2's, bit for bit, and checkpoint-2 is not the last step's weights.
    final, best, last = (_weights(run.out / f) for f in ("final", "checkpoint-2", "checkpoint-4"))
    assert _max_diff(final, best) == 0.0
    assert _max_diff(final, last) > 1e-3
    # The same best weights as DDP's (whose Trainer loads them itself).
    assert _max_diff(_weights(ddp.out / "final"), _weights(ddp.out / "checkpoint-2")) == 0.0
    assert _max_diff(best, _weights(ddp.out / "checkpoint-2")) < 1e-5


# -- a zero_plugin checkpoint resumed with and without zero_plugin -------------------------------
def test_plain_trainer_refuses_a_zero_plugin_checkpoint(runs):
    runs.ok("stage2")
    plain = runs.any("plain_resumed")
    assert plain.returncode != 0, (
        "a plain Trainer resumed a zero_plugin checkpoint without its optimizer state:\n" + plain.output[-3000:]
    )
    assert "checkpoint-2/zero_plugin" in plain.output, plain.output[-3000:]
    assert "zero-plugin launch" in plain.output and "zero-plugin consolidate" in plain.output, plain.output[-3000:]
    assert not (plain.out / "checkpoint-3").exists()  # it stopped before training


def test_resume_under_zero_plugin_is_exact(runs):
    full, resumed = runs.ok("stage2"), runs.ok("stage2_resumed")
    info, info_resumed = _info(full), _info(resumed)
    assert info_resumed["global_step"] == 4
    for key in ("loss", "grad_norm"):
        got, want = _history(info_resumed, key), _history(info, key)
        assert {s: got[s] for s in (3, 4)} == pytest.approx({s: want[s] for s in (3, 4)}, rel=1e-6, abs=0), key
    # Step 4's weights depend on the restored AdamW moments and scheduler: the uninterrupted run's.
    assert _max_diff(_weights(resumed.out / "final"), _weights(full.out / "final")) <= 1e-6
    assert _max_diff(_weights(full.out / "final"), _weights(full.out / "checkpoint-2")) > 1e-3
