"""``zero-plugin consolidate CKPT OUT --format dcp``: one of our checkpoints as a torch.distributed.checkpoint
folder that FSDP2 resumes from.

[Note: DCP export]
``OUT`` holds what ``dcp.save({"model": msd, "optim": osd})`` writes for ``msd, osd =
get_state_dict(model, optimizer)`` under FSDP2: the model's parameters and persistent buffers under
``model.<name>``, the optimizer state keyed by parameter name (``optim.state.<name>.exp_avg``, ``step``) and
its param groups (``optim.param_groups.<i>.lr`` ..., ``params``: the names).  Each tensor is one whole chunk;
DCP's load planner reads each rank's shard out of it at any world size, so FSDP2 resumes with::

    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=OUT)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

Written by DCP's own ``FileSystemWriter`` (``dcp.save(no_dist=True)``, in this one process).  Not streaming:
the whole model and optimizer state is in memory once (about 12 bytes per fp32 parameter with AdamW).
A ``config.json`` is added when the checkpoint recorded a transformers config.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch

from .consolidate import assemble, full_tensor, write_new_folder
from .format import CheckpointError, dtype_from_name
from .load import Reader
from .tree import decode
from .verify import read_checked_index

__all__ = ["export_dcp"]


def export_dcp(checkpoint: str | os.PathLike, out: str | os.PathLike, *, verify: bool = True) -> list[str]:
    checkpoint = os.path.abspath(os.fspath(checkpoint))
    index = read_checked_index(checkpoint, verify=verify)
    with contextlib.ExitStack() as stack:
        reader = Reader(checkpoint, index["files"], stack)
        state = {"model": _model_state(reader, index)}
        if index["optimizer"] is not None:
            state["optim"] = _optimizer_state(reader, index)
    config = (index.get("export") or {}).get("hf_config")
    return write_new_folder(os.fspath(out), lambda tmp: _save(state, config, tmp))


def _model_state(reader: Reader, index: dict) -> dict[str, torch.Tensor]:
    state = {name: full_tensor(reader, index, f"p/{name}") for name in index["params"]}
    state.update({name: full_tensor(reader, index, f"b/{name}") for name in index["buffers"]})
    return state


def _optimizer_state(reader: Reader, index: dict) -> dict:
    """``get_optimizer_state_dict``'s form: state and param groups keyed by parameter name."""
    saved = index["optimizer"]
    small = lambda key: reader.tensor(0, key)  # noqa: E731 - values the index refers to live in rank 0's file
    state = {}
    for name, entry in saved["state"].items():
        param = index["params"][name]
        state[name] = {
            key: assemble(reader, f"o/{name}/{key}", param["shards"], dtype_from_name(spec["region"]), param["shape"])
            if "region" in spec
            else decode(spec["value"], small)
            for key, spec in entry.items()
        }
    groups = [{**decode(g["hyper"], small), "params": list(g["param_names"])} for g in saved["param_groups"]]
    return {"state": state, "param_groups": groups}


def _save(state: dict, config: dict | None, tmp: str) -> list[str]:
    import torch.distributed.checkpoint as dcp

    try:
        dcp.save(state, checkpoint_id=tmp, no_dist=True)
    except Exception as exc:  # noqa: BLE001 - DCP raises its own wrapper types
        raise CheckpointError(f"consolidate --format dcp: torch.distributed.checkpoint could not save: {exc}") from exc
    if config is not None:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    return sorted(os.listdir(tmp))
