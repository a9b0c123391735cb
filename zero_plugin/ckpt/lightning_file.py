"""``zero-plugin consolidate CKPT_DIR OUT.ckpt --format lightning``: a sharded Lightning checkpoint as one file.

The ZeRO strategies for the Lightning Trainer and Fabric save a checkpoint as a directory
([Note: sharded checkpoint directory] in ``zero_plugin/integrations/lightning/common.py``)::

    <dir>/zero/     zp.save_checkpoint: every rank's regions of the model and optimizer
    <dir>/meta.pt   everything else Lightning saved (loops, callbacks, schedulers, hyper_parameters, ...),
                    torch.save format, plus the ``zero_plugin`` record (:data:`RECORD`)

``LightningModule.load_from_checkpoint`` and every other strategy read one ``torch.load`` file, and raise
``IsADirectoryError`` on the directory before any zero_plugin code runs.  This writes that file, offline
and in one process:

* Trainer checkpoints: ``meta.pt``'s entries plus ``state_dict`` (the full model state dict) and, when the
  optimizer was saved, ``optimizer_states`` (one full torch-format optimizer state dict) -- what
  ``ZeroStrategy(checkpoint="full")`` writes, so ``load_from_checkpoint`` and ``Trainer(strategy="ddp")
  .fit(ckpt_path=...)`` (optimizer state included) accept it;
* Fabric checkpoints: ``meta.pt``'s entries plus the module's and optimizer's full state under the keys
  they were saved under, which ``fabric.load`` accepts with any strategy.

[Note: Lightning file memory]
Unlike the safetensors export ([Note: streaming consolidation]), the result is one pickle, so the full
model and optimizer state are in host memory together while it is written (about 3x the fp32 weights
with Adam).  ``meta.pt`` is unpickled: by default with ``torch.load(weights_only=True)``, as Lightning
loads a checkpoint by default; ``weights_only=False`` (CLI ``--no-weights-only``) is for trusted
checkpoints whose hyper-parameters or callback states hold other objects.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import uuid
from typing import Any

import torch

from . import format as fmt
from .assemble import assemble, full_tensor
from .format import CheckpointError
from .load import Reader
from .tree import decode
from .verify import read_checked_index

__all__ = ["META_FILE", "SHARDS_DIR", "RECORD", "is_lightning_checkpoint", "consolidate_lightning"]

META_FILE = "meta.pt"
SHARDS_DIR = "zero"
# The key of meta.pt's zero_plugin record: {"aliases": {tied name: saved name}}; Fabric adds {"module": key,
# "optimizer": key or None}, the state keys that held the module and the optimizer.
RECORD = "zero_plugin"


def is_lightning_checkpoint(path: str | os.PathLike) -> bool:
    """A complete sharded Lightning/Fabric checkpoint directory (``meta.pt`` is written last)."""
    return os.path.isfile(os.path.join(path, META_FILE)) and os.path.isdir(os.path.join(path, SHARDS_DIR))


def consolidate_lightning(
    checkpoint: str | os.PathLike, out: str | os.PathLike, *, verify: bool = True, weights_only: bool = True
) -> list[str]:
    """Write the sharded Lightning checkpoint directory ``checkpoint`` as the single file ``out``."""
    checkpoint, out = os.path.abspath(os.fspath(checkpoint)), os.path.abspath(os.fspath(out))
    if not is_lightning_checkpoint(checkpoint):
        raise CheckpointError(
            f"consolidate --format lightning: {checkpoint} is not a sharded Lightning checkpoint "
            f"(a directory with {META_FILE} and {SHARDS_DIR}/, as ZeroStrategy and "
            "ZeroFabricStrategy save); for a zp.save_checkpoint folder use --format "
            "safetensors or hf"
        )
    if os.path.exists(out):
        raise CheckpointError(f"consolidate: {out} already exists; choose a new file name")
    shards = os.path.join(checkpoint, SHARDS_DIR)
    index = read_checked_index(shards, verify=verify)
    meta = _read_meta(os.path.join(checkpoint, META_FILE), weights_only)
    record = meta.pop(RECORD, None) or {}
    with contextlib.ExitStack() as stack:
        reader = Reader(shards, index["files"], stack)
        state = _full_model_state(reader, index, record.get("aliases") or {})
        optimizer = None if index["optimizer"] is None else _full_optimizer_state(reader, index)
    result = _place(meta, record, state, optimizer)  # all of it in memory at once: [Note: Lightning file memory]
    tmp = f"{out}.tmp-{uuid.uuid4().hex}"
    try:
        torch.save(result, tmp)
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return [out]


def _read_meta(path: str, weights_only: bool) -> dict:
    try:
        meta = torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        if not weights_only:
            raise CheckpointError(f"consolidate: cannot unpickle {path}: {exc}") from exc
        raise CheckpointError(
            f"consolidate: {path} holds objects that torch.load(weights_only=True) refuses ({exc}). If you trust "
            "this checkpoint, rerun with --no-weights-only (what load_from_checkpoint(weights_only=False) does), "
            "from a folder where the classes it names can be imported"
        ) from exc
    if not isinstance(meta, dict):
        raise CheckpointError(f"consolidate: {path} holds a {type(meta).__name__}, not a Lightning checkpoint dict")
    return meta


def _full_model_state(reader: Reader, index: dict, aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    state = {name: full_tensor(reader, index, f"p/{name}") for name in index["params"]}
    state.update((name, full_tensor(reader, index, f"b/{name}")) for name in index["buffers"])
    for alias, saved in aliases.items():
        if saved not in state:
            raise CheckpointError(f"consolidate: {META_FILE} ties {alias!r} to {saved!r}, which the checkpoint lacks")
        state[alias] = state[saved]  # one tensor under both names, as state_dict() gives it
    return state


def _full_optimizer_state(reader: Reader, index: dict) -> dict[str, Any]:
    """The optimizer state dict an unsharded optimizer would have: ``ZeroOptimizer.consolidate_state_dict``'s
    format (positions in param-group order, ``param_names``, the ``zero_plugin`` record)."""
    saved = index["optimizer"]
    rank0 = lambda key: reader.tensor(0, key)  # noqa: E731 - tensors the index refers to live in rank 0's file
    state: dict[int, dict] = {}
    groups = []
    for group in saved["param_groups"]:
        names = list(group["param_names"])
        start = sum(len(g["params"]) for g in groups)
        groups.append(
            {**decode(group["hyper"], rank0), "params": list(range(start, start + len(names))), "param_names": names}
        )
        for pos, name in enumerate(names, start):
            entry = {
                key: _state_value(reader, index, name, key, spec, rank0)
                for key, spec in saved["state"].get(name, {}).items()
            }
            if entry:
                state[pos] = entry
    record = {"sharded": False, "optimizer_class": saved["class"]}
    if "grad_guard" in saved:
        record["grad_guard"] = saved["grad_guard"]
    return {"state": state, "param_groups": groups, "zero_plugin": record}


def _state_value(reader: Reader, index: dict, name: str, key: str, spec: dict, rank0) -> Any:
    if "region" not in spec:
        return decode(spec["value"], rank0)
    entry = index["params"][name]
    return assemble(reader, f"o/{name}/{key}", entry["shards"], fmt.dtype_from_name(spec["region"]), entry["shape"])


def _place(meta: dict, record: dict, state: dict, optimizer: dict | None) -> dict:
    """Put the model and optimizer state where the Trainer (or Fabric) keeps them in a full checkpoint."""
    if "module" not in record:  # the Trainer's layout
        meta["state_dict"] = state
        if optimizer is not None:
            meta["optimizer_states"] = [optimizer]
        return meta
    meta[record["module"]] = state
    if record.get("optimizer") is not None and optimizer is not None:
        meta[record["optimizer"]] = optimizer
    return meta
