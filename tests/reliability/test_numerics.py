"""Non-finite gradients never reach the weights, and every rank makes the same skip decision.

Per-step gradient state: gradients thrown away with ``model.zero_grad()`` or ``optimizer.zero_grad()``
(either ``set_to_none``) never reach a later step, wherever the stage keeps them, and neither does what
``clip_grad_norm_`` cached about them (fp16 unscaling, the global norm the inf/NaN check reuses).
``ZeroConfig.clip_grad_norm`` clips as torch's ``clip_grad_norm_`` right before ``optimizer.step()``.
References are single-process torch on the global batch, float64 (1e-10) unless the run is fp16.
"""

from __future__ import annotations

import pytest
import torch

from tests import models
from tests.harness import run_ranks
from tests.reliability import numerics_workers as NW

GLOBAL_ROWS = 4  # divisible by world sizes 1 and 2


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_inf_on_one_rank_skips_step_everywhere_and_lowers_scale(stage):
    results = run_ranks(2, NW.poisoned_step_worker, stage, "fp16", "inf")
    for r in results:
        assert r["changed"] == [True, False, True], r  # step 1 skipped on every rank, training continues
        assert r["skipped"] == [0, 1, 1]
        assert r["scales"][1] == r["scales"][0] / 2  # dynamic scale backed off
        assert r["finite"]
    assert results[0]["scales"] == results[1]["scales"]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_needs_no_scaler(stage):
    r = run_ranks(2, NW.poisoned_step_worker, stage, "bf16", "1.0")[0]
    assert r["scales"] == [1.0, 1.0, 1.0] and r["changed"] == [True, True, True] and r["skipped"] == [0, 0, 0]


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_nan_loss_without_scaler_is_reported_not_stepped(stage):
    results = run_ranks(2, NW.poisoned_step_worker, stage, None, "nan")
    for r in results:
        assert r["changed"] == [True, False, True] and r["skipped"] == [0, 1, 1] and r["finite"]
        assert any("non-finite gradient" in w for w in r["warnings"]), r["warnings"]


# -- discarded gradients and per-step state ---------------------------------------------------------
def _batches(steps: int, seed: int) -> list:
    return models.make_batches("mlp", steps, world_size=1, per_rank_batch=GLOBAL_ROWS, seed=seed)


def _torch_reference(batches: list, opt_fn, clips: tuple = ()) -> dict:
    """Single-process float64 OddMLP; before each step ``clip_grad_norm_`` once per entry of ``clips``."""
    model = models.make_odd_mlp()
    opt = opt_fn(model)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    norms = []
    for batch in batches:
        models.loss_fn(model, batch).backward()
        for max_norm in clips:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "init_params": init, "norms": norms}


def _assert_params(params: dict, ref: dict, what: str, tol: float = 1e-10) -> None:
    diff = models.max_abs_diff({n: params[n].double() for n in ref["params"]}, ref["params"])
    assert diff <= tol, f"{what}: max |θ - θ_ref| = {diff:.3g} > {tol:g}"


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_discarded_probe_gradients_never_reach_the_step(stage, world_size):
    """A probe backward, then model.zero_grad() / optimizer.zero_grad() (set_to_none True and False), then
    the real backward and step: the same parameters as torch trained on the real batches alone."""
    batches, probes = _batches(2, seed=1), _batches(2, seed=2)
    ref = _torch_reference(batches, NW.adamw)
    result = run_ranks(world_size, NW.probe_discarded_worker, stage, batches, probes)[0]
    assert sorted(result) == sorted(NW.PROBE_DISCARDS)
    for how, params in result.items():
        _assert_params(params, ref, f"stage {stage}, world {world_size}, discard {how}")


@pytest.mark.parametrize("how", ["optimizer", "model"])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_clip_then_zero_grad_without_step_unscales_the_next_step(stage, world_size, how):
    """clip_grad_norm_ (which unscales) then zero_grad and no step: the next step must unscale its own
    gradients again (SGD, so still-scaled gradients would move the weights 65536x too far)."""
    batches = _batches(3, seed=4)
    ref = _torch_reference(batches[1:], NW.sgd)
    for rank, r in enumerate(run_ranks(world_size, NW.skipped_spike_worker, stage, "fp16", how, batches, None)):
        err = models.update_norm_error({n: r["params"][n] for n in ref["params"]}, ref["params"], ref["init_params"])
        assert err <= 1e-2, f"rank {rank}: update-norm error {err:.3g} against float64 torch (fp16 rounding ~1e-3)"
        assert r["skipped"] == 0 and r["scale"] == 2.0**16


@pytest.mark.parametrize("how", ["optimizer", "model"])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clip_then_zero_grad_without_step_keeps_the_nan_check(stage, world_size, how):
    """clip_grad_norm_ then zero_grad and no step; the next batch's loss is NaN on the last rank: that
    step is skipped (the cached finite norm of the discarded gradients must not vouch for it)."""
    batches = _batches(3, seed=4)
    ref = _torch_reference(batches[2:], NW.sgd)
    for r in run_ranks(world_size, NW.skipped_spike_worker, stage, "fp64", how, batches, 1):
        assert r["skipped"] == 1 and any("non-finite gradient" in w for w in r["warnings"]), r
        _assert_params(r["params"], ref, f"stage {stage}, world {world_size}, discard {how}")


# -- ZeroConfig.clip_grad_norm ---------------------------------------------------------------------------
CONFIG_MAX, USER_MAX = 0.9, 1.0  # reference pre-clip norms of _batches(6, 5): 1.36 1.13 0.86 0.88 0.96 0.75


def _bites_sometimes(norms: list, max_norm: float) -> bool:
    return any(n > max_norm for n in norms) and any(n < max_norm for n in norms)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_config_clip_grad_norm_matches_torch(stage, world_size):
    batches = _batches(6, seed=5)
    ref = _torch_reference(batches, models.two_group_adamw, clips=(CONFIG_MAX,))
    assert _bites_sometimes(ref["norms"], CONFIG_MAX), ref["norms"]
    r = run_ranks(world_size, NW.config_clip_worker, stage, batches, CONFIG_MAX, None)[0]
    _assert_params(r["params"], ref, f"stage {stage}, world {world_size}")


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_config_clip_after_user_clip_is_torchs_two_calls(stage):
    """An explicit zp.clip_grad_norm_ in the step and the configured clip both apply, in that order, as
    two torch clip_grad_norm_ calls would; the user's call returns the norm before any clipping."""
    batches = _batches(6, seed=5)
    ref = _torch_reference(batches, models.two_group_adamw, clips=(USER_MAX, CONFIG_MAX))
    assert _bites_sometimes(ref["norms"][0::2], USER_MAX) and _bites_sometimes(ref["norms"][1::2], CONFIG_MAX)
    for r in run_ranks(2, NW.config_clip_worker, stage, batches, CONFIG_MAX, USER_MAX):
        _assert_params(r["params"], ref, f"stage {stage}")
        torch.testing.assert_close(r["user_norms"], ref["norms"][0::2], rtol=1e-10, atol=0)


@pytest.mark.parametrize("stage", [2, 3])
def test_peft_model_zero_grad_discards_probe_gradients(stage):
    """PEFT (and HF Trainer) call zero_grad() on the PeftModel that was set up (fp32 tiny Llama with LoRA;
    tolerance of the parity tests: update-norm error 1e-3)."""
    batches = models.make_batches("llama", 2, world_size=1, per_rank_batch=GLOBAL_ROWS, seed=1)
    probes = models.make_batches("llama", 2, world_size=1, per_rank_batch=GLOBAL_ROWS, seed=2)
    model = models.make_tiny_llama_lora(layers=2)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    ref = models.reference_train(lambda: model, NW.adamw, batches, steps=2)
    ref = {k: {n: v for n, v in ref[k].items() if n in trainable} for k in ("params", "init_params")}
    params = run_ranks(2, NW.lora_probe_discarded_worker, stage, batches, probes)[0]
    err = models.update_norm_error({n: params[n] for n in ref["params"]}, ref["params"], ref["init_params"])
    assert err <= 1e-3, f"update-norm error {err:.3g}"


# -- the inf/NaN check folded into stage 0's average ([Note: finite check in the average]) -------------------
@pytest.mark.parametrize("poison", ["loss", "grad_in_place", "hook_and_write"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_stage0_unclipped_nonfinite_is_skipped_everywhere(world_size, poison):
    """No clipping, no scaler: an inf/NaN in the reduced gradients on one rank (from the loss, or written into
    ``param.grad`` after backward, which the check made while averaging cannot have seen) skips the step on
    every rank, as before the check was folded into the average."""
    for r in run_ranks(world_size, NW.unclipped_poison_worker, 0, poison):
        assert r["changed"] == [True, False, True] and r["skipped"] == [0, 1, 1], r
        assert any("non-finite gradient" in w for w in r["warnings"]), r["warnings"]


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_stage0_step_reads_no_gradient_norm_at_a_power_of_two_world(dtype):
    """Stage 0 at N = 2: the all-reduce's average (a multiplication by 1/N, exact for a power of two) takes
    the inf/NaN answer on the way, so the step does no pass of its own over the gradients (issue #49: a
    foreach norm over Ψ was DDP + optimizer's step plus one read of every gradient).  Where gradients were
    written after backward the step reads those (test above); at N = 3 division is kept (x / 3 is not x * (1/3))
    and so is the norm."""
    for r in run_ranks(2, NW.unclipped_poison_worker, 0, "none", dtype):
        assert r["skipped"] == [0, 0, 0] and r["changed"] == [True, True, True], r
        assert r["norm_ops"] == [[], [], []], r["norm_ops"]
    r3 = run_ranks(3, NW.unclipped_poison_worker, 0, "none", dtype)[0]
    assert all(ops for ops in r3["norm_ops"]), r3["norm_ops"]


# -- the inf/NaN check folded into fp16's unscale ([Note: finite check in the unscale]) -------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_step_reads_no_gradient_norm_besides_the_unscale(stage):
    """fp16 loss scaling: the unscale (GradScaler's check-and-unscale kernel) takes the inf/NaN answer in its
    own pass over the owned gradients, so the step makes no second pass (a foreach norm) over them; a NaN loss
    on one rank still skips the step everywhere and halves the scale."""
    for r in run_ranks(2, NW.fp16_unscale_worker, stage, "none"):
        assert r["skipped"] == [0, 0, 0] and r["changed"] == [True, True, True], r
        assert r["norm_ops"] == [[], [], []], r["norm_ops"]
    for r in run_ranks(2, NW.fp16_unscale_worker, stage, "loss"):
        assert r["changed"] == [True, False, True] and r["skipped"] == [0, 1, 1], r
        assert r["scales"][1] == r["scales"][0] / 2, r["scales"]


@pytest.mark.parametrize("stage", [0, 3])
def test_fp16_gradient_written_after_the_unscale_is_read_by_the_step(stage):
    """``opt.unscale_()``, then an inf written into an owned gradient on one rank: the unscale's answer covers
    the gradients as they were, so the step reads the written one again and skips everywhere."""
    for r in run_ranks(2, NW.fp16_unscale_worker, stage, "after_unscale"):
        assert r["changed"] == [True, False, True] and r["skipped"] == [0, 1, 1], r
