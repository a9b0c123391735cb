"""Functions that run inside the ranks of ``tests/parity/test_parity_stage3.py``.

Module-level so the worker pool pickles them by reference; arguments and
results are plain Python or CPU tensors.  ``build_model`` and
``build_optimizer`` also build the single-process reference in the parent, so
both sides start from the same weights and the same param groups.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

import zero_plugin as zp
from tests import models

LR = 1e-2
# kind -> (base model, activation checkpointing: None, "reentrant" or "non_reentrant")
KINDS = {
    "mlp": ("mlp", None),
    "llama": ("llama", None),
    "lora": ("lora", None),
    "llama_ckpt_reentrant": ("llama", "reentrant"),
    "llama_ckpt": ("llama", "non_reentrant"),
    "lora_ckpt_reentrant": ("lora", "reentrant"),
}


def base_kind(kind: str) -> str:
    """Checkpointing recomputes the same ops, so a checkpointed kind shares its base's reference."""
    return KINDS[kind][0]


def batch_kind(kind: str) -> str:
    return "mlp" if base_kind(kind) == "mlp" else "llama"


def build_model(kind: str):
    """Seeded, so every call gives the same weights."""
    base, ckpt = KINDS[kind]
    if base == "mlp":
        model = models.make_odd_mlp()
    elif base == "llama":
        model = models.make_tiny_llama(layers=2)
    else:
        model = models.make_tiny_llama_lora(layers=2)
    if ckpt is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable is a deprecated alias
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
        if base == "lora":
            # A frozen embedding gives the first checkpointed layer an input without grad; reentrant
            # checkpointing then drops the layer's gradients unless the input is made to require grad.
            model.enable_input_require_grads()
    return model


def build_optimizer(model) -> torch.optim.AdamW:
    """AdamW, two groups: matrices (lr, wd 0.1) and the rest (lr / 2, wd 0); LoRA: lora_A vs lora_B."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    first = [p for n, p in named if p.ndim >= 2 and "lora_B" not in n]
    second = [p for n, p in named if not (p.ndim >= 2 and "lora_B" not in n)]
    assert first and second, "both param groups must be non-empty"
    return torch.optim.AdamW(
        [{"params": first, "lr": LR, "weight_decay": 0.1}, {"params": second, "lr": LR / 2, "weight_decay": 0.0}], lr=LR
    )


def train_loop(model, opt, batches: list, steps: int, accum: int, max_norm: float, loss_fn=None) -> dict:
    """Accumulate ``accum`` micro-batches (all but the last under ``zp.no_sync``), clip, step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, norms = [], []
    for step in range(steps):
        step_loss = 0.0
        for i, micro in enumerate(batches[step * accum : (step + 1) * accum]):
            sync = contextlib.nullcontext() if i == accum - 1 else zp.no_sync(model)
            with sync:
                value = (loss_fn or models.loss_fn)(model, models.shard_batch(micro, rank, world))
                (value / accum).backward()
            step_loss += value.item() / accum
        losses.append(step_loss)
        norms.append(float(zp.clip_grad_norm_(model, max_norm)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "clip_norms": norms}


def parity_worker(
    kind: str,
    batches: list,
    steps: int,
    accum: int,
    max_norm: float,
    prefetch_depth: int = 1,
    reshard_after_forward: bool = True,
    buffered: bool = False,
    persistence_threshold: int = 0,
) -> dict:
    """Train at stage 3; return losses, clip norms, this rank's shards and (rank 0) the full state dict.
    ``buffered``: the rank-major collective layout NCCL uses, forced on gloo (collectives.py)."""
    from tests.unit.memory_comm_workers import collectives_layout

    model = build_model(kind)
    config = zp.ZeroConfig(
        stage=3,
        prefetch_depth=prefetch_depth,
        reshard_after_forward=reshard_after_forward,
        persistence_threshold=persistence_threshold,
    )
    with collectives_layout(buffered):
        model, opt = zp.setup(model, build_optimizer(model), config)
    out = train_loop(model, opt, batches, steps, accum, max_norm)
    out["shards"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    from zero_plugin.engines.engine import engine_of

    out["unsharded_units_after"] = [u.name for u in engine_of(model, "test").unsharded_units()]
    out["root_params"] = sorted(sp.name for sp in engine_of(model, "test").units[0].params)
    out["full_state_dict"] = zp.full_state_dict(model)
    out["checkpointing"] = _checkpointing(model)
    return out


def _checkpointing(model) -> list:
    """``use_reentrant`` of each decoder layer that checkpoints (empty when none does)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    found = []
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
            found.append(module._gradient_checkpointing_func.keywords.get("use_reentrant"))
    return found
