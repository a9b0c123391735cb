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

Written by DCP's own ``FileSystemWriter`` (``dcp.save(no_dist=True)``, in this one process), streaming as
[Note: streaming consolidation] does: the state dict handed to DCP holds meta-device placeholders of the right
shapes and dtypes (its plan and ``.metadata`` need no more), and :class:`_StreamingPlanner` assembles a tensor only
when the writer asks for its bytes.  The writer keeps every tensor of one output file until that file is closed,
so each tensor gets a file of its own (``single_file_per_rank=False``): about one tensor is in memory at a time,
not the model and its optimizer state (12 bytes per fp32 parameter with AdamW).  A ``config.json`` is added when
the checkpoint recorded a transformers config.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from .assemble import assemble, full_tensor, write_new_folder
from .format import CheckpointError, dtype_from_name
from .load import Reader
from .tree import decode
from .verify import read_checked_index

__all__ = ["export_dcp"]


def export_dcp(checkpoint: str | os.PathLike, out: str | os.PathLike, *, verify: bool = True) -> list[str]:
    checkpoint = os.path.abspath(os.fspath(checkpoint))
    index = read_checked_index(checkpoint, verify=verify)
    config = (index.get("export") or {}).get("hf_config")
    with contextlib.ExitStack() as stack:
        reader = Reader(checkpoint, index["files"], stack)
        lazy: dict[int, Callable[[], torch.Tensor]] = {}
        state = {"model": _model_state(reader, index, lazy)}
        if index["optimizer"] is not None:
            state["optim"] = _optimizer_state(reader, index, lazy)
        return write_new_folder(os.fspath(out), lambda tmp: _save(state, lazy, config, tmp))


def _placeholder(lazy: dict, shape, dtype: torch.dtype, fetch: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A meta tensor standing for ``fetch()`` until DCP's writer asks for it ([Note: DCP export])."""
    meta = torch.empty(tuple(shape), dtype=dtype, device="meta")
    lazy[id(meta)] = fetch
    return meta


def _model_state(reader: Reader, index: dict, lazy: dict) -> dict[str, torch.Tensor]:
    state = {}
    for kind, entries in (("p", index["params"]), ("b", index["buffers"])):
        for name, entry in entries.items():
            fetch = functools.partial(full_tensor, reader, index, f"{kind}/{name}")
            state[name] = _placeholder(lazy, entry["shape"], dtype_from_name(entry["dtype"]), fetch)
    return state


def _optimizer_state(reader: Reader, index: dict, lazy: dict) -> dict:
    """``get_optimizer_state_dict``'s form: state and param groups keyed by parameter name."""
    saved = index["optimizer"]
    small = lambda key: reader.tensor(0, key)  # noqa: E731 - values the index refers to live in rank 0's file
    state = {}
    for name, entry in saved["state"].items():
        param = index["params"][name]
        state[name] = {}
        for key, spec in entry.items():
            if "region" in spec:
                dtype = dtype_from_name(spec["region"])
                fetch = functools.partial(assemble, reader, f"o/{name}/{key}", param["shards"], dtype, param["shape"])
                state[name][key] = _placeholder(lazy, param["shape"], dtype, fetch)
            else:
                state[name][key] = decode(spec["value"], small)
    groups = [{**decode(g["hyper"], small), "params": list(g["param_names"])} for g in saved["param_groups"]]
    return {"state": state, "param_groups": groups}


class _StreamingPlanner(DefaultSavePlanner):
    """DCP's default save planner, except that a placeholder is assembled only when its bytes are written."""

    def __init__(self, lazy: dict[int, Callable[[], torch.Tensor]]) -> None:
        super().__init__()
        self.lazy = lazy

    def resolve_data(self, write_item: WriteItem) -> Any:
        fetch = self.lazy.get(id(self.lookup_object(write_item.index)))
        return fetch() if fetch is not None else super().resolve_data(write_item)


def _save(state: dict, lazy: dict, config: dict | None, tmp: str) -> list[str]:
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(tmp, single_file_per_rank=False)  # one file per tensor: [Note: DCP export]
    try:
        dcp.save(state, storage_writer=writer, planner=_StreamingPlanner(lazy), no_dist=True)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - DCP raises its own wrapper types
        raise CheckpointError(f"consolidate --format dcp: torch.distributed.checkpoint could not save: {exc}") from exc
    if config is not None:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    return sorted(os.listdir(tmp))
