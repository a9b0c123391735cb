"""Sharded checkpoints that reshard across world sizes and stages.

    zp.save_checkpoint("ckpt/step-100", model, optimizer, extra={"step": 100, "sched": sched.state_dict()})
    extra = zp.load_checkpoint("ckpt/step-100", model, optimizer)   # any stage 0-3, any world size

Both are collective.  Every rank writes only its own region of each flattened
parameter and of its optimizer state (safetensors), rank 0 adds buffers, scalars,
``extra`` and a JSON index, and the directory appears at ``path`` atomically once
a ``COMPLETE`` manifest (sizes and sha256 of every file) is written.  Loading
verifies the manifest, checks the index against the model and optimizer and
every stored piece's header before it changes anything, so what those checks
find leaves the model and optimizer untouched; it then reads only the slices
this rank needs straight into the parameters, masters and optimizer state
([Note: loading in place] in ``ckpt/load.py``: no second copy of the model
state, and an I/O error part-way through that last phase leaves a partial
load).  Nothing is unpickled.  The layout is described in [Note: checkpoint
layout] (``ckpt/format.py``) and [Note: checkpoint regions] (``ckpt/regions.py``).

All ranks must see the same ``path`` (a shared or node-local filesystem when
every rank runs on one node).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn

from .ckpt.format import CheckpointError
from .ckpt.load import load as _load
from .ckpt.save import save as _save
from .engines.engine import engine_of
from .tensors.phases import phase

__all__ = ["save_checkpoint", "load_checkpoint", "save_peft_adapter", "CheckpointError"]


def save_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, extra: Any = None
) -> None:
    """Collective.  Save ``model`` (and ``optimizer``) sharded to the directory ``path``.

    ``extra`` (taken from rank 0) may hold JSON values, tuples, tensors and numpy arrays:
    step, scheduler state, data position.  Every rank's torch/CUDA/Python/numpy RNG
    state is saved as well.  An existing checkpoint at ``path`` is replaced only once
    the new one is complete.
    """
    engine = engine_of(model, "save_checkpoint")
    inner = _inner(engine, optimizer, "save_checkpoint")
    # one format for both partitions: [Note: the element view of parameter-partition state] in whole_params.py
    with phase("checkpoint_save"), _element_view(optimizer):
        _save(path, engine, inner, extra, guard=_guard(optimizer))


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, verify: bool = True
) -> Any:
    """Collective.  Load a checkpoint saved at any stage and world size; returns its ``extra`` ({} if none).

    RNG states are restored when the world size matches the saving run's.  ``verify=False``
    skips the sha256 check of the files (their sizes are still checked).
    """
    engine = engine_of(model, "load_checkpoint")
    inner = _inner(engine, optimizer, "load_checkpoint")
    with phase("checkpoint_load"), _element_view(optimizer):  # loaded in the element form, assembled on exit
        return _load(path, engine, inner, verify=verify, guard=_guard(optimizer))


def save_peft_adapter(model: nn.Module, directory: str | os.PathLike, **save_pretrained_kwargs: Any) -> None:
    """Collective.  Gather the trainable (adapter) weights and ``save_pretrained`` them on rank 0.

    ``model`` is the set-up ``PeftModel``; the folder loads with ``PeftModel.from_pretrained``
    into an unsharded base model.
    """
    engine = engine_of(model, "save_peft_adapter")
    state = engine.full_state_dict(rank0_only=True, trainable_only=True)
    error = None
    if engine.comm.world.rank == 0:
        if not hasattr(model, "save_pretrained") or not hasattr(model, "peft_config"):
            error = f"zp.checkpoint.save_peft_adapter: expected a peft PeftModel, got {type(model).__name__}"
        elif not state:
            error = "zp.checkpoint.save_peft_adapter: the model has no trainable parameters to save"
        else:
            try:
                model.save_pretrained(os.fspath(directory), state_dict=state, **save_pretrained_kwargs)
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = f"zp.checkpoint.save_peft_adapter: save_pretrained failed: {type(exc).__name__}: {exc}"
    error = engine.comm.world.broadcast_object(error, src=0)
    if error is not None:
        raise ValueError(error)


def _inner(engine, optimizer: torch.optim.Optimizer | None, verb: str) -> torch.optim.Optimizer | None:
    if optimizer is None:
        return None
    if isinstance(optimizer, (list, tuple)):
        raise ValueError(
            f"zp.{verb}: pass one ZeroOptimizer; with several over one model (Muon + AdamW), use one checkpoint per "
            f"optimizer: zp.{verb}(f'{{path}}/opt{{i}}', model, optimizers[i]) (the model is saved with each)"
        )
    if getattr(optimizer, "engine", None) is not engine or not hasattr(optimizer, "inner"):
        raise ValueError(f"zp.{verb}: pass the ZeroOptimizer that zp.setup returned together with this model")
    return optimizer.inner


def _element_view(optimizer) -> contextlib.AbstractContextManager:
    """The ZeroOptimizer's state in the element partition's form ([Note: optimizer partitions] in
    optim/partition.py); a no-op without an optimizer or in the element partition."""
    return contextlib.nullcontext() if optimizer is None else optimizer.element_view()


def _guard(optimizer) -> Any:
    """The loss scaler saved and loaded with the optimizer ([Note: scaler state] in optim/loss_scale.py)."""
    return None if optimizer is None else optimizer.guard
