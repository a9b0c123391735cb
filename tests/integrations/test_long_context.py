"""Issue #50's "through the ecosystem unchanged": the one flag ``zero-plugin launch --sequence_parallel_size K``
through the HF Trainer, TRL's SFTTrainer and ``examples/long_context_sft.py``, each run against its own K = 1 run.

* The done-when launch: ``zero-plugin launch --stage 3 --sequence_parallel_size 2 --num_processes 2
  examples/long_context_sft.py --seq_len 2048 --max_steps 2`` prints the per-step losses of the same launch with
  ``--sequence_parallel_size 1`` (within 1e-4 relative; float32, AdamW).
* ``scripts/long_context_trainers.py``: an Accelerate loop (``accelerator.prepare(loader)`` splits, the script
  calls ``zp.sequence_parallel_loss``; SGD, losses to 1e-6), the HF Trainer (full fine-tune, AdamW, 2 accumulation steps, rows of
  different lengths right-padded with -100 under the pads and a prompt, evaluation before and after training, a resume
  from step 2 in a fresh Trainer) and TRL's
  SFTTrainer (LoRA, SGD, gradient checkpointing, float32) at stage 3: per-step losses, the evaluation loss and the
  weights after training match K = 1's (Trainer: update-norm error ||w2 - w1|| / ||w1 - w0||; TRL: the LoRA
  weights).  K = 2 puts both ranks in one data-parallel group, K = 1 gives each its own rows: the scripts keep 4
  rows per micro-batch over all ranks, so both see the same rows per step.
The four launches run two at a time (about 70 s on 2 CPU cores).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
from pathlib import Path

import pytest
import torch

from tests import launching
from tests.integrations.launches import ZERO_LAUNCH

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "long_context_sft.py"
TRAINERS = Path(__file__).resolve().parent / "scripts" / "long_context_trainers.py"
STEP = re.compile(r"^step (\d+) loss (\S+)$", re.MULTILINE)


def _launch(k: int, script: Path, *args: str):
    cmd = [*ZERO_LAUNCH, "launch", "--no_estimate", "--stage", "3", "--sequence_parallel_size", str(k)]
    cmd += ["--num_processes", "2", "--main_process_port", "0", str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = launching.run(cmd, env=env, timeout=600)
    assert result.returncode == 0, f"K={k} {script.name} exited {result.returncode}:\n{result.stderr[-6000:]}"
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("long_context")
    jobs = {
        **{("example", k): (k, EXAMPLE, "--seq_len", "2048", "--max_steps", "2") for k in (1, 2)},
        **{("trainers", k): (k, TRAINERS, "--out", str(tmp / f"k{k}")) for k in (1, 2)},
    }
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(_launch, *job) for key, job in jobs.items()}
    out = {key: f.result() for key, f in futures.items()}
    for k in (1, 2):
        out["trainers", k].info = json.loads((tmp / f"k{k}" / "result.json").read_text())
        out["trainers", k].folder = tmp / f"k{k}"
    return out


def _close(got: list[float], want: list[float], rel: float) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= rel * abs(b) for a, b in zip(got, want))


def test_launch_prints_the_same_losses_with_and_without_sequence_parallelism(runs):
    losses = {k: [float(x) for _, x in STEP.findall(runs["example", k].stdout)] for k in (1, 2)}
    assert [int(n) for n, _ in STEP.findall(runs["example", 2].stdout)] == [1, 2]
    assert "2 processes in 1 data-parallel groups" in runs["example", 2].stdout
    assert "2 processes in 2 data-parallel groups" in runs["example", 1].stdout
    assert losses[1][0] != losses[1][1]
    assert _close(losses[2], losses[1], 1e-4), losses


def test_accelerate_loop_matches_its_k1_run(runs):
    got, want = runs["trainers", 2].info["accelerate_losses"], runs["trainers", 1].info["accelerate_losses"]
    assert len(want) == 4 and want[0] != want[-1]
    assert _close(got, want, 1e-6), (got, want)


def test_trainer_matches_its_k1_run(runs):
    k1, k2 = runs["trainers", 1], runs["trainers", 2]
    assert (k2.info["hf_loader"], k2.info["hf_sequence_parallel_size"]) == ("SequenceParallelDataLoader", 2)
    assert (k1.info["hf_loader"], k1.info["hf_sequence_parallel_size"]) == ("DataLoaderShard", 1)
    assert len(k1.info["hf_losses"]) == 3
    assert _close(k2.info["hf_losses"], k1.info["hf_losses"], 1e-6), (k2.info["hf_losses"], k1.info["hf_losses"])
    assert _close([k2.info["hf_eval_loss"]], [k1.info["hf_eval_loss"]], 1e-6)
    assert _close([k2.info["hf_eval_before"]], [k1.info["hf_eval_before"]], 1e-6)
    assert k1.info["hf_eval_before"] != k1.info["hf_eval_loss"]
    for run in (k1, k2):  # resumed mid-epoch from checkpoint-2 (its log holds steps 1-2): step 3's loss again
        resumed = run.info["hf_resumed_losses"]
        assert len(resumed) == 3 and _close(resumed[2:], run.info["hf_losses"][2:], 1e-6), run.info
    w0 = torch.load(k1.folder / "hf_initial.pt")
    w1, w2 = (torch.load(r.folder / "hf_weights.pt") for r in (k1, k2))
    assert w1.keys() == w2.keys() == w0.keys()
    update = sum(float((w1[n].double() - w0[n].double()).norm()) ** 2 for n in w0) ** 0.5
    error = sum(float((w2[n].double() - w1[n].double()).norm()) ** 2 for n in w0) ** 0.5
    assert update > 0.1 and error / update < 1e-4, (error, update)


def test_sft_trainer_matches_its_k1_run(runs):
    k1, k2 = runs["trainers", 1], runs["trainers", 2]
    assert _close(k2.info["trl_losses"], k1.info["trl_losses"], 1e-6), (k2.info["trl_losses"], k1.info["trl_losses"])
    w1, w2 = (torch.load(r.folder / "trl_weights.pt") for r in (k1, k2))
    lora_b = [n for n in w1 if "lora_B" in n]
    assert lora_b and w1.keys() == w2.keys()
    trained = sum(float(w1[n].double().norm()) ** 2 for n in lora_b) ** 0.5  # lora_B starts at zero
    error = sum(float((w2[n].double() - w1[n].double()).norm()) ** 2 for n in lora_b) ** 0.5
    assert trained > 0.01 and error / trained < 1e-5, (error, trained)


def test_lightning_strategy_matches_its_k1_run():
    """``ZeroStrategy(config="zero3", sequence_parallel_size=2)``: the sampler over the one data-parallel group,
    batches split, the module's ``zp.sequence_parallel_loss``: losses (the ranks' mean per step), the validation
    loss and the weights after 3 SGD steps equal K = 1's (the pool's 2 ranks, in process)."""
    from tests.harness import run_ranks
    from tests.integrations import lightning_sequence_workers as workers

    k1, k2 = (run_ranks(2, workers.fit_worker, k) for k in (1, 2))
    assert [r["replicas"] for r in k1] == [2, 2] and [r["replicas"] for r in k2] == [1, 1]
    assert k2[0]["losses"] == k2[1]["losses"]  # a group's ranks report their sequences' loss
    want = [(a + b) / 2 for a, b in zip(k1[0]["losses"], k1[1]["losses"])]
    assert len(want) == 3 and want[0] != want[-1]
    assert _close(k2[0]["losses"], want, 1e-6), (k2[0]["losses"], want)
    assert _close([k2[0]["val_loss"]], [k1[0]["val_loss"]], 1e-6), (k2[0]["val_loss"], k1[0]["val_loss"])
    w1, w2 = k1[0]["weights"], k2[0]["weights"]
    assert w1.keys() == w2.keys()
    assert max(float((w1[n] - w2[n]).abs().max()) for n in w1) < 1e-5


def test_launch_flag_and_accelerate_section_reach_the_config(monkeypatch, tmp_path):
    """``--sequence_parallel_size`` and a ``zero_plugin:`` section's ``sequence_parallel_size`` reach
    ``ZeroConfig.from_env`` in the processes as the other settings do; a K that does not divide the processes is
    refused before any starts (no processes started here)."""
    from tests.integrations.test_accelerate import _build_launch
    from zero_plugin.config import ZeroConfig
    from zero_plugin.launch import launcher

    _, env, _ = _build_launch(["--num_processes", "2", "--sequence_parallel_size", "2", "t.py"], monkeypatch, tmp_path)
    assert ZeroConfig.from_env(env).sequence_parallel_size == 2
    (tmp_path / "acc.yaml").write_text("num_processes: 2\nzero_plugin:\n  stage: 3\n  sequence_parallel_size: 2\n")
    args, env, temp_files = _build_launch(["--config_file", "acc.yaml", "t.py"], monkeypatch, tmp_path)
    for path in temp_files:
        os.unlink(path)
    config = ZeroConfig.from_env(env)
    assert (config.stage, config.sequence_parallel_size) == (3, 2)
    with pytest.raises(ValueError, match="sequence_parallel_size=3 must divide the world size 2"):
        args, env, temp_files = _build_launch(
            ["--num_processes", "2", "--sequence_parallel_size", "3", "t.py"], monkeypatch, tmp_path
        )
        launcher._check_sequence_parallel(args, env)


def test_fabric_strategy_matches_its_k1_run():
    """``ZeroFabricStrategy(config="zero3", sequence_parallel_size=2)``: ``fabric.setup_dataloaders`` samples over
    the data-parallel groups and splits; 3 SGD steps equal K = 1's (losses: the ranks' mean; weights)."""
    from tests.harness import run_ranks
    from tests.integrations import lightning_sequence_workers as workers

    k1, k2 = (run_ranks(2, workers.fabric_worker, k) for k in (1, 2))
    assert k2[0]["losses"] == k2[1]["losses"]
    want = [(a + b) / 2 for a, b in zip(k1[0]["losses"], k1[1]["losses"])]
    assert len(want) == 3 and _close(k2[0]["losses"], want, 1e-6), (k2[0]["losses"], want)
    w1, w2 = k1[0]["weights"], k2[0]["weights"]
    assert w1.keys() == w2.keys() and max(float((w1[n] - w2[n]).abs().max()) for n in w1) < 1e-5
