"""Functions that run inside the ranks of ``tests/parity/test_tiled_loss.py``: a real-shaped Llama (its untied
4096 x 256 head a stage-3 unit of its own) trained with ``zp.tiled_lm_loss`` on the backbone's hidden states, or
with the model's own loss.  Module-level so the worker pool pickles them by reference."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zero_plugin as zp
from tests import models

TILE_TOKENS = 7  # 2 rows x 12 tokens per rank: tiles that straddle rows and a last short one


def build_model():
    return models.make_real_llama(seed=0, tie=False)


def build_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.5)


def model_loss(model, batch) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def tiled_loss(model, batch) -> torch.Tensor:
    """The backbone (``model.model`` is ``model.base_model``) then the tiled head and loss, run inside the model's
    own forward so that stage 3's root unit is gathered around it; ``lm_head.weight`` is read outside the head's
    forward ([Note: direct reads of the output embedding])."""

    def backbone_and_loss():
        hidden = model.model(input_ids=batch["input_ids"]).last_hidden_state
        return zp.tiled_lm_loss(hidden, model.lm_head, batch["labels"], shift=True, tile_tokens=TILE_TOKENS)

    return through_forward(model, backbone_and_loss)


def through_forward(model, fn):
    """``fn()`` called as ``model``'s forward, so its forward hooks run around it (Lightning's forward
    redirection): how a training loop that calls a submodule itself keeps stage 3's root unit gathered."""
    model.forward = lambda: fn()
    try:
        return model()
    finally:
        del model.forward


LOSSES = {"model": model_loss, "tiled": tiled_loss}


def train_worker(stage: int, loss: str, batches: list) -> dict:
    """SGD steps on this rank's rows of each global batch; the losses (this rank's) and the full parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    model, opt = zp.setup(model, build_optimizer(model), zp.ZeroConfig(stage=stage))
    losses = []
    for batch in batches:
        value = LOSSES[loss](model, models.shard_batch(batch, rank, world))
        value.backward()
        opt.step()
        opt.zero_grad()
        losses.append(value.item())
    from zero_plugin.engines.engine import engine_of

    units = [u.name for u in getattr(engine_of(model, "test"), "units", [])]
    return {"losses": losses, "params": dict(zp.full_state_dict(model)), "units": units}


def sequence_parallel_worker(stage: int, tile_tokens: int) -> dict:
    """tests/parity/sequence_workers.py's float64 Llama at K = 2 on 2 ranks, its loss ``zp.tiled_lm_loss(...,
    sequence_parallel=model)`` on the backbone's hidden states instead of ``zp.sequence_parallel_loss`` on the
    logits: the per-step losses every rank saw, the full parameters after training."""
    from tests.parity import sequence_workers as sw

    model = sw.make_model("sdpa")
    config = zp.ZeroConfig(stage=stage, sequence_parallel_size=2)
    model, opt = zp.setup(model, torch.optim.SGD(sw.trainable(model), lr=sw.LR), config)
    batches = sw.make_batches(1, 16)
    losses = []
    for batch in zp.SequenceParallelLoader([batches[step][0] for step in range(sw.STEPS)], model):
        shift_labels = batch.pop("shift_labels")

        def backbone_and_loss(batch=batch, shift_labels=shift_labels):
            hidden = model.model(**batch).last_hidden_state
            return zp.tiled_lm_loss(
                hidden, model.lm_head, shift_labels, tile_tokens=tile_tokens, sequence_parallel=model
            )

        loss = through_forward(model, backbone_and_loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = zp.full_state_dict(model)
    return {"losses": losses, "params": {n: full[n] for n, _ in model.named_parameters() if n in full}}
