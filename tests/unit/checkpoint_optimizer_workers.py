"""Rank-side functions of ``tests/unit/test_checkpoint.py`` about optimizer-side state across a checkpoint:
the fp16 loss scaler, and state of another optimizer class.  Builders and observers are shared with
``checkpoint_workers.py``."""

from __future__ import annotations

import json
import os

import torch

import zero_plugin as zp
from tests import models
from tests.unit.checkpoint_workers import (
    LR,
    _copy,
    _rank0_file_op,
    _rank_world,
    _replace_and_reseal,
    batches,
    build,
    full_optimizer_state,
    full_params,
    train,
)
from zero_plugin.checkpoint import load_checkpoint, save_checkpoint
from zero_plugin.ckpt import format as ckpt_format

# -- fp16 loss scaler across a resume ------------------------------------------------------------------
# Step 1's loss is blown up so that its fp16 gradients overflow at any scale: skipped, scale 2^16 -> 2^15.
# Step 4's is multiplied by 3 so that its gradients overflow at scale 2^16 but not at 2^15 (measured at every
# stage: overflow at 2^16 from a factor of about 2.1, at 2^15 from about 4.2): a run that forgot the
# backed-off scale skips step 4, the uninterrupted one steps it.
FP16_STEPS, FP16_SAVE_AT = 6, 3


def _fp16_build(stage: int, seed: int = 0):
    return build(stage, torch.float32, seed=seed, param_dtype="fp16")


def _fp16_train(model, opt, data: list, first: int, last: int) -> list[tuple[float, int]]:
    """Train; returns ``(loss scale, skipped steps)`` after every step."""
    rank, world = _rank_world()
    trace = []
    for step in range(first, last):
        loss = models.loss_fn(model, models.shard_batch(data[step], rank, world))
        if step == 1:
            loss = loss * 1e4
        elif step == 4:
            loss = loss * 3.0
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        trace.append((opt.loss_scale, opt.skipped_steps))
    return trace


def _scaler(opt) -> tuple[float, int]:
    return opt.loss_scale, opt.skipped_steps


def fp16_resume_first_half(stage: int, path: str) -> dict:
    """Six fp16 steps straight; then (fresh objects) three steps, a checkpoint, and the optimizer's
    sharded and consolidated state dicts loaded into fresh optimizers."""
    data = batches(torch.float32, FP16_STEPS)
    model, opt = _fp16_build(stage)
    out = {
        "straight_trace": _fp16_train(model, opt, data, 0, FP16_STEPS),
        "straight_params": full_params(model),
        "straight_opt": full_optimizer_state(model, opt),
    }
    model, opt = _fp16_build(stage)
    out["split_trace"] = _fp16_train(model, opt, data, 0, FP16_SAVE_AT)
    save_checkpoint(path, model, opt)
    out["saved_scaler"] = _scaler(opt)
    loaded = {}
    for kind, sd in (("sharded", opt.state_dict()), ("consolidated", opt.consolidate_state_dict(to_rank=None))):
        _, fresh = _fp16_build(stage, seed=7)
        fresh.load_state_dict(sd)
        loaded[kind] = _scaler(fresh)
    out["state_dict_scalers"] = loaded
    return out


def fp16_resume_second_half(stage: int, path: str, strip_scaler: bool = False) -> dict:
    """Fresh setup (other seed), load_checkpoint, three more steps.  ``strip_scaler``: first remove the
    scaler record from a copy's index.json, as a checkpoint written before it existed."""
    if strip_scaler:
        old = path + "-old"
        _rank0_file_op(lambda: (_copy(path, old), _strip_index_key(old, "grad_guard")))
        path = old
    data = batches(torch.float32, FP16_STEPS)
    model, opt = _fp16_build(stage, seed=7)
    load_checkpoint(path, model, opt)
    out = {"loaded_scaler": _scaler(opt)}
    out["trace"] = _fp16_train(model, opt, data, FP16_SAVE_AT, FP16_STEPS)
    out.update(params=full_params(model), opt=full_optimizer_state(model, opt))
    return out


def _strip_index_key(directory: str, key: str) -> None:
    index = ckpt_format.read_json(os.path.join(directory, ckpt_format.INDEX), "index")
    index["optimizer"].pop(key, None)
    _replace_and_reseal(directory, ckpt_format.INDEX, json.dumps(index).encode())


# -- an optimizer of another class ------------------------------------------------------------------------
def _sgd_build(stage: int):
    model = models.make_odd_mlp(seed=5)
    groups = models.two_group_adamw(model).param_groups  # same two groups, as SGD with momentum
    opt = torch.optim.SGD([{"params": g["params"], "lr": g["lr"]} for g in groups], lr=LR, momentum=0.9)
    return zp.setup(model, opt, zp.ZeroConfig(stage=stage))


def wrong_optimizer_class(stage: int, path: str) -> dict:
    """An AdamW run saved (checkpoint, sharded and consolidated state dicts) and loaded into an SGD run that
    has trained a step (so it has momentum to lose): each load raises; nothing of the SGD run changes."""
    data = batches(torch.float64, 2)
    model, opt = build(stage)
    train(model, opt, data, 0, 1)
    save_checkpoint(path, model, opt)
    dicts = {"sharded": opt.state_dict(), "consolidated": opt.consolidate_state_dict(to_rank=None)}
    sgd_model, sgd_opt = _sgd_build(stage)
    train(sgd_model, sgd_opt, data, 0, 1)
    before = _snapshot(sgd_model, sgd_opt)
    errors = {}
    for kind, load in (
        ("checkpoint", lambda: load_checkpoint(path, sgd_model, sgd_opt)),
        ("sharded", lambda: sgd_opt.load_state_dict(dicts["sharded"])),
        ("consolidated", lambda: sgd_opt.load_state_dict(dicts["consolidated"])),
    ):
        try:
            load()
            errors[kind] = None
        except ValueError as exc:
            errors[kind] = f"{type(exc).__name__}: {exc}"
    after = _snapshot(sgd_model, sgd_opt)
    train(sgd_model, sgd_opt, data, 1, 2)  # still trains as SGD
    return {"errors": errors, "before": before, "after": after}


def _snapshot(model, opt) -> dict:
    return {
        "params": full_params(model),
        "opt": full_optimizer_state(model, opt),
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
    }
