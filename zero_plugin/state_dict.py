"""Full (unsharded) model state dicts, for export and interchange with unsharded code."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from .engines.engine import engine_of

__all__ = ["full_state_dict", "load_full_state_dict", "raw_state_dict"]


def full_state_dict(model: nn.Module, *, rank0_only: bool = True, trainable_only: bool = False) -> dict:
    """Collective. Rank 0 (every rank with ``rank0_only=False``) gets full CPU tensors; others ``{}``.

    ``trainable_only=True`` keeps only the parameters the optimizer trains (e.g. LoRA adapters).
    """
    return engine_of(model, "full_state_dict").full_state_dict(rank0_only=rank0_only, trainable_only=trainable_only)


def load_full_state_dict(model: nn.Module, state_dict: dict | None, *, src_rank: int | None = 0, strict: bool = True):
    """Collective. Load a full state dict into a set-up model (any stage).

    With ``src_rank`` set, only that rank needs to pass the dict (others may pass None): it is broadcast.
    """
    engine = engine_of(model, "load_full_state_dict")
    if src_rank is not None:
        world = engine.comm.world  # the whole group, also with shard groups ([Note: hierarchical groups])
        state_dict = world.broadcast_object(state_dict if world.rank == src_rank else None, src=src_rank)
    if not isinstance(state_dict, dict):
        raise ValueError(f"zp.load_full_state_dict: expected a dict of tensors, got {type(state_dict).__name__}")
    bad = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ValueError(f"zp.load_full_state_dict: values must be tensors; {bad[:3]} are not")
    return engine.load_full_state_dict(state_dict, strict=strict)


@contextlib.contextmanager
def raw_state_dict(model: nn.Module) -> Iterator[None]:
    """Inside, ``model.state_dict()`` / ``load_state_dict()`` are torch's own: at stage 3 this rank's 1-D shards
    and the model's own objects, with no collective ([Note: stage-3 state dicts] in stage3/state_dict_hooks.py).
    For zero_plugin's own callers that want shards (sharded checkpoints); a no-op at stages 0-2."""
    try:
        hooks = engine_of(model, "raw_state_dict").state_dict_hooks
    except ValueError:  # not set up: torch's own anyway
        hooks = None
    with hooks.raw() if hooks is not None else contextlib.nullcontext():
        yield
