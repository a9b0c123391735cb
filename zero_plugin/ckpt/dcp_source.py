"""A DCP checkpoint (FSDP / torch.distributed.checkpoint) as one of ours: ``zp.load_checkpoint`` and
``zero-plugin consolidate`` read it through the plan and writers of our own checkpoints.

[Note: DCP as a zero_plugin index]
:class:`DcpSource` describes the checkpoint as ``index.json`` would (``params`` with their shards,
``buffers``, ``optimizer`` param groups and state) and answers as ``load.Reader`` does, so loading is the
same check-then-read-in of [Note: loading in place]: each rank reads only the chunks over its regions.
A shard is one DCP chunk: FSDP2 (and FSDP1's ``SHARDED_STATE_DICT``) cut every tensor along dim 0, so a chunk
is a contiguous range of the flattened tensor; "file" ``i`` of a key is its ``i``-th chunk.  Optimizer state
shaped like its parameter is a region (its chunks must be the parameter's, as FSDP2 writes them); other
state (Adam's ``step``) and the param groups' values are values.  DCP records no optimizer class:
:func:`fit_optimizer` refuses state whose param groups lack this optimizer's hyper-parameters.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from .dcp_reader import Chunk, DcpFolder, DcpLayout
from .format import CheckpointError
from .tree import encode

__all__ = ["DcpSource", "open_checkpoint", "fit_optimizer"]

# The model's and the optimizer's top-level keys: torch's tutorials / torchtitan ("model", "optim"), Accelerate
# ("optimizer"), Lightning's FSDPStrategy ("model", "optimizer_0") and ModelParallelStrategy ("state_dict",
# "optimizer_0"); the first one present is read.
_MODEL_PREFIXES = ("model", "state_dict")
_OPTIM_PREFIXES = ("optim", "optimizer", "optimizer_0")
_FSDP1_FLAT = ("_flat_param", "_fsdp_wrapped_module")


class DcpSource:
    """A DCP checkpoint as a zero_plugin index whose pieces are read from the chunks on demand
    ([Note: DCP as a zero_plugin index])."""

    def __init__(
        self,
        layout: DcpLayout,
        buffer_names: frozenset[str] = frozenset(),
        tied: dict[str, str] | None = None,
        optimizer: bool = False,
    ) -> None:
        """``tied``: the loading model's ``{second name: first name}`` of tied parameters ([Note: tied names
        in DCP]); none when exporting.  ``optimizer``: its optimizer state is required (else read if present)."""
        self.layout, self.directory = layout, layout.root
        self.model = DcpFolder(layout.model_dir)
        self.optim = None
        if layout.optim_dir is not None:
            self.optim = self.model if layout.optim_dir == layout.model_dir else DcpFolder(layout.optim_dir)
        self.pieces: dict[tuple[int, str], tuple[DcpFolder, str, Chunk, torch.dtype]] = {}
        self.small: dict[str, torch.Tensor] = {}
        self.tied = dict(tied or {})
        params, buffers, aliases = self._model_entries(buffer_names)
        index_optimizer = self._optimizer_index(params, optimizer) if self.optim is not None else None
        width = max([len(e["shards"]) for e in params.values()] + [1])
        self.files = [f"chunk {i}" for i in range(width)]
        self.index = {"world_size": width, "files": self.files, "params": params, "buffers": buffers,
                      "optimizer": index_optimizer, "extra": None, "aliases": aliases}  # fmt: skip
        self.export = _hf_export(layout.root)

    # -- the index ------------------------------------------------------------------------------
    def _model_entries(self, buffer_names) -> tuple[dict, dict, dict]:
        names = _entries_under(self.model, _MODEL_PREFIXES)
        if not names:
            tops = sorted({str(path[0]) for path in self.model.paths})
            raise CheckpointError(
                f"DCP checkpoint {self.model.folder} has no model entry (looked for {list(_MODEL_PREFIXES)}; its "
                f"top-level keys: {tops}); zero_plugin reads dcp.save({{'model': ..., 'optim': ...}}) as the torch "
                "tutorials save it, Accelerate's pytorch_model_fsdp_0/ + optimizer_0/, and the sharded checkpoint "
                "folders of Lightning's FSDPStrategy and ModelParallelStrategy"
            )
        _refuse_flat(self.model.folder, names)
        names, aliases = _fold_tied(names, self.tied)
        params, buffers = {}, {}
        for name, key in names.items():
            if key not in self.model.tensors:
                raise CheckpointError(f"{self.model.where(key)} is not a tensor; zero_plugin loads tensors only")
            if name in buffer_names:  # read whole, from "file" 0 on: the plan's buffer reads
                entry = self._tensor_entry(self.model, key, f"b/{name}")
                buffers[name] = {"shape": entry["shape"], "dtype": entry["dtype"]}
            else:
                params[name] = self._tensor_entry(self.model, key, f"p/{name}")
        return params, buffers, aliases

    def _tensor_entry(self, folder: DcpFolder, key: str, ours: str) -> dict:
        md = folder.tensors[key]
        shape, dtype = tuple(md.size), md.properties.dtype
        shards = []
        for chunk in sorted(folder.chunks(key), key=lambda c: c.offsets):
            lo, hi = _flat_range(folder, key, shape, chunk)
            if lo < hi:
                self.pieces[(len(shards), ours)] = (folder, key, chunk, dtype)
                shards.append([len(shards), lo, hi])
        ends = [0] + [hi for _, _, hi in shards]
        if any(lo != end for (_, lo, _), end in zip(shards, ends)) or ends[-1] != math.prod(shape):
            raise CheckpointError(f"{folder.where(key)}: its chunks do not tile its {math.prod(shape)} elements")
        return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "shards": shards}

    def _optimizer_index(self, params: dict, required: bool) -> dict | None:
        paths = self.optim.paths
        prefix = next((p for p in _OPTIM_PREFIXES if any(path[:2] == (p, "state") for path in paths)), None)
        if prefix is None and not required:
            return None
        if prefix is None:
            raise CheckpointError(
                f"DCP checkpoint {self.optim.folder} has no optimizer state (no "
                f"{' or '.join(repr(p + '.state') for p in _OPTIM_PREFIXES)} keys); load the model alone "
                "(optimizer=None) and start the optimizer fresh"
            )
        state: dict[str, dict] = {}
        groups: dict[int, dict] = {}
        for path, key in paths.items():
            if len(path) == 4 and path[:2] == (prefix, "state"):
                name = self._first_name(path[2], params)
                state.setdefault(name, {})[path[3]] = self._state_entry(params, name, path[3], key)
            elif len(path) == 4 and path[:2] == (prefix, "param_groups"):
                groups.setdefault(int(path[2]), {})[path[3]] = self.optim.read_value(key)
        out_groups = []
        for g in sorted(groups):
            hyper = {k: v for k, v in groups[g].items() if k != "params"}
            names = groups[g].get("params")
            if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
                raise CheckpointError(f"DCP checkpoint {self.optim.folder}: param group {g} names no parameters")
            names = [self._first_name(n, params) for n in names]
            out_groups.append({"hyper": self.encode(hyper, f"optimizer param group {g}"), "param_names": names})
        return {"class": None, "param_groups": out_groups, "state": state}

    def _first_name(self, name: str, params: dict) -> str:
        """A tied parameter's optimizer state may be keyed by its second name ([Note: tied names in DCP])."""
        return self.tied[name] if name not in params and self.tied.get(name) in params else name

    def _state_entry(self, params: dict, name: str, state_key: str, key: str) -> dict:
        if key not in self.optim.tensors:
            return {"value": self.encode(self.optim.read_value(key), f"optimizer state {state_key!r} of {name!r}")}
        md = self.optim.tensors[key]
        if name in params and list(md.size) == params[name]["shape"] and md.size.numel() > 1:
            entry = self._tensor_entry(self.optim, key, f"o/{name}/{state_key}")
            if entry["shards"] != params[name]["shards"]:
                raise CheckpointError(
                    f"{self.optim.where(key)} is chunked unlike its parameter {name!r}; zero_plugin reads optimizer "
                    "state chunked as FSDP2 saves it (as its parameter)"
                )
            return {"region": entry["dtype"]}
        small = f"s/{name}/{state_key}"
        self._tensor_entry(self.optim, key, small)
        return {"value": {"__tensor__": small}}

    def encode(self, value: Any, where: str) -> Any:
        tensors: dict[str, torch.Tensor] = {}
        encoded = encode(value, tensors, f"x{len(self.small)}", where)
        self.small.update(tensors)
        return encoded

    # -- answering as load.Reader does ----------------------------------------------------------
    def where(self, i: int, key: str) -> str:
        found = self.pieces.get((i, key))
        return f"{key!r} chunk {i} of {self.directory}" if found is None else found[0].where(found[1])

    def slice(self, i: int, key: str, length: int, dtype: torch.dtype) -> torch.Tensor:
        found = self.pieces.get((i, key))
        if found is None or math.prod(found[2].sizes) != length or found[3] != dtype:
            raise CheckpointError(f"{self.where(i, key)}: expected {length} elements of {dtype}")
        folder, dcp_key, chunk, stored = found
        return folder.read_chunk(dcp_key, chunk, stored).reshape(-1)

    def handle(self, i: int, key: str | None = None) -> _Handle:
        if key is not None and (i, key) not in self.pieces and key not in self.small:
            raise CheckpointError(f"{self.where(i, key)} is missing")
        return _Handle(self, i)

    def tensor(self, i: int, key: str) -> torch.Tensor:
        """A whole tensor: a buffer, a small state value, or a tensor hyper-parameter."""
        if key in self.small:
            return self.small[key].clone()
        shards = [k for k in self.pieces if k[1] == key]
        if not shards:
            raise CheckpointError(f"{self.where(i, key)} is missing")
        folder, dcp_key, _, dtype = self.pieces[shards[0]]
        shape = tuple(folder.tensors[dcp_key].size)
        flat = torch.empty(math.prod(shape), dtype=dtype)
        for j, _ in sorted(shards):
            piece = self.slice(j, key, math.prod(self.pieces[(j, key)][2].sizes), dtype)
            lo = _flat_range(folder, dcp_key, shape, self.pieces[(j, key)][2])[0]
            flat[lo : lo + piece.numel()] = piece
        return flat.view(shape)

    def metadata(self, i: int) -> dict[str, str]:
        return {}  # DCP saves no RNG state


class _Handle:
    def __init__(self, source: DcpSource, i: int) -> None:
        self.source, self.i = source, i

    def get_slice(self, key: str) -> torch.Tensor:
        _, _, chunk, dtype = self.source.pieces[(self.i, key)]
        return self.source.slice(self.i, key, math.prod(chunk.sizes), dtype)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.source.tensor(self.i, key)


def _flat_range(folder: DcpFolder, key: str, shape: tuple, chunk: Chunk) -> tuple[int, int]:
    """The elements a chunk holds of the flattened tensor: contiguous when it spans every dim but the first."""
    if not shape:
        return 0, 1
    if chunk.sizes[1:] != shape[1:] or any(chunk.offsets[1:]):
        raise CheckpointError(
            f"{folder.where(key)} is cut along a dimension other than 0 (chunk {chunk.sizes} at {chunk.offsets} "
            f"of {shape}: tensor parallelism?); zero_plugin reads data-parallel (FSDP) checkpoints, cut along dim 0"
        )
    rest = math.prod(shape[1:])
    return chunk.offsets[0] * rest, (chunk.offsets[0] + chunk.sizes[0]) * rest


def _entries_under(folder: DcpFolder, prefixes: tuple[str, ...]) -> dict[str, Any]:
    """``{name: DCP key}`` of the entries ``(prefix, name)`` under the first of ``prefixes`` the folder has."""
    for prefix in prefixes:
        names = {path[1]: key for path, key in folder.paths.items() if len(path) == 2 and path[0] == prefix}
        if names:
            return names
    return {}


def _fold_tied(names: dict[str, Any], tied: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """[Note: tied names in DCP]
    A module's ``state_dict()`` -- and so FSDP2's ``get_model_state_dict`` -- holds a tied parameter under every
    name (an embedding tied to the LM head is saved twice), while the model here has one parameter under its first
    name (``named_parameters()``).  Saved twice: the first name is loaded, the second kept as an alias (what an
    export writes).  Saved once, under the second name only (a writer that dropped duplicates the other way): it
    is read as the first name.  Without a model (an export) every saved name is written as it is."""
    names, aliases = dict(names), {}
    for second, first in tied.items():
        if second in names:
            if first in names:
                aliases[second] = first
                del names[second]
            else:
                names[first] = names.pop(second)
    return names, aliases


def _refuse_flat(folder: str, names: dict) -> None:
    flat = sorted(n for n in names if any(part in n for part in _FSDP1_FLAT))
    if flat:
        raise CheckpointError(
            f"DCP checkpoint {folder} holds FSDP1 flat parameters ({flat[:3]}): FSDP1's flattened / LOCAL_STATE_DICT "
            "layout, which zero_plugin does not read. Save it again from FSDP1 with "
            "StateDictType.SHARDED_STATE_DICT (per-parameter keys) or FULL_STATE_DICT, or from FSDP2"
        )


def _hf_export(root: str) -> dict:
    path = os.path.join(root, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    return {"hf_config": config} if isinstance(config, dict) else {}


def open_checkpoint(
    layout: DcpLayout, buffer_names=frozenset(), *, optimizer: bool = False, tied: dict[str, str] | None = None
) -> DcpSource:
    """The checkpoint at ``layout`` as an index; ``optimizer``: its optimizer state is required."""
    if optimizer and layout.optim_dir is None:
        raise CheckpointError(
            f"zp.load_checkpoint: {layout.model_dir} is Accelerate's FSDP model folder and holds no optimizer "
            f"state; its optimizer state is the DCP folder optimizer_0 beside it (missing in {layout.root}). "
            "Load the model alone (optimizer=None), or pass the folder that holds both"
        )
    return DcpSource(layout, frozenset(buffer_names), tied, optimizer)


def fit_optimizer(source: DcpSource, inner: torch.optim.Optimizer) -> None:
    """DCP records no optimizer class: its param groups must hold this optimizer's hyper-parameters."""
    for g, entry in enumerate(source.index["optimizer"]["param_groups"]):
        missing = sorted(set(inner.defaults) - set(entry["hyper"]))
        if missing:
            raise CheckpointError(
                f"zp.load_checkpoint: the optimizer state of DCP checkpoint {source.directory} was saved from "
                f"another optimizer class: its param group {g} lacks {missing}, which this "
                f"{type(inner).__name__} needs. Load it into the optimizer it was saved from, or load the model "
                "alone (optimizer=None) and start this optimizer fresh"
            )
