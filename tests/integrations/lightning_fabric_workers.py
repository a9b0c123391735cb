"""Fabric loops that run inside the ranks of ``tests/integrations/test_lightning.py`` and
``test_lightning_consolidate.py``: the user's loop (accumulation under ``no_backward_sync``,
``clip_gradients``, step), two-step ``setup_module`` / ``setup_optimizers``, ``fabric.save`` / ``load``, and a
Trainer checkpoint resumed at another stage beside a Fabric save.
The Trainer's workers and the shared model, optimizer and rank set-up are in ``lightning_workers.py``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests import models
from tests.integrations.lightning_setup import cpu_fabric, lightning_ranks
from tests.integrations.lightning_workers import (
    ACCUM,
    CLIP,
    LR,
    PER_RANK_BATCH,
    build_net,
    checkpoint_worker,
    make_optimizer,
    resume_run,
)


def _fabric(strategy: str):
    """``lightning_setup.cpu_fabric`` on a registered name, or ``"<preset>:<checkpoint>"`` for a
    ``ZeroFabricStrategy``."""
    if ":" in strategy:
        from zero_plugin.integrations.lightning import ZeroFabricStrategy

        preset, checkpoint = strategy.split(":")
        strategy = ZeroFabricStrategy(config=preset, checkpoint=checkpoint)
    return cpu_fabric(strategy)


def fabric_train(fabric, model, opt, batches: list, losses: list, norms: list) -> None:
    """The user's loop: accumulation under no_backward_sync, clip_gradients, step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(len(batches) // ACCUM):
        for i in range(ACCUM):
            micro = models.shard_batch(batches[step * ACCUM + i], rank, world)
            with fabric.no_backward_sync(model, enabled=i < ACCUM - 1):
                loss = model(**micro).loss
                fabric.backward(loss / ACCUM)
            losses.append(loss.item())
        norms.append(float(fabric.clip_gradients(model, opt, max_norm=CLIP)))
        opt.step()
        opt.zero_grad()


def fabric_inference_worker(strategy: str) -> dict:
    """``setup_module`` (inference) then ``setup_optimizers`` (two-step setup), against joint ``setup``."""
    with lightning_ranks():
        fabric = _fabric(strategy)
        batches = models.make_batches("llama", 2 * ACCUM, 2, PER_RANK_BATCH, seed=0)
        first = models.shard_batch(batches[0], dist.get_rank(), dist.get_world_size())
        with torch.no_grad():
            want = build_net("llama")(**first).logits
        model = fabric.setup_module(build_net("llama"))
        with torch.no_grad():
            got = model(**first).logits
        out = {"logits_err": float((got - want).abs().max())}
        # Two-step setup; one param group, since a sharded module's parameters are 1-D shards here.
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
        joint = build_net("llama")
        joint_model, joint_opt = fabric.setup(joint, torch.optim.AdamW(joint.parameters(), lr=LR))
        for m, o, key in ((model, opt, "two_step"), (joint_model, joint_opt, "joint")):
            losses: list = []
            fabric_train(fabric, m, o, batches, losses, [])
            out[key] = losses
            out[key + "_state"] = fabric_state(fabric, m)
        return out


def fabric_state(fabric, model) -> dict:
    """Collective under ZeRO; rank 0's full state dict (DDP: every rank has it, keep rank 0's)."""
    state = fabric.strategy.get_module_state_dict(model._forward_module)
    return state if dist.get_rank() == 0 else {}


def fabric_worker(kind: str, strategy: str, steps: int = 3, save: str | None = None) -> dict:
    """A Fabric loop; with ``save``, also fabric.save at the end and reload into fresh objects, then train on."""
    with lightning_ranks():
        fabric = _fabric(strategy)
        net = build_net(kind)
        init = {k: v.detach().clone() for k, v in net.state_dict().items()}
        model, opt = fabric.setup(net, make_optimizer(net.parameters()))
        batches = models.make_batches("llama", 2 * steps * ACCUM, 2, PER_RANK_BATCH, seed=0)
        losses, norms = [], []
        fabric_train(fabric, model, opt, batches[: steps * ACCUM], losses, norms)
        out = {"init": init, "mid": fabric_state(fabric, model), "losses": list(losses), "norms": list(norms)}
        if save is None:
            return out
        fabric.save(save, {"model": model, "optimizer": opt, "step": steps})
        fabric_train(fabric, model, opt, batches[steps * ACCUM :], losses, norms)
        out["final"] = fabric_state(fabric, model)
        fresh = build_net(kind)
        model2, opt2 = fabric.setup(fresh, make_optimizer(fresh.parameters()))
        state = {"model": model2, "optimizer": opt2, "step": 0}
        remainder = fabric.load(save, state)
        out["loaded_step"] = state["step"]
        out["remainder"] = sorted(remainder)
        losses2, norms2 = [], []
        fabric_train(fabric, model2, opt2, batches[steps * ACCUM :], losses2, norms2)
        out.update(
            resumed=fabric_state(fabric, model2),
            resumed_losses=losses2,
            all_losses=list(losses),
            is_dir=os.path.isdir(save),
        )
        return out


def cross_stage_resume_worker(save_strategy: str, load_strategy: str, ckpt_dir: str) -> dict:
    """Save sharded at one stage (ModelCheckpoint), resume at another in the same processes; and Fabric."""
    full = checkpoint_worker(save_strategy, ckpt_dir)
    with lightning_ranks():
        resumed = resume_run(load_strategy, os.path.join(ckpt_dir, "epoch=0.ckpt"))
    fabric = fabric_worker("llama", save_strategy, save=os.path.join(ckpt_dir, "fabric"))
    return {
        "full": full,
        "resumed": resumed,
        "fabric": fabric,
        "layout": sorted(os.listdir(os.path.join(ckpt_dir, "epoch=0.ckpt"))),
    }
