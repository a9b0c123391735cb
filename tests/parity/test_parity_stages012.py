"""Stages 0-2 against a single-process reference that sees every rank's batch.

Each case trains ``STEPS`` optimizer steps of two-group AdamW with gradient
accumulation over ``ACCUM`` micro-batches (all but the last under
``zp.no_sync``) and clipping with ``zp.clip_grad_norm_``, on world sizes 1-4.
The global batch has ``GLOBAL_ROWS`` rows (divisible by 1, 2, 3 and 4), so one
reference run per model serves every world size, and the mean of the ranks'
mean losses is the global mean loss.

Tolerances:
  * OddMLP (float64): parameters 1e-10 absolute; loss and clip norm 1e-10 relative.
    Only the summation order differs from the reference (per-rank partial sums,
    then the average), so float64 agrees to ~1e-15.
  * tiny Llama and its LoRA variant (fp32): update-norm error
    ||θ - θ_ref|| / ||θ_ref - θ0|| <= 1e-3; loss and clip norm 1e-4 relative.
    fp32 rounding differences (~1e-7) are amplified by Adam's division by
    sqrt(v) on small gradients, but stay orders of magnitude below these bounds.
``MAX_NORM`` is chosen per model so that clipping bites on some steps and not
on others (asserted on the reference), which exercises both branches.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests import models
from tests.harness import run_ranks
from tests.parity import workers

STEPS, ACCUM, GLOBAL_ROWS = 10, 2, 12
STAGES = (0, 1, 2)
WORLD_SIZES = (1, 2, 3, 4)
# Reference pre-clip norms: mlp falls from ~0.93 to ~0.27, llama stays ~0.85-1.45, lora ~0.09-0.14.
MAX_NORM = {"mlp": 0.5, "mlp_frozen": 0.5, "llama": 1.0, "lora": 0.11}
FLOAT64_KINDS = ("mlp", "mlp_frozen")


@functools.cache
def global_batches(kind: str) -> list:
    return models.make_batches(
        workers.batch_kind(kind), STEPS * ACCUM, world_size=1, per_rank_batch=GLOBAL_ROWS, seed=0
    )


@functools.cache
def reference(kind: str, use_scheduler: bool = False, steps: int = STEPS) -> dict:
    """``models.reference_train`` plus the reference optimizer's final state dict (cached per model)."""
    holder = {}

    def opt_fn(model):
        opt = holder["opt"] = workers.build_optimizer(model)
        if use_scheduler:
            scheduler = workers.build_scheduler(opt)
            # reference_train has no scheduler argument: step it right after each optimizer step.
            opt.register_step_post_hook(lambda *_: scheduler.step())
        return opt

    out = models.reference_train(
        functools.partial(workers.build_model, kind),
        opt_fn,
        global_batches(kind),
        steps=steps,
        accum=ACCUM,
        clip=MAX_NORM[kind],
    )
    out["optim"] = holder["opt"].state_dict()
    return out


def run_parity(
    kind: str, stage: int, world_size: int, use_scheduler: bool = False, buffered: bool = False
) -> list[dict]:
    return run_ranks(
        world_size,
        workers.parity_worker,
        kind,
        stage,
        global_batches(kind),
        STEPS,
        ACCUM,
        MAX_NORM[kind],
        use_scheduler=use_scheduler,
        buffered=buffered,
    )


def assert_rel_close(got, want, rel: float, what: str) -> None:
    got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    err = ((got - want).abs() / want.abs()).max().item()
    assert err <= rel, f"{what}: max relative error {err:.3g} > {rel:g}\n got  {got.tolist()}\n want {want.tolist()}"


def assert_params_match(kind: str, params: dict, ref: dict, what: str) -> None:
    params = {n: params[n] for n in ref["params"]}
    if kind in FLOAT64_KINDS:
        diff = models.max_abs_diff(params, ref["params"])
        assert diff <= 1e-10, f"{what}: max |θ - θ_ref| = {diff:.3g} > 1e-10"
    else:
        err = models.update_norm_error(params, ref["params"], ref["init_params"])
        assert err <= 1e-3, f"{what}: update-norm error {err:.3g} > 1e-3"


def check_against_reference(kind: str, results: list[dict], ref: dict) -> None:
    rel = 1e-10 if kind in FLOAT64_KINDS else 1e-4
    global_losses = torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0).tolist()
    assert_rel_close(global_losses, ref["losses"], rel, "per-step global loss")
    for rank, r in enumerate(results):
        assert_rel_close(r["clip_norms"], ref["clip_norms"], rel, f"rank {rank} clip norm")
        assert_params_match(kind, r["params"], ref, f"rank {rank} parameters")
    assert_params_match(kind, results[0]["full_state_dict"], ref, "full_state_dict on rank 0")
    assert all(r["full_state_dict"] == {} for r in results[1:]), "full_state_dict must be {} off rank 0"


def check_optimizer_state(kind: str, results: list[dict], ref: dict) -> None:
    full, want = results[0]["optim_full"], ref["optim"]
    assert all(r["optim_full"] == {} for r in results[1:]), "consolidate_state_dict must be {} off rank 0"
    assert sorted(full["state"]) == sorted(want["state"])
    for got_g, want_g in zip(full["param_groups"], want["param_groups"], strict=True):
        for key in ("lr", "weight_decay", "betas", "eps", "params"):
            assert got_g[key] == want_g[key], f"param group {key}: {got_g[key]} != {want_g[key]}"
    for idx, want_entry in want["state"].items():
        entry = full["state"][idx]
        assert entry.keys() == want_entry.keys()
        assert float(entry["step"]) == float(want_entry["step"]) == STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            assert entry[key].shape == want_entry[key].shape, f"state {idx} {key} shape"
            if kind in FLOAT64_KINDS:
                torch.testing.assert_close(
                    entry[key],
                    want_entry[key],
                    rtol=1e-8,
                    atol=1e-14,
                    msg=lambda m, i=idx, k=key: f"state {i} {k}: {m}",
                )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["mlp", "llama", "lora"])
def test_parity_with_reference(kind, stage, world_size):
    ref = reference(kind)
    results = run_parity(kind, stage, world_size)
    check_against_reference(kind, results, ref)
    check_optimizer_state(kind, results, ref)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_parity_buffered_layout(kind, stage, world_size):
    """The rank-major buffered collectives NCCL uses (padded reduce-scatter and all-gather buffers),
    forced on gloo, which otherwise reduces and gathers in place (collectives.py)."""
    ref = reference(kind)
    results = run_parity(kind, stage, world_size, buffered=True)
    check_against_reference(kind, results, ref)
    check_optimizer_state(kind, results, ref)


@pytest.mark.parametrize("kind", ["mlp", "llama", "lora"])
def test_reference_clip_bites_on_some_steps(kind):
    norms = reference(kind)["clip_norms"]
    assert any(n > MAX_NORM[kind] for n in norms) and any(n < MAX_NORM[kind] for n in norms), norms


def test_lora_trains_adapters_only():
    ref = reference("lora")
    moved = {n for n, p in ref["params"].items() if not torch.equal(p, ref["init_params"][n])}
    assert moved and all("lora_" in n for n in moved)


@pytest.mark.parametrize("stage", STAGES)
def test_lr_scheduler_changes_lr(stage):
    world_size = 3
    ref = reference("mlp", use_scheduler=True)
    results = run_parity("mlp", stage, world_size, use_scheduler=True)
    check_against_reference("mlp", results, ref)
    expected = [[workers.LR * 0.2 ** (s // 3), workers.LR / 2 * 0.2 ** (s // 3)] for s in range(STEPS)]
    for r in results:
        assert_rel_close(r["lrs"], expected, 1e-12, "lr seen by the optimizer")
    # The schedule matters: without it the reference lands far away.
    plain = reference("mlp")
    assert models.max_abs_diff(plain["params"], ref["params"]) > 1e-3


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world_size", [2, 3])
def test_frozen_params_have_no_grad_and_no_state(stage, world_size):
    ref = reference("mlp_frozen")
    results = run_ranks(
        world_size, workers.frozen_worker, stage, global_batches("mlp_frozen"), STEPS, ACCUM, MAX_NORM["mlp_frozen"]
    )
    check_against_reference(
        "mlp_frozen", [dict(r, full_state_dict=r["params"] if i == 0 else {}) for i, r in enumerate(results)], ref
    )
    trainable = sum(p.requires_grad for p in workers.build_model("mlp_frozen").parameters())
    for rank, r in enumerate(results):
        assert r["frozen_names"] == [
            "blocks.0.fc.bias",
            "blocks.0.fc.weight",
            "blocks.0.norm.bias",
            "blocks.0.norm.weight",
        ]
        assert not any(r["frozen_grad_after_backward"].values()), (rank, r["frozen_grad_after_backward"])
        assert not any(r["frozen_grad_after_step"].values()), (rank, r["frozen_grad_after_step"])
        assert not r["frozen_in_optimizer"] and not r["frozen_with_state"]
        assert r["n_optimizer_params"] == r["n_state_entries"] == trainable
        assert r["frozen_unchanged"]
        assert not set(r["optim_param_names"]) & set(r["frozen_names"])


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world_size", [1, 3])
def test_state_dict_round_trip(stage, world_size):
    results = run_ranks(
        world_size, workers.roundtrip_worker, "mlp", stage, global_batches("mlp"), 3, ACCUM, MAX_NORM["mlp"]
    )
    for rank, r in enumerate(results):
        assert r["params_after_load"] == 0.0, (rank, r)
        assert r["shard_after_full_load"] == 0.0, (rank, r)
        assert r["groups_after_full_load"], (rank, r)
        assert r["full_after_full_load"] == 0.0, (rank, r)
        assert r["shard_after_shard_load"] == 0.0, (rank, r)
        assert r["moved_by_next_step"] > 1e-6, (rank, r)
        assert r["params_after_next_step"] == 0.0, (rank, r)


@pytest.mark.parametrize("stage", STAGES)
def test_resume_from_unsharded_optimizer_state(stage):
    """Load an unsharded AdamW's state_dict() (and its weights) halfway, train on: same as never stopping."""
    half = STEPS // 2
    mid, ref = reference("mlp", steps=half), reference("mlp")
    rest = global_batches("mlp")[half * ACCUM :]
    results = run_ranks(
        3, workers.resume_worker, "mlp", stage, mid["params"], mid["optim"], rest, STEPS - half, ACCUM, MAX_NORM["mlp"]
    )
    for rank, r in enumerate(results):
        assert_rel_close(r["clip_norms"], ref["clip_norms"][half:], 1e-10, f"rank {rank} clip norm after resume")
        assert_params_match("mlp", r["params"], ref, f"rank {rank} parameters after resume")


def _two_head_data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(GLOBAL_ROWS, models.MLP_IN, generator=gen, dtype=torch.float64)
    return x, torch.randn(GLOBAL_ROWS, 3, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("stage", STAGES)
def test_globally_unused_parameter_is_not_stepped(stage):
    x, y = _two_head_data()
    use_b = [False, True, False]  # head_a unused in step 1, head_b in steps 0 and 2
    want = workers.train_two_head(None, x, y, use_b)
    for world_size in (1, 2):
        got = run_ranks(world_size, workers.train_two_head, stage, x, y, use_b)[0]
        diff = models.max_abs_diff(got, want)
        assert diff <= 1e-10, f"world size {world_size}: max |θ - θ_ref| = {diff:.3g}"


@pytest.mark.parametrize("stage", STAGES)
def test_mixed_precision_round_trip_keeps_fp32_masters(stage):
    for r in run_ranks(2, workers.mixed_precision_roundtrip_worker, stage):
        assert r["master_dtypes"] == ["torch.float32"]
        assert r["master_max_diff"] == 0.0, r
