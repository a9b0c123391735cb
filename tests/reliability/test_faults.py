"""Faults and bad input: every case ends in a clear error on every rank, never a hang or silent damage."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from tests import launching
from tests.harness import REPO_ROOT, run_ranks
from tests.reliability import fault_workers as FW


def test_config_drift_fails_on_every_rank_naming_the_field():
    errors = run_ranks(2, FW.config_drift_worker, "config", timeout=60)
    for e in errors:
        assert "ValueError" in e and "different ZeroConfig" in e and "stage" in e, e


def test_model_drift_fails_on_every_rank_naming_the_parameter():
    errors = run_ranks(2, FW.config_drift_worker, "model", timeout=60)
    for e in errors:
        assert "ValueError" in e and "head.weight" in e, e


def test_bad_input_gets_an_actionable_error():
    out = run_ranks(1, FW.bad_input_worker)[0]
    for case, message in out.items():
        assert message, f"{case}: no error raised"
    for case in ("clip_unprepared", "no_sync_unprepared", "full_sd_unprepared", "memory_unprepared"):
        assert "zp.setup" in out[case], (case, out[case])
    assert "torch.nn.Module" in out["setup_not_module"]
    assert "torch.optim.Optimizer" in out["setup_not_optimizer"]
    assert "ZeroConfig" in out["setup_bad_config"]
    assert "not a parameter of the model" in out["setup_foreign_param"]
    assert "not in the optimizer" in out["setup_missing_param"]
    assert "already set up" in out["setup_twice"]
    assert "max_norm" in out["clip_bad_norm"]
    assert "zp.setup" in out["add_param_group"] and "TypeError" in out["pickle_optimizer"]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_batchnorm_buffers_stay_consistent_and_zero_size_params_work(stage):
    results = run_ranks(2, FW.buffers_worker, stage)
    for key in ("running_mean", "running_var"):
        assert torch.equal(results[0][key], results[1][key]), key
    assert results[0]["tracked"] == results[1]["tracked"] == 3


@pytest.mark.parametrize("stage", [2, 3])
def test_rank_death_is_an_error_on_the_survivor_not_a_hang(stage, tmp_path):
    ctx = mp.get_context("spawn")
    port = launching.free_port()
    procs = [ctx.Process(target=FW.rank_death_main, args=(r, 2, port, str(tmp_path), stage)) for r in range(2)]
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env_path if env_path else "")
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
    finally:
        os.environ["PYTHONPATH"] = env_path
        for p in procs:
            if p.is_alive():
                p.kill()
    assert not any(p.is_alive() for p in procs), "a rank hung after its peer died"
    assert procs[1].exitcode == -9
    text = (tmp_path / "rank0.txt").read_text()
    seconds, outcome = text.split("\n", 1)
    assert outcome.startswith(("RuntimeError", "DistBackendError")), outcome
    assert float(seconds) < 90, seconds
