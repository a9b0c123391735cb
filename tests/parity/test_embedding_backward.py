"""Stage 3 does not gather an embedding for its backward ([Note: weights unread in backward] in
zero_plugin/stage3/policy.py): a real-shaped Llama (vocabulary 4096 x hidden 256, so an untied ``embed_tokens`` is
a unit of its own) in float64, every weight training, 2 micro-batches accumulated per step under ``zp.no_sync``
and clipped.  Bit for bit the same parameters as stage 3 gathering the embedding for backward, as it did before
(the embedding's backward never reads the weight).  Against one process that sees every rank's batch: losses
and clip norms to 1e-6, the update-norm error to 1e-5 (3.7e-6 at 3 ranks): transformers' eager attention takes
its softmax in float32, so rows batched differently round apart at float32's resolution, and AdamW turns a
near-zero gradient's rounding into a step of about lr either way; the gathered path differs from the one
process exactly as much.  The embedding's unit is gathered once per forward and never in backward (its gradient
reaches it sharded and is accumulated in the lent full shape), in gloo's in-place layout and NCCL's buffered
one, at 2 and 3 ranks, and with activation checkpointing of the layers; a tied embedding stays in the root unit.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests import models
from tests.harness import run_ranks
from tests.parity import embedding_workers as workers

STEPS, ACCUM, MAX_NORM = 2, 2, 1.0

# (world_size, buffered layout, tied, activation checkpointing); the first also trains with the embedding
# gathered for backward and compares bit for bit
CASES = [(2, False, False, False), (3, True, False, False), (2, True, False, True), (2, False, True, False)]


@functools.cache
def global_batches(world_size: int) -> list:
    return models.make_batches("llama", STEPS * ACCUM, world_size, per_rank_batch=2)


@functools.cache
def reference(world_size: int, tie: bool) -> dict:
    return models.reference_train(
        functools.partial(workers.build_model, tie),
        workers.build_optimizer,
        global_batches(world_size),
        steps=STEPS,
        accum=ACCUM,
        clip=MAX_NORM,
        loss=workers.loss,
    )


@pytest.mark.parametrize(
    "world_size,buffered,tie,checkpointing",
    CASES,
    ids=[f"ws{w}-buf{int(b)}-tie{int(t)}-ckpt{int(c)}" for w, b, t, c in CASES],
)
def test_embedding_trains_without_a_backward_gather(world_size, buffered, tie, checkpointing):
    ref = reference(world_size, tie)
    results = run_ranks(
        world_size,
        workers.embedding_worker,
        global_batches(world_size),
        STEPS,
        ACCUM,
        MAX_NORM,
        buffered,
        tie,
        checkpointing,
        (world_size, buffered, tie, checkpointing) == CASES[0],
    )
    for rank, r in enumerate(results):
        if tie:
            assert r["embed_units"] == [], f"rank {rank}: a tied embedding is in the root unit: {r['embed_units']}"
        else:
            assert r["embed_units"] == [("model.embed_tokens", False)], f"rank {rank}: {r['embed_units']}"
            assert r["embed_gathers"] == ["forward"] * (STEPS * ACCUM), f"rank {rank}: {r['embed_gathers']}"
        if "equal_to_gathered" in r:  # and the control: gathered for backward, the same bits
            assert r["gathered_embed_gathers"] == ["forward", "backward"] * (STEPS * ACCUM), r["gathered_embed_gathers"]
            assert r["equal_to_gathered"], f"rank {rank}: parameters differ from stage 3 gathering the embedding"
        assert r["unsharded_units_after"] == [], f"rank {rank}: {r['unsharded_units_after']}"
        norms = torch.tensor(r["clip_norms"], dtype=torch.float64)
        want_norms = torch.tensor(ref["clip_norms"], dtype=torch.float64)
        assert ((norms - want_norms).abs() / want_norms).max().item() <= 1e-6, (rank, norms, want_norms)
    losses = torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0)
    want = torch.tensor(ref["losses"], dtype=torch.float64)
    assert ((losses - want).abs() / want.abs()).max().item() <= 1e-6, (losses.tolist(), want.tolist())
    full = results[0]["full_state_dict"]
    params = {n: full[n] for n in ref["params"]}
    embed = "model.embed_tokens.weight"
    assert not torch.equal(ref["params"][embed], ref["init_params"][embed]), "the embedding did not train"
    err = models.update_norm_error(params, ref["params"], ref["init_params"])
    assert err <= 1e-5, f"update-norm error {err:.3g}"
