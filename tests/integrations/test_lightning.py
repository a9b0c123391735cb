"""Lightning Trainer and Fabric integration: ``strategy="zero1" | "zero2" | "zero3"`` against ``"ddp"``.

Every case runs two gloo ranks on CPU.  Most run inside the reused ``tests.harness`` pool
(Lightning treats its processes as externally launched); the checkpoint-resume case starts a
fresh script whose Trainer launches its second rank itself (Lightning's subprocess launcher).

Tolerances (tiny Llama / LoRA in fp32, 3 optimizer steps of two-group AdamW with a StepLR,
``accumulate_grad_batches=2``, ``gradient_clip_val=1.0``): per-micro-batch losses 1e-4 relative,
update-norm error ||Δθ - Δθ_ddp|| / ||Δθ_ddp|| <= 1e-3 (only summation order differs from DDP).
Resuming from a checkpoint must match the uninterrupted run to 1e-6.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.harness import REPO_ROOT, run_ranks
from tests.integrations import lightning_fabric_workers as fw
from tests.integrations import lightning_workers as lw

LOSS_RTOL, UPDATE_TOL, RESUME_TOL = 1e-4, 1e-3, 1e-6
STAGES = ("zero1", "zero2", "zero3")
OFFLOAD = ("zero2_offload", "zero3_offload")


@functools.cache
def trainer_run(kind: str, strategy: str, **kwargs) -> list:
    return run_ranks(2, lw.fit_worker, kind, strategy, **kwargs)


@functools.cache
def fabric_run(kind: str, strategy: str) -> list:
    return run_ranks(2, fw.fabric_worker, kind, strategy)


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _update_error(init: dict, state: dict, ref_state: dict) -> float:
    names = [k for k, v in ref_state.items() if v.is_floating_point()]
    assert names and set(names) <= set(state), sorted(set(names) - set(state))[:5]
    delta = torch.cat([(state[k].double() - init[k].double()).reshape(-1) for k in names])
    ref = torch.cat([(ref_state[k].double() - init[k].double()).reshape(-1) for k in names])
    assert ref.norm() > 0, "the reference did not train"
    return float((delta - ref).norm() / ref.norm())


def assert_parity(result: list, ref: list, loss_rtol: float = LOSS_RTOL, update_tol: float = UPDATE_TOL) -> None:
    for rank in range(2):
        assert _max_rel(result[rank]["losses"], ref[rank]["losses"]) <= loss_rtol, rank
    assert _update_error(ref[0]["init"], result[0]["state"], ref[0]["state"]) <= update_tol


# -- Trainer ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "lora"])
@pytest.mark.parametrize("strategy", STAGES + OFFLOAD)
def test_trainer_matches_ddp(kind, strategy):
    result = trainer_run(kind, strategy)
    assert result[0]["global_step"] == 3
    assert_parity(result, trainer_run(kind, "ddp"))


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_trainer_clip_by_value(strategy):
    """gradient_clip_algorithm="value" clips each rank's reduced shard element-wise, as DDP clips the whole."""
    options = dict(gradient_clip_algorithm="value", gradient_clip_val=0.01)
    assert_parity(trainer_run("llama", strategy, **options), trainer_run("llama", "ddp", **options))


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_trainer_manual_optimization(strategy):
    """manual_backward under toggle_model(sync_grad=False) (-> zp.no_sync), clip_gradients, step."""
    assert_parity(trainer_run("llama", strategy, manual=True), trainer_run("llama", "ddp", manual=True))


def test_trainer_bf16_mixed_autocast():
    """bf16 autocast runs under ZeRO-3 and tracks DDP with the same precision (bf16 rounding tolerances)."""
    result = trainer_run("llama", "zero3", precision="bf16-mixed")
    ref = trainer_run("llama", "ddp", precision="bf16-mixed")
    fp32 = trainer_run("llama", "ddp")
    assert _max_rel(result[0]["losses"], fp32[0]["losses"]) > 0  # autocast really ran
    assert_parity(result, ref, loss_rtol=2e-2, update_tol=0.1)


def test_fit_validate_test_predict_stage3():
    result = run_ranks(2, lw.fit_eval_worker, "zero3")
    ref = run_ranks(2, lw.fit_eval_worker, "ddp")
    assert_parity(result, ref)
    for key, metric in (("val", "val_loss"), ("test", "test_loss"), ("again", "val_loss")):
        got, want = result[0][key][0][metric], ref[0][key][0][metric]
        assert abs(got - want) <= LOSS_RTOL * abs(want), (key, got, want)
    for rank in range(2):
        assert len(result[rank]["preds"]) == len(ref[rank]["preds"]) > 0
        for got, want in zip(result[rank]["preds"], ref[rank]["preds"]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_validate_before_fit_stage3():
    """Inference sharding first (placeholder optimizer), then fit binds the real optimizer."""
    result = run_ranks(2, lw.eval_first_worker, "zero3")
    ref = run_ranks(2, lw.eval_first_worker, "ddp")
    for key in ("before", "after"):
        got, want = result[0][key][0]["val_loss"], ref[0][key][0]["val_loss"]
        assert abs(got - want) <= LOSS_RTOL * abs(want), (key, got, want)
    assert_parity(result, ref)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Uninterrupted 2-epoch runs that checkpoint every epoch (sharded and full), and their resumes from
    epoch 0 in two new processes started by Lightning's own launcher."""
    root = tmp_path_factory.mktemp("lightning_ckpt")
    cases = {"sharded": "zero3", "full": "zero3:full"}
    uninterrupted, runs = {}, []
    for mode, strategy in cases.items():
        ckpt_dir = root / mode
        uninterrupted[mode] = run_ranks(2, lw.checkpoint_worker, strategy, str(ckpt_dir))
        runs += ["--run", strategy, str(ckpt_dir / "epoch=0.ckpt"), str(root / f"{mode}.out")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT)
    for var in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "PL_TRAINER_STRATEGY"):
        env.pop(var, None)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integrations.lightning_workers", "resume", *runs],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    print(f"resume script (2 new processes, 2 fits): {time.monotonic() - start:.1f} s")
    loaded = {mode: [torch.load(root / f"{mode}.out.rank{r}", weights_only=False) for r in range(2)] for mode in cases}
    return uninterrupted, loaded, root


@pytest.mark.parametrize("mode", ["sharded", "full"])
def test_checkpoint_resume_in_new_processes(resumed, mode):
    uninterrupted, loaded, root = resumed
    full_run, resumed_run = uninterrupted[mode], loaded[mode]
    assert full_run[0]["files"] == ["epoch=0.ckpt", "epoch=1.ckpt"]
    ckpt = root / mode / "epoch=0.ckpt"
    # Sharded directories need zp.save_checkpoint; without it the strategy writes one full file instead.
    assert ckpt.is_dir() == (mode == "sharded")
    assert resumed_run[0]["global_step"] == 4
    for rank in range(2):  # the resumed run trains epoch 1 only: the second half of the losses
        tail = full_run[rank]["losses"][len(full_run[rank]["losses"]) // 2 :]
        assert _max_rel(resumed_run[rank]["losses"], tail) <= RESUME_TOL, rank
    for name, value in full_run[0]["state"].items():
        torch.testing.assert_close(resumed_run[0]["state"][name], value, rtol=RESUME_TOL, atol=RESUME_TOL)


def test_sharded_checkpoint_reshards_across_stages(tmp_path):
    """The sharded directory (zp.save_checkpoint) saved at stage 3 resumes at stage 2; Fabric round-trips it."""
    pytest.importorskip("zero_plugin.checkpoint")
    ranks = run_ranks(2, fw.cross_stage_resume_worker, "zero3", "zero2", str(tmp_path))
    assert ranks[0]["layout"] == ["meta.pt", "zero"]
    for rank in range(2):
        full, resumed = ranks[rank]["full"], ranks[rank]["resumed"]
        assert _max_rel(resumed["losses"], full["losses"][len(full["losses"]) // 2 :]) <= RESUME_TOL
    for name, value in ranks[0]["full"]["state"].items():
        torch.testing.assert_close(ranks[0]["resumed"]["state"][name], value, rtol=RESUME_TOL, atol=RESUME_TOL)
    fabric = ranks[0]["fabric"]
    assert fabric["is_dir"] and fabric["loaded_step"] == 3
    assert _max_rel(fabric["resumed_losses"], fabric["all_losses"][-len(fabric["resumed_losses"]) :]) <= RESUME_TOL


def test_model_summary_reports_full_counts():
    out = run_ranks(2, lw.summary_worker, "zero3")[0]
    ddp = run_ranks(2, lw.summary_worker, "ddp")[0]
    assert "ZeroModelSummary" in out["callbacks"]
    assert out["total"] == ddp["total"] and out["trainable"] == ddp["trainable"]
    assert out["layers"] == ddp["layers"]
    assert out["shard_numel"] < out["total"]  # the parameters really are shards
    tail = [line for line in out["log"].splitlines() if "params" in line.lower()]
    assert any("Total params" in line for line in tail), out["log"]
    assert tail == [line for line in ddp["log"].splitlines() if "params" in line.lower()], out["log"]


def test_pl_trainer_strategy_env_switches_trainer_and_names_are_registered():
    out = run_ranks(2, lw.env_strategy_worker)[0]
    assert out["type"] == "ZeroStrategy" and out["stage"] == 3
    expected = sorted(["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"])
    assert out["names"] == {pkg: expected for pkg in out["names"]} and len(out["names"]) == 4


def test_standalone_pytorch_lightning_package():
    """The same strategy under ``pytorch_lightning`` (its own class tree) gives the same run."""
    result = trainer_run("llama", "zero3", package="pytorch_lightning")
    assert result[0]["strategy_class"] == "zero_plugin.integrations.lightning.pytorch_lightning.ZeroStrategy"
    assert_parity(result, trainer_run("llama", "ddp"))


def test_unsupported_configurations_raise_clearly():
    out = run_ranks(2, lw.errors_worker)[0]
    assert "exactly one optimizer" in out["two_optimizers"]
    assert "unknown preset" in out["bad_preset"]


# -- Fabric -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "lora"])
@pytest.mark.parametrize("strategy", STAGES)
def test_fabric_matches_ddp(kind, strategy):
    result, ref = fabric_run(kind, strategy), fabric_run(kind, "ddp")
    for rank in range(2):
        assert _max_rel(result[rank]["losses"], ref[rank]["losses"]) <= LOSS_RTOL
        assert _max_rel(result[rank]["norms"], ref[rank]["norms"]) <= LOSS_RTOL
    assert _update_error(ref[0]["init"], result[0]["mid"], ref[0]["mid"]) <= UPDATE_TOL


def test_fabric_setup_module_then_setup_optimizers():
    out = run_ranks(2, fw.fabric_inference_worker, "zero3")[0]
    assert out["logits_err"] <= 1e-5
    assert _max_rel(out["two_step"], out["joint"]) <= LOSS_RTOL
    for name, value in out["joint_state"].items():
        torch.testing.assert_close(out["two_step_state"][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["sharded", "full"])
def test_fabric_save_load(tmp_path, mode):
    strategy = "zero3" if mode == "sharded" else "zero3:full"
    out = run_ranks(2, fw.fabric_worker, "llama", strategy, save=str(tmp_path / "ckpt"))[0]
    assert out["is_dir"] == (mode == "sharded")
    assert out["loaded_step"] == 3 and out["remainder"] == []
    n = len(out["resumed_losses"])
    assert _max_rel(out["resumed_losses"], out["all_losses"][-n:]) <= RESUME_TOL
    for name, value in out["final"].items():
        torch.testing.assert_close(out["resumed"][name], value, rtol=RESUME_TOL, atol=RESUME_TOL)
