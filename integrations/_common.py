"""Helpers shared by the integrations (Accelerate, HF Trainer, Lightning).

Two jobs: find what ``zp.setup`` made (the engine behind a model, the ``ZeroOptimizer``
behind a framework's optimizer wrapper), and save/load one model + optimizer pair.

[Note: checkpoint formats]
``save_sharded`` uses ``zp.save_checkpoint`` (sharded, reshards on load) when the engine
provides it.  Until then it writes a *full* checkpoint into the folder: rank 0 saves
``model.safetensors`` (``zp.full_state_dict``) and ``optimizer.pt`` (the consolidated,
unsharded optimizer state), marked by ``zero_plugin_full.json``.  ``load_sharded`` reads
either format (the marker decides), so folders written before the switch still load.
Every rank reads the full files itself: the folder must be on a filesystem all ranks see.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

import zero_plugin as zp
from zero_plugin.engine import engine_of
from zero_plugin.optim.zero_optimizer import ZeroOptimizer

__all__ = [
    "zero_optimizer_of",
    "is_set_up",
    "owned_grads",
    "release",
    "save_sharded",
    "load_sharded",
]

FULL_MARKER = "zero_plugin_full.json"
FULL_MODEL = "model.safetensors"
FULL_OPTIMIZER = "optimizer.pt"


# -- finding what zp.setup made ----------------------------------------------------
def zero_optimizer_of(optimizer: Any) -> ZeroOptimizer | None:
    """The ``ZeroOptimizer`` inside framework wrappers (``AcceleratedOptimizer``, Lightning's), or None."""
    for _ in range(8):   # wrappers nest a few levels at most
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
def save_sharded(path: str | os.PathLike, model: nn.Module, optimizer: Any, *, include_model: bool = True,
                 extra: dict | None = None) -> None:
    """Collective: save ``model`` and its optimizer under folder ``path`` (see [Note: checkpoint formats]).

    ``include_model=False`` skips the weights in the full format when the caller saves them itself
    (a sharded ``zp.save_checkpoint`` always holds both).
    """
    zero_opt = _require_zero_optimizer(optimizer, "save_sharded")
    if hasattr(zp, "save_checkpoint"):
        zp.save_checkpoint(os.fspath(path), model, zero_opt, extra=extra)
        return
    _save_full(os.fspath(path), model, zero_opt, include_model, extra)


def load_sharded(path: str | os.PathLike, model: nn.Module, optimizer: Any) -> dict | None:
    """Collective: load what :func:`save_sharded` wrote into a set-up model and optimizer; returns ``extra``."""
    zero_opt = _require_zero_optimizer(optimizer, "load_sharded")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"zero_plugin: no checkpoint folder at {path!r}")
    if os.path.isfile(os.path.join(path, FULL_MARKER)) or not hasattr(zp, "load_checkpoint"):
        return _load_full(path, model, zero_opt)
    return zp.load_checkpoint(path, model, zero_opt)


def _require_zero_optimizer(optimizer: Any, verb: str) -> ZeroOptimizer:
    zero_opt = zero_optimizer_of(optimizer)
    if zero_opt is None:
        raise ValueError(f"zero_plugin {verb}: {type(optimizer).__name__} does not wrap a ZeroOptimizer; pass the "
                         "optimizer returned by zp.setup (or by the integration's prepare/setup)")
    return zero_opt


def _save_full(path: str, model: nn.Module, zero_opt: ZeroOptimizer, include_model: bool,
               extra: dict | None) -> None:
    from safetensors.torch import save_file

    state = zp.full_state_dict(model) if include_model else None      # collective
    optim_state = zero_opt.consolidate_state_dict()                      # collective
    comm = zero_opt.engine.comm
    if comm.rank == 0:
        os.makedirs(path, exist_ok=True)
        if state is not None:
            save_file(_unshared(state), os.path.join(path, FULL_MODEL), metadata={"format": "pt"})
        torch.save(optim_state, os.path.join(path, FULL_OPTIMIZER))
        marker = {"format": "zero_plugin-full", "stage": zero_opt.engine.config.stage,
                  "world_size": comm.world_size, "has_model": state is not None, "extra": extra}
        with open(os.path.join(path, FULL_MARKER), "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=1, default=str)
    comm.barrier()   # the files exist for every rank once this returns


def _load_full(path: str, model: nn.Module, zero_opt: ZeroOptimizer) -> dict | None:
    from safetensors.torch import load_file

    marker_path = os.path.join(path, FULL_MARKER)
    marker = {}
    if os.path.isfile(marker_path):
        with open(marker_path, encoding="utf-8") as f:
            marker = json.load(f)
    model_file = os.path.join(path, FULL_MODEL)
    if os.path.isfile(model_file):
        zp.load_full_state_dict(model, load_file(model_file, device="cpu"), src_rank=None)
    optim_file = os.path.join(path, FULL_OPTIMIZER)
    if not os.path.isfile(optim_file):
        raise FileNotFoundError(f"zero_plugin: {path!r} holds no {FULL_OPTIMIZER}; was it written by save_sharded?")
    zero_opt.load_state_dict(torch.load(optim_file, map_location="cpu", weights_only=True))
    return marker.get("extra")


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share storage (tied weights): give each key its own copy."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone().contiguous() if ptr in seen else tensor.contiguous()
        seen.add(ptr)
    return out
