"""Functions that run inside the ranks of ``tests/unit/test_inference.py``: models set up for evaluation only
([Note: evaluation-only models] in zero_plugin/stage3/inference.py).

Module-level so the worker pool pickles them by reference; they return CPU tensors, strings and numbers.
Each rank builds the same seeded model twice: one is set up, the other stays a plain single-process model
(the reference) and sees the same inputs.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import zero_plugin as zp
from tests import models


def _make(kind: str):
    if kind == "mlp":
        return models.make_odd_mlp()
    return models.make_tiny_llama(layers=3, tie=kind == "llama", dtype=torch.float64)


def _inputs(kind: str, rank: int):
    batch = models.make_batches("mlp" if kind == "mlp" else "llama", 1, 2, 2, seed=rank + 5)[0]
    if kind == "mlp":
        return (batch[0],), {}
    return (), {"input_ids": batch["input_ids"]}


def _out(value):
    return value if isinstance(value, torch.Tensor) else value.logits


def _param_hooks(model) -> int:
    """Autograd hooks on the parameters (backward and post-accumulate)."""
    count = 0
    for p in model.parameters():
        count += len(p._backward_hooks or {}) + len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    return count


def forward_matches(kind: str) -> dict:
    """Forward under no_grad, inference_mode and grad mode against the unsharded model; the shards' sizes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _make(kind)
    reference = copy.deepcopy(model)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    full_numels = {n: p.numel() for n, p in model.named_parameters()}
    out_model, out_opt = zp.setup(model, None, zp.ZeroConfig(stage=3))
    assert out_model is model and out_opt is None
    args, kwargs = _inputs(kind, rank)
    with torch.no_grad():
        expected = _out(reference(*args, **kwargs))
        got = _out(model(*args, **kwargs))
    with torch.inference_mode():
        got_inference = _out(model(*args, **kwargs)).clone()
    got_grad_mode = _out(model(*args, **kwargs))  # grad enabled: run without autograd anyway
    report = zp.memory_report(model)
    return {
        "equal_no_grad": torch.equal(got, expected),
        "equal_inference": torch.equal(got_inference, expected),
        "equal_grad_mode": torch.equal(got_grad_mode.detach(), expected),
        "out_requires_grad": got_grad_mode.requires_grad,
        "grad_enabled_after": torch.is_grad_enabled(),
        "param_hooks": _param_hooks(model),
        "grads": sum(p.grad is not None for p in model.parameters()),
        "sharded": all(p.numel() <= -(-full_numels[n] // world) for n, p in model.named_parameters()),
        "requires_grad_kept": all(p.requires_grad for p in model.parameters()),
        "measured": report["measured"],
        "theory": report["theory"],
        "full_bytes": full_bytes,
    }


def input_needing_grad_refused() -> dict:
    """An input that requires grad is refused; grad mode and the gathers stay consistent afterwards."""
    rank = dist.get_rank()
    model = _make("mlp")
    reference = copy.deepcopy(model)
    zp.setup(model, None, zp.ZeroConfig(stage=3))
    (x,), _ = _inputs("mlp", rank)
    message = ""
    try:
        model(x.clone().requires_grad_(True))
    except ValueError as e:
        message = str(e)
    grad_after = torch.is_grad_enabled()
    with torch.no_grad():
        equal = torch.equal(model(x), reference(x))
    return {"message": message, "grad_after": grad_after, "equal_after": equal}


def replicated_stages(stage: int) -> dict:
    """Stages 0-2: the model stays whole, with rank 0's values; nothing is attached."""
    rank = dist.get_rank()
    model = models.make_odd_mlp(seed=rank)  # different values per rank
    rank0 = models.make_odd_mlp(seed=0)
    out_model, out_opt = zp.setup(model, None, zp.ZeroConfig(stage=stage))
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), rank0.parameters()))
    try:
        zp.memory_report(model)
        attached = True
    except ValueError:
        attached = False
    return {"same_object": out_model is model, "optimizer": out_opt, "rank0_values": same, "attached": attached}


def _train_stage3(kind: str, steps: int, evaluate_first: bool) -> tuple[list[float], dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _make(kind)
    opt = models.two_group_adamw(model, lr=1e-2)  # groups by ndim: built while the parameters are whole
    if evaluate_first:
        zp.setup(model, None, zp.ZeroConfig(stage=3))
        args, kwargs = _inputs(kind, rank)
        with torch.no_grad():
            model(*args, **kwargs)
    model, opt = zp.setup(model, opt, zp.ZeroConfig(stage=3))
    kind_batches = "mlp" if kind == "mlp" else "llama"
    losses = []
    for batch in models.make_batches(kind_batches, steps, world, 2):
        loss = models.loss_fn(model, models.shard_batch(batch, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, zp.full_state_dict(model)


def evaluation_then_training(kind: str, steps: int) -> dict:
    """Set up for evaluation, run a forward, then set up again with an optimizer and train; and the same model
    trained at stage 3 without the evaluation set-up."""
    losses, state = _train_stage3(kind, steps, evaluate_first=True)
    plain_losses, plain_state = _train_stage3(kind, steps, evaluate_first=False)
    return {"losses": losses, "state": state, "plain_losses": plain_losses, "plain_state": plain_state}


def _hook_count(model) -> int:
    """Module hooks of every kind on every submodule, and autograd hooks on the parameters."""
    count = _param_hooks(model)
    for m in model.modules():
        for d in (
            m._forward_pre_hooks,
            m._forward_hooks,
            m._backward_hooks,
            m._backward_pre_hooks,
            m._state_dict_hooks,
            m._state_dict_pre_hooks,
            m._load_state_dict_pre_hooks,
            m._load_state_dict_post_hooks,
        ):
            count += len(d)
    return count


def release_removes_every_hook(stage: int, train: bool) -> dict:
    """``zp.integrations.common.release`` (the engine's ``remove``) leaves no hook of zp.setup behind,
    the input-casting hook of ``param_dtype`` included."""
    from zero_plugin.integrations import common

    model = models.make_odd_mlp(dtype=torch.float32)
    before = _hook_count(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if train else None
    zp.setup(model, opt, zp.ZeroConfig(stage=stage, param_dtype="bf16"))
    during = _hook_count(model)
    common.release(model)
    return {"before": before, "during": during, "after": _hook_count(model)}
