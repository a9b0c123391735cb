"""Stage 3 against a single-process reference that sees every rank's batch.

Each case trains ``STEPS`` steps of two-group AdamW, accumulating ``ACCUM``
micro-batches (the first under ``zp.no_sync``) and clipping with
``zp.clip_grad_norm_``.  The global batch has ``GLOBAL_ROWS`` rows (divisible by
1-4), so one cached reference run per model serves every world size.  Stage 3
reduce-scatters every micro-batch even under ``no_sync`` (the sum is the same).

Checked per case: the mean over ranks of each rank's loss equals the global
loss; every rank's clip norm equals the reference's; ``zp.full_state_dict`` on
rank 0 equals the reference parameters (``{}`` elsewhere); the ranks' shards,
concatenated in rank order, are exactly the flattened full parameters (no
padding kept, every element owned once); no unit stays gathered after training.

A forward with grad that never gets a backward (issue #38) must leave the model as the same forward under
``torch.no_grad()`` would: the step, the loads and later training after it, bit for bit, fp32 and bf16
([Note: pending forward] in zero_plugin/stage3/hooks.py).

Tolerances (see ``tests/parity/test_parity_stages012.py`` for the reasoning):
OddMLP float64: parameters 1e-10 absolute, loss and clip norm 1e-10 relative.
Tiny Llama / LoRA fp32: update-norm error ||θ - θ_ref|| / ||θ_ref - θ0|| <= 1e-3,
loss and clip norm 1e-4 relative.  Activation checkpointing recomputes the same
ops, so checkpointed kinds are held against the plain model's reference.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests import models
from tests.harness import run_ranks
from tests.parity import pending_forward_workers
from tests.parity import stage3_workers as workers

STEPS, ACCUM, GLOBAL_ROWS = 10, 2, 12
# Reference pre-clip norms: mlp ~0.93 -> ~0.27, llama ~0.85-1.45, lora ~0.09-0.14; clipping bites on some steps.
MAX_NORM = {"mlp": 0.5, "llama": 1.0, "lora": 0.11}

CASES = (
    [(kind, ws) for kind in ("mlp", "llama", "lora") for ws in (1, 2, 3, 4)]
    + [(kind, ws) for kind in ("llama_ckpt_reentrant", "llama_ckpt") for ws in (1, 2, 4)]
    + [("lora_ckpt_reentrant", 2)]
)


@functools.cache
def global_batches(kind: str) -> list:
    return models.make_batches(
        workers.batch_kind(kind), STEPS * ACCUM, world_size=1, per_rank_batch=GLOBAL_ROWS, seed=0
    )


@functools.cache
def reference(base: str) -> dict:
    return models.reference_train(
        functools.partial(workers.build_model, base),
        workers.build_optimizer,
        global_batches(base),
        steps=STEPS,
        accum=ACCUM,
        clip=MAX_NORM[base],
    )


def assert_rel_close(got, want, rel: float, what: str) -> None:
    got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    err = ((got - want).abs() / want.abs()).max().item()
    assert err <= rel, f"{what}: max relative error {err:.3g} > {rel:g}\n got  {got.tolist()}\n want {want.tolist()}"


def assert_params_match(base: str, params: dict, ref: dict, what: str) -> None:
    missing = sorted(set(ref["params"]) - set(params))
    assert not missing, f"{what}: missing parameters {missing[:5]}"
    params = {n: params[n] for n in ref["params"]}
    if base == "mlp":
        diff = models.max_abs_diff(params, ref["params"])
        assert diff <= 1e-10, f"{what}: max |θ - θ_ref| = {diff:.3g} > 1e-10"
    else:
        err = models.update_norm_error(params, ref["params"], ref["init_params"])
        assert err <= 1e-3, f"{what}: update-norm error {err:.3g} > 1e-3"


def check_shards_tile(results: list[dict], full: dict, what: str) -> None:
    """Concatenating every rank's 1-D shard in rank order gives the flattened full parameter exactly."""
    for name, value in full.items():
        if name not in results[0]["shards"]:
            continue  # a tied alias: named_parameters lists the shared weight once
        pieces = [r["shards"][name] for r in results]
        assert all(p.dim() == 1 for p in pieces), f"{what}: {name} shards are not 1-D between uses"
        joined = torch.cat(pieces)
        assert joined.shape == value.reshape(-1).shape, (
            f"{what}: {name} shards hold {joined.numel()} elements, the parameter has {value.numel()}"
        )
        assert torch.equal(joined, value.reshape(-1)), f"{what}: {name} shards differ from the gathered values"


BUFFERED_CASES = [("mlp", 2), ("mlp", 3), ("llama", 2)]


@pytest.mark.parametrize("kind,world_size", CASES, ids=[f"{k}-ws{w}" for k, w in CASES])
def test_stage3_parity_with_reference(kind, world_size):
    check_stage3_parity(kind, world_size)


@pytest.mark.parametrize("kind,world_size", BUFFERED_CASES, ids=[f"{k}-ws{w}" for k, w in BUFFERED_CASES])
def test_stage3_parity_buffered_layout(kind, world_size):
    """The rank-major buffered gathers and reduce-scatters NCCL uses, forced on gloo (collectives.py)."""
    check_stage3_parity(kind, world_size, buffered=True)


@pytest.mark.parametrize("kind,world_size", [("mlp", 2), ("llama", 3)])
def test_stage3_parity_with_persistent_small_parameters(kind, world_size):
    """persistence_threshold: parameters with at most that many elements (biases, norm weights) join the
    root unit ([Note: persistent parameters] in stage3/policy.py); training is unchanged."""
    results = check_stage3_parity(kind, world_size, persistence_threshold=1000)
    model = workers.build_model(kind)
    small = sorted(n for n, p in model.named_parameters() if p.numel() <= 1000)
    assert small, "the model must have small parameters for this test to mean anything"
    for r in results:
        assert set(small) <= set(r["root_params"]), (small, r["root_params"])


def check_stage3_parity(kind: str, world_size: int, buffered: bool = False, persistence_threshold: int = 0):
    base = workers.base_kind(kind)
    ref = reference(base)
    results = run_ranks(
        world_size,
        workers.parity_worker,
        kind,
        global_batches(base),
        STEPS,
        ACCUM,
        MAX_NORM[base],
        buffered=buffered,
        persistence_threshold=persistence_threshold,
    )
    rel = 1e-10 if base == "mlp" else 1e-4
    global_losses = torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0).tolist()
    assert_rel_close(global_losses, ref["losses"], rel, "per-step global loss")
    for rank, r in enumerate(results):
        assert_rel_close(r["clip_norms"], ref["clip_norms"], rel, f"rank {rank} clip norm")
        assert r["unsharded_units_after"] == [], f"rank {rank}: units still gathered {r['unsharded_units_after']}"
    ckpt = workers.KINDS[kind][1]
    want_ckpt = [] if ckpt is None else [ckpt == "reentrant"] * 2  # both decoder layers
    assert results[0]["checkpointing"] == want_ckpt, f"checkpointing in effect: {results[0]['checkpointing']}"
    full = results[0]["full_state_dict"]
    assert_params_match(base, full, ref, "full_state_dict on rank 0")
    assert all(r["full_state_dict"] == {} for r in results[1:]), "full_state_dict must be {} off rank 0"
    check_shards_tile(results, full, kind)
    return results


def test_reference_clip_bites_on_some_steps():
    for base in MAX_NORM:
        norms = reference(base)["clip_norms"]
        assert any(n > MAX_NORM[base] for n in norms) and any(n < MAX_NORM[base] for n in norms), (base, norms)


PENDING_CASES = [
    ("step", None),
    ("step", "bf16"),
    ("load_checkpoint", None),
    ("load_checkpoint", "bf16"),
    ("gathered_edit", None),
    ("load_state_dict", "bf16"),
]


@pytest.mark.parametrize("sequence,param_dtype", PENDING_CASES, ids=[f"{s}-{d or 'fp32'}" for s, d in PENDING_CASES])
def test_forward_without_backward_as_under_no_grad(sequence, param_dtype, tmp_path):
    """Issue #38: the root and last units stay gathered after a forward with grad until its backward; with
    none coming, the step assigned shard gradients to full-size parameters and load_checkpoint refused."""
    ops = pending_forward_workers.SEQUENCES[sequence]
    common = ("llama", global_batches("llama"), ops)
    got = run_ranks(
        2, pending_forward_workers.sequence_worker, *common, True, str(tmp_path / "g"), param_dtype=param_dtype
    )
    want = run_ranks(
        2, pending_forward_workers.sequence_worker, *common, False, str(tmp_path / "n"), param_dtype=param_dtype
    )
    for rank in range(2):
        pending_forward_workers.assert_same_records(got[rank], want[rank], f"{sequence} rank {rank}")
        assert want[rank][-1] == ("gathered", []), want[rank][-1]
