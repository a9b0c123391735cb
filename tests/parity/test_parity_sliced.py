"""Sliced linear units ([Note: sliced linear units] in zero_plugin/stage3/sliced.py) against a
single-process reference that sees every rank's batch.

A frozen, untied output layer (a float64 MLP head with a bias over an odd 97-row vocabulary; a tiny
transformers Llama's ``lm_head``, with every other weight training or under LoRA) is computed slice by
slice (``linear_slice_numel=100``: 6-17 slices whose rows never line up with the ranks' shards) and
must train exactly as the whole layer does; the runtime must never gather it whole.  A frozen untied
``embed_tokens`` unit is sliced the same way, and whether a layer is sliced depends on its full size,
not on the rank's shard of it.  A trainable or
tied head is not sliced and trains as before.  Tolerances as in ``test_parity_stage3.py``: float64
MLP 1e-10, transformers fp32 update-norm error 1e-3 and loss 1e-4 relative.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests import models
from tests.harness import run_ranks
from tests.parity import sliced_workers as workers

STEPS, ACCUM, GLOBAL_ROWS, MAX_NORM = 4, 2, 12, 1.0

# (kind, trainable_head, world_size, buffered, which units are sliced: "head", "none" or "blocks" =
# under the default unit choice, every frozen linear inside the decoder layers, [Note: frozen linear units];
# "wide_blocks": the same with slices of WIDE_SLICE_NUMEL elements, which the 800-element k/v weights reach
# only whole (2 x 400): their 400-element shards do not, and whether to slice is a property of the layer;
# "head_embed": the head and the frozen input embedding, each a unit of its own)
CASES = [
    ("mlp", False, 2, False, "head"),
    ("mlp", False, 3, False, "head"),
    ("mlp", False, 2, True, "head"),
    ("mlp", True, 2, False, "none"),
    ("mlp_tied", True, 3, False, "none"),
    ("llama", False, 2, False, "head"),
    ("llama", False, 3, True, "head"),
    ("lora", False, 3, False, "head"),
    ("lora_tied", False, 2, False, "none"),
    ("lora", False, 2, False, "blocks"),
    ("lora_tied", False, 3, True, "blocks"),
    ("lora", False, 2, False, "wide_blocks"),
    ("lora", False, 2, False, "head_embed"),
    ("lora", False, 3, True, "head_embed"),
]
# LoRA on q/v of 2 layers: q and v's base layers, k, o, gate, up, down
BLOCK_LINEARS = 2 * 7
WIDE_SLICE_NUMEL = 400


@functools.cache
def global_batches(kind: str) -> list:
    return models.make_batches(workers.batch_kind(kind), STEPS * ACCUM, world_size=1, per_rank_batch=GLOBAL_ROWS)


@functools.cache
def reference(kind: str, trainable_head: bool) -> dict:
    out = models.reference_train(
        functools.partial(workers.build_model, kind, trainable_head),
        workers.build_optimizer,
        global_batches(kind),
        steps=STEPS,
        accum=ACCUM,
        clip=MAX_NORM,
        loss=workers.loss,
    )
    model = workers.build_model(kind, trainable_head)
    model.load_state_dict(out["params"], strict=False)
    out["eval_logits"] = workers._eval_logits(model, global_batches(kind)[0])
    return out


@pytest.mark.parametrize(
    "kind,trainable_head,world_size,buffered,sliced",
    CASES,
    ids=[f"{c[0]}-train{int(c[1])}-ws{c[2]}-buf{int(c[3])}-{c[4]}" for c in CASES],
)
def test_sliced_head_parity(kind, trainable_head, world_size, buffered, sliced):
    ref = reference(kind, trainable_head)
    results = run_ranks(
        world_size,
        workers.sliced_worker,
        kind,
        trainable_head,
        global_batches(kind),
        STEPS,
        ACCUM,
        MAX_NORM,
        WIDE_SLICE_NUMEL if sliced == "wide_blocks" else workers.SLICE_NUMEL,
        buffered=buffered,
        policy={"blocks": "default", "wide_blocks": "default", "head_embed": "head_embed"}.get(sliced, "head"),
    )
    mlp = kind.startswith("mlp")
    rel = 1e-10 if mlp else 1e-4
    for rank, r in enumerate(results):
        names = [name for name, _ in r["sliced"]]
        if sliced == "head":
            assert len(names) == 1 and names[0].endswith("head"), f"rank {rank}: sliced units {r['sliced']}"
            assert r["sliced"][0][1] >= 6, f"rank {rank}: {r['sliced']}"
        elif sliced == "head_embed":
            assert sorted(n.split(".")[-1] for n in names) == ["embed_tokens", "lm_head"], f"rank {rank}: {names}"
            assert min(count for _, count in r["sliced"]) >= 6, f"rank {rank}: {r['sliced']}"
        elif sliced in ("blocks", "wide_blocks"):
            assert len(names) == BLOCK_LINEARS and all(".layers." in n for n in names), f"rank {rank}: {names}"
            fewest = 2 if sliced == "wide_blocks" else 5
            assert min(count for _, count in r["sliced"]) >= fewest, f"rank {rank}: {r['sliced']}"
        else:
            assert names == [], f"rank {rank}: a trainable or tied head must not be sliced, got {names}"
        assert r["whole_gathers"] == [], f"rank {rank}: sliced unit gathered whole {r['whole_gathers']}"
        assert r["unsharded_units_after"] == [], f"rank {rank}: {r['unsharded_units_after']}"
    losses = torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0)
    want = torch.tensor(ref["losses"], dtype=torch.float64)
    assert ((losses - want).abs() / want.abs()).max().item() <= rel, (losses.tolist(), want.tolist())
    for rank, r in enumerate(results):
        norms, want_norms = torch.tensor(r["clip_norms"]), torch.tensor(ref["clip_norms"])
        assert ((norms - want_norms).abs() / want_norms).max().item() <= rel, (rank, norms, want_norms)
    full = results[0]["full_state_dict"]
    params = {n: full[n] for n in ref["params"]}
    if mlp:
        diff = models.max_abs_diff(params, ref["params"])
        assert diff <= 1e-10, f"max |θ - θ_ref| = {diff:.3g}"
    else:
        err = models.update_norm_error(params, ref["params"], ref["init_params"])
        assert err <= 1e-3, f"update-norm error {err:.3g}"
    for rank, r in enumerate(results):  # forward-only (no_grad) path: every rank on the whole first batch
        got, want_logits = r["eval_logits"].double(), ref["eval_logits"].double()
        err = (torch.linalg.vector_norm(got - want_logits) / torch.linalg.vector_norm(want_logits)).item()
        assert err <= (1e-10 if mlp else 1e-3), f"rank {rank}: eval logits relative error {err:.3g}"
