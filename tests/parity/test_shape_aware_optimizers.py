"""Optimizers that read a parameter's shape or a whole-tensor statistic, at stages 1-3, against single-process
float64 training ([Note: optimizer partitions] in ``zero_plugin/optim/partition.py``).

Before the parameter partition, torch's and transformers' Adafactor trained 4.3e-3 off single-process training at
every stage (factored moments and the parameter RMS computed on 1-D regions) and Muon failed at its first step
("Param gradient must be a 2D matrix").  Each optimizer now matches to 1e-9 at stages 1, 2, 3 and 3 + CPU
offload, with accumulation and clipping, at 2 ranks, and torch Adafactor, Muon and LAMB at 3 as well
(``OddMLP.scale`` has one element, so ranks 1-2 hold no part of it and cannot own it).  AdamW, elementwise, keeps the element partition and sends
nothing to owners.  One ``run_ranks`` call per optimizer and world size.
"""

from __future__ import annotations

import functools

import pytest

from tests import models
from tests.harness import run_ranks
from tests.parity import shape_aware_workers as W

TOL = 1e-9
STEPS = 3
# (stage, offload, accum, clip)
CASES = [(1, False, 1, None), (2, False, 2, None), (3, False, 1, 0.05), (3, True, 2, None), (1, False, 1, 0.05)]


@functools.cache
def batches(world_size: int) -> list:
    return models.make_batches("mlp", STEPS * 2 + 2, world_size, 2, seed=3)


@functools.cache
def reference(name: str, world_size: int, accum: int, clip: float | None, steps: int = STEPS) -> dict:
    return W.reference(name, batches(world_size), steps, accum, clip)


# Every optimizer at 2 ranks; at 3 (a rank holding no part of ``scale``) those whose steps differ most in shape
# handling: the suite's time (CI under 25 min) leaves the two HF Adafactor variants and AdamW at 2 ranks.
PAIRS = [(name, 2) for name in W.OPTIMIZERS] + [(name, 3) for name in ("torch_adafactor", "muon", "lamb")]


@pytest.mark.parametrize("name, world_size", PAIRS)
def test_matches_single_process(name: str, world_size: int) -> None:
    results = run_ranks(world_size, W.parity_worker, name, CASES, batches(world_size), STEPS)[0]
    for (stage, offload, accum, clip), got in zip(CASES, results):
        case = f"{name} stage {stage}{' + offload' if offload else ''}, accum {accum}, clip {clip}, {world_size} ranks"
        expected = "elements" if name == "adamw" else "parameters"
        assert got["partition"] == expected, case
        assert (got["exchange_bytes"] > 0) == (expected == "parameters"), case
        ref = reference(name, world_size, accum, clip)
        diff = models.max_abs_diff({k: got["params"][k] for k in ref}, ref)
        assert diff < TOL, f"{case}: max |diff| {diff:.3g}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_and_adamw_over_one_model(world_size: int) -> None:
    """Two optimizers through one ``zp.setup``: Muon steps the matrices whole on their owners, AdamW the vectors
    in regions, and the model trains as the two do over one process."""
    cases = [c for c in CASES if c[3] is None]  # torch's clip_grad_norm_ over both optimizers' parameters
    results = run_ranks(world_size, W.two_optimizers_worker, cases, batches(world_size), STEPS)[0]
    for (stage, offload, accum, _clip), got in zip(cases, results):
        assert got["partitions"] == ["parameters", "elements"]
        ref = models.reference_train(models.make_odd_mlp, W.MuonAdamW, batches(world_size), STEPS, accum, None)[
            "params"
        ]
        diff = models.max_abs_diff({k: got["params"][k] for k in ref}, ref)
        assert diff < TOL, f"stage {stage}{' + offload' if offload else ''}, accum {accum}: max |diff| {diff:.3g}"


def test_muon_and_adamw_through_accelerate_prepare_save_and_load_state(tmp_path) -> None:
    got = run_ranks(2, W.accelerate_two_optimizers_worker, 3, batches(2), STEPS, str(tmp_path / "state"))[0]
    assert got["partitions"] == ["parameters", "elements"]
    ref = models.reference_train(models.make_odd_mlp, W.MuonAdamW, batches(2), STEPS, 1, None)["params"]
    for which in ("params", "resumed"):
        diff = models.max_abs_diff({k: got[which][k] for k in ref}, ref)
        assert diff < TOL, f"{which}: max |diff| {diff:.3g}"


def test_a_rank_owning_no_parameter() -> None:
    """Two trainable matrices over three ranks: the rank that owns neither still exchanges its regions, and the
    weights match single-process training at stages 1 and 3."""
    results = run_ranks(3, W.idle_owner_worker, [1, 3], batches(3), STEPS)
    ref = models.reference_train(
        W.two_matrices_model,
        lambda m: W.torch.optim.Adafactor([p for p in m.parameters() if p.requires_grad], lr=1e-2),
        batches(3),
        STEPS,
    )["params"]
    for stage in (1, 3):
        assert sorted(r[stage]["owned"] for r in results) == [0, 1, 1], stage
        diff = models.max_abs_diff({k: results[0][stage]["params"][k] for k in ref}, ref)
        assert diff < TOL, f"stage {stage}: max |diff| {diff:.3g}"


def test_bf16_parameters_with_fp32_masters_match_stage0() -> None:
    """Mixed precision keeps separate fp32 masters (stage 0: whole, on every rank: the data-parallel baseline);
    the parameter partition assembles them from fp32 regions, so stages 1-3 follow stage 0 (bit for bit here)."""
    got = run_ranks(2, W.mixed_precision_worker, "torch_adafactor", [0, 1, 2, 3], batches(2), STEPS)[0]
    theta0 = {k: v.float() for k, v in models.make_odd_mlp().state_dict().items()}
    baseline = got[0]["params"]
    for stage, result in zip((1, 2, 3), got[1:]):
        assert result["partition"] == "parameters"
        error = models.update_norm_error(result["params"], baseline, theta0)
        assert error < 1e-6, f"stage {stage} vs stage 0, bf16: relative update error {error:.3g}"  # seen: 0.0


@pytest.mark.parametrize("world_size", [2, 3])
def test_planner_counts_the_exchange_bytes(world_size: int) -> None:
    """``Planner.parameter_partition`` (behind ``zero-plugin estimate --optimizer-partition parameters``) gives the
    bytes the busiest rank sends per step, from the engine's own owner assignment."""
    import torch

    import zero_plugin as zp
    from zero_plugin.planner import Planner

    plan = Planner(
        models.make_odd_mlp(), config=zp.ZeroConfig(), inputs=lambda: ((torch.zeros(2, 7, dtype=torch.float64),), {})
    )
    for stage in (1, 3):
        sent = run_ranks(world_size, W.exchange_bytes_worker, stage, batches(world_size))
        assert max(sent) == plan.parameter_partition(world_size, stage)["exchange_bytes"], (stage, sent)


def test_the_element_partition_is_refused_for_shape_aware_optimizers() -> None:
    for name in ("torch_adafactor", "hf_adafactor", "muon"):
        messages = run_ranks(2, W.refused_worker, name, 2)
        for message in messages:
            assert "optimizer_partition='elements'" in message and "'auto'" in message, message
    assert run_ranks(2, W.refused_worker, "lamb", 2) == ["", ""]  # unknown: the user may force it


def test_state_dicts_round_trip() -> None:
    """Full (consolidated) and shard state dicts of the parameter partition load back exactly."""
    for name in ("torch_adafactor", "hf_adafactor_relative"):
        got = run_ranks(2, W.state_dict_worker, name, 3, batches(2), 2)[0]
        assert got["keys"], name
        for form in ("full", "shard"):
            diff = models.max_abs_diff(got[form], got["same"])
            assert diff == 0.0, f"{name}: {form} state dict: max |diff| {diff:.3g}"


def test_two_optimizers_full_state_dicts_round_trip() -> None:
    """Muon's whole masters cover a subset of the engine's slots: its full state dict must land on its own
    parameters (stage 1 and stage 3, 2 ranks)."""
    for stage, adamw_first in ((1, True), (3, True), (3, False)):
        got = run_ranks(2, W.two_optimizers_state_dict_worker, stage, batches(2), 2, adamw_first)[0]
        diff = models.max_abs_diff(got["loaded"], got["same"])
        assert diff == 0.0, f"stage {stage}, AdamW first {adamw_first}: max |diff| {diff:.3g}"


@pytest.mark.parametrize(
    "name, saved, resumed",
    [
        # (stage, world size, partition) saved -> resumed
        ("torch_adafactor", (2, 2, "auto"), (3, 3, "auto")),
        ("muon", (3, 3, "auto"), (1, 2, "auto")),
        ("adamw", (3, 2, "parameters"), (2, 3, "auto")),  # parameters -> elements, same optimizer
        ("adamw", (1, 3, "auto"), (3, 2, "parameters")),  # elements -> parameters
    ],
)
def test_checkpoint_reshards_across_stage_world_size_and_partition(name, saved, resumed, tmp_path) -> None:
    (s_stage, s_world, s_part), (r_stage, r_world, r_part) = saved, resumed
    data = models.make_batches("mlp", 4, s_world * r_world, 1, seed=5)
    path = str(tmp_path / "ckpt")
    run_ranks(s_world, W.save_worker, name, s_stage, s_part, data, 2, 1, path)
    got = run_ranks(r_world, W.resume_worker, name, r_stage, r_part, data, 2, 2, 1, path)[0]
    ref = W.reference(name, data, 4, 1, None)
    diff = models.max_abs_diff({k: got["params"][k] for k in ref}, ref)
    assert diff < TOL, f"{name} {saved} -> {resumed}: max |diff| {diff:.3g}"
