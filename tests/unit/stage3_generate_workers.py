"""Functions that run inside the ranks of ``tests/unit/test_stage3_behaviour.py``: generation and
evaluation without autograd at stage 3.

Module-level so the worker pool pickles them by reference; the shared helpers (setup, training loop,
single-process reference, parity numbers) are in ``stage3_behaviour_workers.py``.
"""

from __future__ import annotations

import torch

from tests import models
from tests.unit.stage3_behaviour_workers import (
    _all_sharded,
    _parity,
    _rank_world,
    _setup,
    _unsharded,
    reference,
    train_steps,
)

# ---------------------------------------------------------------------------------------------------------------
# generate


def generate_worker(prompt_lens: list[int], max_new: list[int], synced_gpus: bool | None) -> dict:
    """Greedy ``generate`` at stage 3 vs the unsharded model on this rank's own prompt."""
    rank, _ = _rank_world()
    ref = models.make_tiny_llama(layers=2).eval()
    model, _opt = _setup(models.make_tiny_llama(layers=2))
    model.eval()
    gen = torch.Generator().manual_seed(123 + (rank if len(set(prompt_lens)) > 1 else 0))
    prompt = torch.randint(3, models.LLAMA_VOCAB, (1, prompt_lens[rank]), generator=gen)
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=max_new[rank], do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(prompt, **kwargs)
    if synced_gpus is not None:
        kwargs["synced_gpus"] = synced_gpus
    got = model.generate(prompt, **kwargs)
    return {
        "got": got.tolist(),
        "want": want.tolist(),
        "unsharded_after": _unsharded(model),
        "sharded_after": _all_sharded(model),
    }


# ---------------------------------------------------------------------------------------------------------------
# eval without autograd


def eval_worker(mode: str) -> dict:
    """Logits under no_grad / inference_mode equal the unsharded model's; units released; training goes on."""
    rank, world = _rank_world()
    batches = models.make_batches("llama", 3, world, per_rank_batch=2, seed=3)
    ref_model = models.make_tiny_llama(layers=2).eval()
    model, opt = _setup(models.make_tiny_llama(layers=2))
    model.eval()
    local = models.shard_batch(batches[0], rank, world)
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        logits = [model(**local).logits.clone() for _ in range(2)]  # twice: the second call re-gathers
        want = ref_model(**local).logits
    out = {
        "logit_diffs": [(x - want).abs().max().item() for x in logits],
        "unsharded_after_eval": _unsharded(model),
        "sharded_after_eval": _all_sharded(model),
    }
    model.train()
    got = train_steps(model, opt, batches[1:], accum=1, clip=1.0)
    ref, _, _ = reference(lambda: models.make_tiny_llama(layers=2), batches[1:], accum=1, clip=1.0)
    out.update(_parity(model, got, ref))
    out["unsharded_after_train"] = _unsharded(model)
    return out
