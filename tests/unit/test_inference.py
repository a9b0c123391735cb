"""Models set up for evaluation only (issue 19, item 6; [Note: evaluation-only models] in
zero_plugin/stage3/inference.py): ``zp.setup(model, None, config)``.

Stage 3 shards the parameters 1/N with forward hooks only; the references are the same seeded model,
unsharded, in the same process (float64: the outputs must be bitwise equal, since every unit computes on
exactly the gathered weights).  Stages 0-2 keep the model replicated.  Accelerate's ``prepare_model(m,
evaluation_mode=True)`` is in tests/integrations/test_accelerate_in_process.py, TRL's DPOTrainer in
tests/integrations/test_trl_dpo.py.
"""

from __future__ import annotations

import pytest
import torch

from tests import models
from tests.harness import run_ranks
from tests.unit import inference_workers as w


@pytest.mark.parametrize("kind", ["mlp", "llama", "llama_untied"])
@pytest.mark.parametrize("world", [2, 3])
def test_forward_equals_unsharded_and_parameters_are_sharded(kind, world):
    for r in run_ranks(world, w.forward_matches, kind):
        assert r["equal_no_grad"] and r["equal_inference"] and r["equal_grad_mode"]
        assert not r["out_requires_grad"] and r["grad_enabled_after"]
        assert r["param_hooks"] == 0 and r["grads"] == 0
        assert r["sharded"] and r["requires_grad_kept"]
        measured = r["measured"]
        assert measured["grads"] == 0 and measured["optimizer"] == 0
        # 1/N of the model (padding: at most one element per parameter and rank); theory says the same
        params = len(list(w._make(kind).parameters()))
        assert measured["params"] <= r["full_bytes"] / world + params * 8, (measured, r["full_bytes"])
        assert measured["params"] >= r["full_bytes"] / world - params * 8
        assert r["theory"]["params"] == pytest.approx(r["full_bytes"] / world)


def test_input_that_requires_grad_is_refused():
    for r in run_ranks(2, w.input_needing_grad_refused):
        assert "evaluation only" in r["message"] and "torch.no_grad()" in r["message"]
        assert r["grad_after"] and r["equal_after"]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_0_to_2_stay_replicated(stage):
    for r in run_ranks(2, w.replicated_stages, stage):
        assert r == {"same_object": True, "optimizer": None, "rank0_values": True, "attached": False}


@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_evaluation_only_model_can_be_set_up_for_training_later(kind):
    steps, world = 3, 2
    results = run_ranks(world, w.evaluation_then_training, kind, steps)
    # the evaluation set-up leaves nothing behind: training is stage 3's from scratch, to the bit
    for r in results:
        assert r["losses"] == r["plain_losses"]
        for name, value in r["plain_state"].items():
            assert torch.equal(r["state"][name], value), name
    # and stage 3's training is the single-process one on the same per-rank halves (each half-batch's mean loss,
    # averaged), on the ranks' one thread (models.ranks_threads)
    halves = [
        models.shard_batch(batch, rank, world)
        for batch in models.make_batches("mlp" if kind == "mlp" else "llama", steps, world, 2)
        for rank in range(world)
    ]
    ref = models.reference_train(
        lambda: w._make(kind), lambda m: models.two_group_adamw(m, lr=1e-2), halves, steps, accum=world
    )
    losses = ref["losses"]
    got = results[0]["state"]
    for name, value in ref["state"].items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-10)
    mean = [sum(r["losses"][i] for r in results) / world for i in range(steps)]
    assert mean == pytest.approx(losses, rel=1e-6)


@pytest.mark.parametrize("stage,train", [(0, True), (1, True), (2, True), (3, True), (3, False)])
def test_release_removes_every_hook_setup_registered(stage, train):
    for r in run_ranks(2, w.release_removes_every_hook, stage, train):
        assert r["during"] > r["before"]
        assert r["after"] == r["before"], r
