"""Helpers shared by the integrations (Accelerate, HF Trainer, Lightning).

Two jobs: find what ``zp.setup`` made (the engine behind a model, the ``ZeroOptimizer``
behind a framework's optimizer wrapper), and save/load one model + optimizer pair with
``zp.save_checkpoint`` / ``zp.load_checkpoint`` (sharded; any stage and world size on load).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import zero_plugin as zp
from zero_plugin.engines.engine import engine_of
from zero_plugin.optim.zero_optimizer import ZeroOptimizer

__all__ = [
    "zero_optimizer_of",
    "is_set_up",
    "owned_grads",
    "release",
    "save_sharded",
    "load_sharded",
]


# -- finding what zp.setup made ----------------------------------------------------
def zero_optimizer_of(optimizer: Any) -> ZeroOptimizer | None:
    """The ``ZeroOptimizer`` inside framework wrappers (``AcceleratedOptimizer``, Lightning's), or None."""
    for _ in range(8):  # wrappers nest a few levels at most
        if isinstance(optimizer, ZeroOptimizer) or optimizer is None:
            break
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer if isinstance(optimizer, ZeroOptimizer) else None


def is_set_up(model: Any) -> bool:
    """True when ``model`` (or a module inside it, e.g. under a PEFT or compile wrapper) went through zp.setup."""
    if not isinstance(model, nn.Module):
        return False
    try:
        engine_of(model, "is_set_up")
    except ValueError:
        return False
    return True


def owned_grads(model: nn.Module) -> list[torch.Tensor]:
    """This rank's reduced gradients, the tensors the optimizer will step with (edit in place)."""
    return engine_of(model, "owned_grads").owned_grads()


def release(model: nn.Module) -> None:
    """Remove the hooks zp.setup attached and forget the engine (the model is being discarded)."""
    engine_of(model, "release").remove()


# -- checkpoints -----------------------------------------------------------------------
def save_sharded(path: str | os.PathLike, model: nn.Module, optimizer: Any, *, extra: dict | None = None) -> None:
    """Collective: ``zp.save_checkpoint`` of ``model`` and the ``ZeroOptimizer`` inside ``optimizer`` to folder
    ``path``."""
    zp.save_checkpoint(os.fspath(path), model, _require_zero_optimizer(optimizer, "save_sharded"), extra=extra)


def load_sharded(path: str | os.PathLike, model: nn.Module, optimizer: Any) -> dict | None:
    """Collective: load what :func:`save_sharded` wrote into a set-up model and optimizer; returns ``extra``."""
    zero_opt = _require_zero_optimizer(optimizer, "load_sharded")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"zero_plugin: no checkpoint folder at {path!r}")
    return zp.load_checkpoint(path, model, zero_opt)


def _require_zero_optimizer(optimizer: Any, verb: str) -> ZeroOptimizer:
    zero_opt = zero_optimizer_of(optimizer)
    if zero_opt is None:
        raise ValueError(
            f"zero_plugin {verb}: {type(optimizer).__name__} does not wrap a ZeroOptimizer; pass the "
            "optimizer returned by zp.setup (or by the integration's prepare/setup)"
        )
    return zero_opt
