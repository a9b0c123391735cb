"""Model, optimizers and rank functions of ``tests/parity/test_shape_aware_optimizers.py``.

Every optimizer here reads a parameter's shape or a whole-tensor statistic (or, AdamW, none: the control), so
stepping flat 1/N regions gives different weights; the parameter partition ([Note: optimizer partitions] in
``zero_plugin/optim/partition.py``) must match single-process float64 training.  The model is ``OddMLP``
(float64, shapes like (15, 7) that pad for 2 and 3 ranks; ``scale`` has fewer elements than ranks), or its
matrices only (the vectors frozen) for Muon, which orthogonalises 2-D updates only.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import zero_plugin as zp
from tests import models

OPTIMIZERS = ("torch_adafactor", "hf_adafactor", "hf_adafactor_relative", "muon", "lamb", "adamw")


class Lamb(torch.optim.Optimizer):
    """A LAMB-style optimizer (You et al. 2019): Adam's direction scaled per tensor by the trust ratio
    ``‖θ‖ / ‖update‖``, a whole-tensor statistic.  Written here so the test does not depend on a package."""

    def __init__(self, params, lr: float = 1e-2, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m = state["exp_avg"] / (1 - b1 ** state["step"])
                v = state["exp_avg_sq"] / (1 - b2 ** state["step"])
                update = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), update.norm()
                trust = (w_norm / u_norm) if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(update, alpha=-group["lr"] * float(trust))


def build_model(optimizer: str):
    model = models.make_odd_mlp()
    if optimizer == "muon":  # Muon steps matrices only: the vectors stay frozen
        for p in model.parameters():
            p.requires_grad_(p.ndim == 2)
    return model


def build_optimizer(name: str, model) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "torch_adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    if name == "hf_adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=1e-2, scale_parameter=True, relative_step=False, warmup_init=False)
    if name == "hf_adafactor_relative":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=None, scale_parameter=True, relative_step=True, warmup_init=True)
    if name == "muon":
        return torch.optim.Muon(params, lr=2e-2, adjust_lr_fn="match_rms_adamw")
    if name == "lamb":
        return Lamb(params, lr=1e-2)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


class MuonAdamW(torch.optim.Optimizer):
    """The single-process reference of two optimizers over one model: Muon for the matrices, AdamW for the
    vectors, stepped one after the other (what ``zp.setup(model, [muon, adamw])`` must equal)."""

    def __init__(self, model):
        self.muon, self.adamw = muon_and_adamw(model)
        super().__init__([p for p in model.parameters()], {})

    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()


def muon_and_adamw(model) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim != 2]
    return torch.optim.Muon(matrices, lr=2e-2, adjust_lr_fn="match_rms_adamw"), torch.optim.AdamW(vectors, lr=1e-2)


def reference(name: str, batches: list, steps: int, accum: int, clip: float | None) -> dict:
    return models.reference_train(
        lambda: build_model(name), lambda m: build_optimizer(name, m), batches, steps, accum, clip
    )["params"]


def _train(model, opt, batches: list, steps: int, accum: int, first: int = 0) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(first, first + steps):
        micro = batches[step * accum : (step + 1) * accum]
        for i, batch in enumerate(micro):
            sync = zp.no_sync(model) if i < len(micro) - 1 else _nothing()
            with sync:
                (models.loss_fn(model, models.shard_batch(batch, rank, world)) / accum).backward()
        opt.step()
        opt.zero_grad()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _config(stage: int, offload: bool, clip: float | None, partition: str = "auto") -> zp.ZeroConfig:
    return zp.ZeroConfig(
        stage=stage, offload_optimizer="cpu" if offload else "none", clip_grad_norm=clip, optimizer_partition=partition
    )


def parity_worker(name: str, cases: list[tuple], batches: list, steps: int) -> list[dict]:
    """Each case ``(stage, offload, accum, clip)``: train ``steps`` steps; rank 0 returns the full parameters,
    the partition the optimizer got and the bytes sent to owners (``comm_stats``'s "exchange")."""
    out = []
    for stage, offload, accum, clip in cases:
        model = build_model(name)
        model, opt = zp.setup(model, build_optimizer(name, model), _config(stage, offload, clip))
        zp.reset_comm_stats()
        _train(model, opt, batches, steps, accum)
        sent = zp.comm_stats().get("exchange", {}).get("bytes", 0)
        params = zp.full_state_dict(model)
        out.append({"params": params, "partition": opt.partition, "exchange_bytes": sent})
    return out


def two_optimizers_worker(cases: list[tuple], batches: list, steps: int) -> list[dict]:
    """Muon (matrices) + AdamW (vectors) over one OddMLP through one ``zp.setup``; each optimizer stepped and
    zeroed in turn (``for opt in opts: opt.step(); opt.zero_grad()``, so a zero_grad must not touch the other
    optimizer's gradients)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for stage, offload, accum, clip in cases:
        model = models.make_odd_mlp()
        model, opts = zp.setup(model, list(muon_and_adamw(model)), _config(stage, offload, clip))
        for step in range(steps):
            micro = batches[step * accum : (step + 1) * accum]
            for i, batch in enumerate(micro):
                with zp.no_sync(model) if i < len(micro) - 1 else _nothing():
                    (models.loss_fn(model, models.shard_batch(batch, rank, world)) / accum).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        out.append({"params": zp.full_state_dict(model), "partitions": [o.partition for o in opts]})
    return out


def refused_worker(name: str, stage: int) -> str:
    """``optimizer_partition="elements"`` with a shape-aware optimizer: the message setup raises."""
    model = build_model(name)
    try:
        zp.setup(model, build_optimizer(name, model), _config(stage, False, None, partition="elements"))
    except ValueError as exc:
        return str(exc)
    return ""


def save_worker(name: str, stage: int, partition: str, batches: list, steps: int, accum: int, path: str) -> str:
    """Train ``steps`` steps and save a checkpoint; returns the partition used."""
    model = build_model(name)
    model, opt = zp.setup(model, build_optimizer(name, model), _config(stage, False, None, partition))
    _train(model, opt, batches, steps, accum)
    zp.save_checkpoint(path, model, opt)
    return opt.partition


def resume_worker(
    name: str, stage: int, partition: str, batches: list, first: int, steps: int, accum: int, path: str
) -> dict:
    """Load the checkpoint into a fresh model and optimizer at another stage / world size / partition and
    train on; rank 0 returns the full parameters."""
    model = build_model(name)
    model, opt = zp.setup(model, build_optimizer(name, model), _config(stage, False, None, partition))
    zp.load_checkpoint(path, model, opt)
    _train(model, opt, batches, steps, accum, first=first)
    return {"params": zp.full_state_dict(model), "partition": opt.partition}


def state_dict_worker(name: str, stage: int, batches: list, steps: int) -> dict:
    """``consolidate_state_dict`` after ``steps`` steps, loaded into a fresh set-up optimizer (full form) and
    the shard ``state_dict`` into another: the next step of both equals the first optimizer's."""

    def fresh():
        model = build_model(name)
        return zp.setup(model, build_optimizer(name, model), _config(stage, False, None))

    model, opt = fresh()
    _train(model, opt, batches, steps, 1)
    full = opt.consolidate_state_dict(to_rank=None)
    shard = copy.deepcopy(opt.state_dict())  # torch's state_dict holds the live state tensors
    weights = zp.full_state_dict(model, rank0_only=False)
    results = []
    for form in ("full", "shard", "same"):
        if form == "same":
            m, o = model, opt
        else:
            m, o = fresh()
            zp.load_full_state_dict(m, weights)
            o.load_state_dict(full if form == "full" else shard)
        _train(m, o, batches, 1, 1, first=steps)
        results.append(zp.full_state_dict(m))
    return {"full": results[0], "shard": results[1], "same": results[2], "keys": sorted(full["state"].get(0, {}))}


def accelerate_two_optimizers_worker(stage: int, batches: list, steps: int, path: str) -> dict:
    """``accelerator.prepare(model, muon, adamw, loader-free)`` under zero_plugin's Accelerator: both optimizers
    prepared over one model, stepped in turn; after ``steps - 1`` steps ``save_state``, one more step, then a
    fresh model + optimizers ``load_state`` and take that step again.  Rank 0: the trained weights of both runs."""
    import os

    from accelerate.state import AcceleratorState

    from zero_plugin.integrations.accelerate import Accelerator, ZeroPlugin

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))

    def build():
        AcceleratorState._reset_state(True)
        accelerator = Accelerator(cpu=True, zero_plugin=ZeroPlugin(zp.ZeroConfig(stage=stage)))
        model = models.make_odd_mlp()
        muon, adamw = muon_and_adamw(model)
        return (accelerator, *accelerator.prepare(model, muon, adamw))

    def train(accelerator, model, opts, first, count):
        for step in range(first, first + count):
            loss = models.loss_fn(model, models.shard_batch(batches[step], rank, world))
            accelerator.backward(loss)
            for opt in opts:
                opt.step()
                opt.zero_grad()

    accelerator, model, muon, adamw = build()
    partitions = [zp_opt.partition for zp_opt in (muon.optimizer, adamw.optimizer)]
    train(accelerator, model, (muon, adamw), 0, steps - 1)
    accelerator.save_state(path)
    train(accelerator, model, (muon, adamw), steps - 1, 1)
    first = zp.full_state_dict(model)
    accelerator, model, muon, adamw = build()
    accelerator.load_state(path)
    train(accelerator, model, (muon, adamw), steps - 1, 1)
    return {"params": first, "resumed": zp.full_state_dict(model), "partitions": partitions}


def exchange_bytes_worker(stage: int, batches: list) -> int:
    """One Adafactor step: the bytes this rank sent to owners and back (``comm_stats``'s "exchange")."""
    model = build_model("torch_adafactor")
    model, opt = zp.setup(model, build_optimizer("torch_adafactor", model), _config(stage, False, None))
    zp.reset_comm_stats()
    _train(model, opt, batches, 1, 1)
    return zp.comm_stats().get("exchange", {}).get("bytes", 0)


def mixed_precision_worker(name: str, stages: list[int], batches: list, steps: int) -> list[dict]:
    """bf16 parameters with fp32 masters (separate from the parameters at every stage): the whole masters are
    assembled from the fp32 regions, not from the bf16 parameter.  Rank 0: the fp32 masters (full state dict)."""
    out = []
    for stage in stages:
        model = build_model(name).float()
        config = zp.ZeroConfig(stage=stage, param_dtype=torch.bfloat16)
        model, opt = zp.setup(model, build_optimizer(name, model), config)
        rank, world = dist.get_rank(), dist.get_world_size()
        for step in range(steps):
            x, y = models.shard_batch(batches[step], rank, world)
            torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y.float()).backward()
            opt.step()
            opt.zero_grad()
        out.append({"params": {k: v.float() for k, v in zp.full_state_dict(model).items()}, "partition": opt.partition})
    return out


def idle_owner_worker(stages: list[int], batches: list, steps: int) -> dict:
    """Two trainable matrices (the rest frozen) over 3 ranks: one rank owns no parameter and steps nothing, yet
    takes part in every exchange.  Rank 0: the weights per stage; every rank: how many parameters it owns."""
    out = {}
    for stage in stages:
        model = two_matrices_model()
        model, opt = zp.setup(
            model,
            torch.optim.Adafactor([p for p in model.parameters() if p.requires_grad], lr=1e-2),
            _config(stage, False, None),
        )
        _train(model, opt, batches, steps, 1)
        out[stage] = {
            "params": zp.full_state_dict(model),
            "owned": sum(opt.whole.owns(i) for i in range(len(opt.whole.wholes))),
        }
    return out


def two_matrices_model():
    model = models.make_odd_mlp()
    for name, p in model.named_parameters():
        p.requires_grad_(name in ("blocks.1.fc.weight", "head.weight"))
    return model


def two_optimizers_state_dict_worker(stage: int, batches: list, steps: int, adamw_first: bool) -> dict:
    """Muon + AdamW over one model (``adamw_first``: passed in that order, so Muon's parameters are not the
    engine's first slots): each optimizer's consolidated (full) state dict loaded into a fresh pair, then one more
    step on both pairs; rank 0: the weights of both."""

    def fresh():
        model = models.make_odd_mlp()
        pair = list(muon_and_adamw(model))
        return zp.setup(model, pair[::-1] if adamw_first else pair, _config(stage, False, None))

    def train(model, opts, first, count):
        rank, world = dist.get_rank(), dist.get_world_size()
        for step in range(first, first + count):
            models.loss_fn(model, models.shard_batch(batches[step], rank, world)).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()

    model, opts = fresh()
    train(model, opts, 0, steps)
    full = [opt.consolidate_state_dict(to_rank=None) for opt in opts]
    weights = zp.full_state_dict(model, rank0_only=False)
    other, other_opts = fresh()
    zp.load_full_state_dict(other, weights)
    for opt, sd in zip(other_opts, full):
        opt.load_state_dict(sd)
    train(model, opts, steps, 1)
    train(other, other_opts, steps, 1)
    return {"same": zp.full_state_dict(model), "loaded": zp.full_state_dict(other)}
