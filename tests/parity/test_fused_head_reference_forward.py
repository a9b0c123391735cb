"""Stage 3, LM head read outside its forward (TRL's fused head), with forwards under ``torch.no_grad()``
around the one that trains, as TRL's PEFT trainers without a ``ref_model`` do every step: ``KTOTrainer`` runs
the policy on the KL batch under no_grad, then the policy with grad, then the reference (the same model, its
adapter disabled) under no_grad; ``DPOTrainer`` / ``RLOOTrainer`` the policy then the reference (issue 37).

Real-shaped Llama (untied 4096 x 256 head: a stage-3 unit of its own), LoRA on q/v, TRL's ``add_fused_lm_head``
(``tests/parity/fused_head_workers.py``), 2 ranks against a single-process reference that sees both ranks'
batches; tolerances as ``test_fused_head.py`` (fp32).

Failed on d38e7c5: ``Unit.forget_forward`` (zero_plugin/stage3/unit.py) clears ``_inputs_hooked`` when
the no_grad forward forgets the policy's forward ([Note: pending forward] in hooks.py), so when that forward's
backward comes, ``_release_after_reduce`` releases a decoder layer's unit as soon as its last LoRA gradient is
reduced, before the frozen ``q_proj`` base weight's grad-input matmul ran (``setStorage: ... storage of size 0``).
It now keeps ``_inputs_hooked`` (the forgotten forward's ``_PostBackward`` still reports): both cases match the
reference (clip norms to 1e-7, update-norm error 4e-7).
"""

from __future__ import annotations

import functools

import pytest
import torch

import zero_plugin as zp
from tests import models
from tests.harness import run_ranks
from tests.parity import fused_head_workers as workers
from tests.parity.stage3_workers import train_loop

STEPS, ACCUM, MAX_NORM, WORLD = 2, 2, 1.0, 2


def _fused(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["labels"], fused_lm_head=True).loss


def kto_like(model, batch):
    """no_grad policy (KL batch: the labels rolled), policy with grad, no_grad reference (adapter disabled)."""
    with torch.no_grad():
        kl = _fused(model, {**batch, "labels": batch["labels"].roll(1, 0)})
    policy = _fused(model, batch)
    with torch.no_grad(), model.disable_adapter():
        ref = _fused(model, batch)
    return policy - ref + 0.0 * kl


def dpo_like(model, batch):
    """policy with grad, then the reference (adapter disabled) under no_grad."""
    policy = _fused(model, batch)
    with torch.no_grad(), model.disable_adapter():
        ref = _fused(model, batch)
    return policy - ref


LOSSES = {"kto_like": kto_like, "dpo_like": dpo_like}


@functools.cache
def global_batches() -> list:
    return models.make_batches("llama", STEPS * ACCUM, WORLD, per_rank_batch=2)


def worker(loss_name: str, batches: list) -> dict:
    model = workers.build_model("lora")
    model, opt = zp.setup(model, workers.build_optimizer(model), zp.ZeroConfig(stage=3))
    out = train_loop(model, opt, batches, STEPS, ACCUM, MAX_NORM, loss_fn=LOSSES[loss_name])
    out["full_state_dict"] = zp.full_state_dict(model)
    return out


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_no_grad_forwards_around_the_trained_one(loss_name):
    ref = models.reference_train(
        functools.partial(workers.build_model, "lora"),
        workers.build_optimizer,
        global_batches(),
        steps=STEPS,
        accum=ACCUM,
        clip=MAX_NORM,
        loss=LOSSES[loss_name],
    )
    results = run_ranks(WORLD, worker, loss_name, global_batches())
    losses = torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0)
    want = torch.tensor(ref["losses"], dtype=torch.float64)
    assert (losses - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item()), (losses, want)
    for rank, r in enumerate(results):
        norms, want_norms = torch.tensor(r["clip_norms"]), torch.tensor(ref["clip_norms"])
        assert ((norms - want_norms).abs() / want_norms).max().item() <= 5e-4, (rank, norms, want_norms)
    full = results[0]["full_state_dict"]
    err = models.update_norm_error({n: full[n] for n in ref["params"]}, ref["params"], ref["init_params"])
    assert err <= 1e-3, f"update-norm error {err:.3g}"
