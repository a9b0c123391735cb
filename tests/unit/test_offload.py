"""CPU offload (ZeRO-Offload): same training with offload on and off, and where the bytes live.

On this CPU-only machine the host is the device, so offload copies nothing and only switches the
optimizer to torch's fused CPU kernel: the results must match the non-offloaded run within the
kernel's rounding (float64: 1e-10; the GPU copies are exercised by tests/gpu/). With
``param_dtype=bf16`` (fp32 masters) runs are compared with a single process that splits every micro-batch
into the ranks' shares and rounds where the ranks do: update-norm error 1e-3, losses 1e-4 relative.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests import models
from tests.harness import run_ranks
from tests.unit import offload_workers as OW

STEPS, ACCUM = 4, 2


def _batches(kind: str, world: int, dtype=torch.float64):
    return models.make_batches("mlp" if kind.startswith("mlp") else "llama", STEPS * ACCUM, world, 2, dtype=dtype)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_matches_no_offload_float64(stage, world):
    batches = _batches("mlp", world)
    on = run_ranks(world, OW.train_worker, "mlp", stage, True, batches, STEPS, ACCUM)[0]
    off = run_ranks(world, OW.train_worker, "mlp", stage, False, batches, STEPS, ACCUM)[0]
    assert all(on["fused"]) and not any(off["fused"])
    assert models.max_abs_diff(on["params"], off["params"]) <= 1e-10
    assert max(abs(a - b) for a, b in zip(on["losses"], off["losses"])) <= 1e-10
    assert on["optim"].keys() == off["optim"].keys()
    assert max((on["optim"][k] - off["optim"][k]).abs().max().item() for k in on["optim"]) <= 1e-10


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_llama_update_norm(stage):
    batches = _batches("llama", 2)
    on = run_ranks(2, OW.train_worker, "llama", stage, True, batches, STEPS, ACCUM)[0]
    off = run_ranks(2, OW.train_worker, "llama", stage, False, batches, STEPS, ACCUM)[0]
    init = {k: v.double() for k, v in models.make_tiny_llama(layers=2).state_dict().items() if k in off["params"]}
    assert models.update_norm_error(on["params"], off["params"], init) <= 1e-3
    for a, b in zip(on["losses"], off["losses"]):
        assert abs(a - b) <= 1e-4 * abs(b)


@functools.cache
def _bf16_run(stage: int, world: int, offload: bool) -> dict:
    """Rank 0's result of a bf16 run (fp32 masters), losses as the global mean; shared by the bf16 tests."""
    batches = _batches("mlp32", world, dtype=torch.float32)
    ranks = run_ranks(world, OW.train_worker, "mlp32", stage, offload, batches, STEPS, ACCUM, "bf16")
    return {**ranks[0], "losses": [sum(r["losses"][i] for r in ranks) / world for i in range(STEPS)]}


@functools.cache
def _bf16_reference(world: int, split_over: int, accumulation: str) -> dict:
    """``OW.bf16_split_reference`` on the ``world``-rank batches, in a one-rank worker (one thread, as the ranks)."""
    batches = _batches("mlp32", world, dtype=torch.float32)
    return run_ranks(1, OW.bf16_split_reference, "mlp32", batches, split_over, STEPS, ACCUM, accumulation)[0]


def _assert_same_training(got: dict, ref: dict, update_tol: float, loss_tol: float) -> None:
    init = {n: p.detach().double() for n, p in OW.build("mlp32").named_parameters()}
    err = models.update_norm_error(got["params"], ref["params"], init)
    assert err <= update_tol, err
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= loss_tol * abs(b), (a, b)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_bf16_against_split_reference(stage, world):
    """The issue's bar, against one process doing what bf16 data parallelism means: each rank's share of
    each micro-batch gives its own bf16 gradient, averaged in fp32 (``OW.bf16_split_reference``)."""
    got = _bf16_run(stage, world, True)
    assert all(got["fused"])
    assert got["blocked"] == (stage != 3)  # stage 3 on a CPU-only machine: the fp32 shard is the master
    _assert_same_training(got, _bf16_reference(world, world, OW.ACCUMULATION[stage]), 1e-3, 1e-4)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_bf16_matches_no_offload(stage, world):
    """Offload on (fused AdamW) vs off (for-loop AdamW): different kernels, so the update-norm bar."""
    on, off = _bf16_run(stage, world, True), _bf16_run(stage, world, False)
    assert all(on["fused"]) and not any(off["fused"])
    _assert_same_training(on, off, 1e-3, 1e-4)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_offload_bf16_blocked_step_is_bitwise_whole_tensor_step(stage, world):
    """[Note: cache-blocked offload step] across ranks: blocks of 128 elements (every odd shard split,
    several shards per block) against the whole-tensor cast / fused step / write-back."""
    batches = _batches("mlp32", world, dtype=torch.float32)
    runs = [
        run_ranks(world, OW.train_worker, "mlp32", stage, True, batches, STEPS, ACCUM, "bf16", block)
        for block in (128, 0)
    ]
    (blocked, whole) = (r[0] for r in runs)
    assert blocked["blocked"] and not whole["blocked"] and blocked["block"] == 128
    assert blocked["losses"] == whole["losses"]
    assert all(torch.equal(blocked["params"][k], whole["params"][k]) for k in whole["params"])
    assert all(torch.equal(blocked["optim"][k], whole["optim"][k]) for k in whole["optim"])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_bf16_against_unsplit_reference(stage, world):
    """Looser, on purpose: the reference runs the whole global batch in one bf16 pass. The ranks' shares
    round their bf16 partial gradients separately (about 2^-9 relative each) and Adam's normalisation
    amplifies that where gradients are small, so only the update direction is checked here."""
    got = _bf16_run(stage, world, True)
    _assert_same_training(got, _bf16_reference(world, 1, OW.ACCUMULATION[stage]), 5e-2, 2e-2)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_memory_placement(stage, world):
    rep = run_ranks(world, OW.memory_worker, stage, True, "bf16")[0]
    placement = rep["placement"]
    assert "optimizer" not in placement["device"], placement
    psi = rep["trainable_params"]
    # mixed-precision AdamW on the host: fp32 master + exp_avg + exp_avg_sq = 12 bytes/param over N ranks.
    # Stage 3 on a CPU-only machine keeps the fp32 shard itself as the master (nothing to copy to a host
    # that is the device): 8 bytes/param of moments on the host, the 4-byte master shard with the params.
    per_param = 8 if stage == 3 else 12
    assert abs(placement["host"]["optimizer"] - per_param * psi / world) <= 64 * 16 * world, placement
    assert abs(rep["measured"]["total"] - rep["theory"]["total"]) <= 64 * 16 * world
    off = run_ranks(world, OW.memory_worker, stage, False, "bf16")[0]
    assert "optimizer" in off["placement"]["device"] and not off["placement"]["host"].get("optimizer")
