"""``zp.load_checkpoint``: verify everything, read this rank's slices into temporaries, then copy in.

Phases (each one collective, so a failure on any rank raises on every rank):
manifest and file sizes -> sha256 (files split round-robin over the ranks) ->
index.json -> match against the model and optimizer -> read the slices this
rank needs -> copy in.  Nothing in the model or optimizer changes before the
last phase, so every error leaves them untouched.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open

from . import format as fmt
from .format import CheckpointError
from .index import check_index, match_model, match_optimizer
from .regions import ParamView, check_loadable, copy_param_in, load_range, param_views, persistent_buffers
from .rng import restore_rng
from .sync import on_every_rank
from .tree import decode

__all__ = ["load"]


def load(path: str | os.PathLike, engine: Any, inner: torch.optim.Optimizer | None, verify: bool = True) -> Any:
    comm = engine.comm
    path = os.path.abspath(os.fspath(path))
    files = on_every_rank(comm, lambda: _manifest(engine, path))
    if verify:
        mine = _files_to_verify(sorted(files), comm.rank, comm.world_size)
        on_every_rank(comm, lambda: [fmt.check_sha256(path, n, files[n]["sha256"]) for n in mine])
    views = param_views(engine)
    index = on_every_rank(comm, lambda: _index(path, files, views, engine, inner))
    with contextlib.ExitStack() as stack:
        reader = _Reader(path, index["files"], stack)
        staged = on_every_rank(comm, lambda: _stage(reader, index, engine, views, inner))
    _copy_in(staged, inner)
    return staged.extra


def _files_to_verify(names: list[str], rank: int, world: int) -> list[str]:
    """Each file is hashed by one rank: the n-th data file by rank n mod world (at an unchanged world
    size, the file this rank reads next, now in the page cache), the index by rank 0."""
    data = [n for n in names if n != fmt.INDEX]
    return ([fmt.INDEX] if rank == 0 else []) + [n for i, n in enumerate(data) if i % world == rank]


def _manifest(engine, path: str) -> dict[str, dict]:
    check_loadable(engine)
    files = fmt.read_manifest(path)
    fmt.check_sizes(path, files)
    return files


def _index(path: str, files: dict, views: list[ParamView], engine, inner) -> dict:
    index = fmt.read_json(os.path.join(path, fmt.INDEX), "checkpoint index")
    check_index(index, files, path)
    match_model(index, views, persistent_buffers(engine.model), path)
    if inner is not None:
        match_optimizer(index, engine, inner, path)
    return index


# -- reading -------------------------------------------------------------------------
class _Reader:
    """Lazily opened safetensors files of one checkpoint; every header is checked against the index."""

    def __init__(self, directory: str, files: list[str], stack: contextlib.ExitStack) -> None:
        self.directory, self.files, self.stack = directory, files, stack
        self.handles: dict[int, Any] = {}
        self.keys: dict[int, set[str]] = {}

    def handle(self, i: int, key: str | None = None):
        """The open file ``i``; with ``key``, raise unless it holds that tensor."""
        if i not in self.handles:
            full = os.path.join(self.directory, self.files[i])
            try:
                self.handles[i] = self.stack.enter_context(safe_open(full, framework="pt", device="cpu"))
            except Exception as exc:   # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(f"checkpoint file {full} is not a valid safetensors file: {exc}") from exc
            self.keys[i] = set(self.handles[i].keys())
        if key is not None and key not in self.keys[i]:
            raise CheckpointError(f"{self._where(i, key)} is missing")
        return self.handles[i]

    def _where(self, i: int, key: str) -> str:
        return f"tensor {key!r} in checkpoint file {os.path.join(self.directory, self.files[i])}"

    def slice(self, i: int, key: str, length: int, dtype: torch.dtype):
        piece = self.handle(i, key).get_slice(key)
        shape, stored = list(piece.get_shape()), piece.get_dtype()
        if shape != [length] or stored != fmt.safetensors_code(dtype):
            raise CheckpointError(f"{self._where(i, key)} has shape {shape} and dtype {stored}, the index says "
                                  f"[{length}] and {fmt.safetensors_code(dtype)}")
        return piece

    def tensor(self, i: int, key: str) -> torch.Tensor:
        return self.handle(i, key).get_tensor(key)

    def metadata(self, i: int) -> dict[str, str]:
        return self.handle(i).metadata() or {}

    def read_range(self, key: str, shards: list, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[lo, hi)`` of a flattened tensor stored as ``shards`` ``[[file, s_lo, s_hi], ...]``."""
        out = torch.empty(hi - lo, dtype=dtype)
        for i, s_lo, s_hi in shards:
            a, b = max(lo, s_lo), min(hi, s_hi)
            if a < b:
                out[a - lo:b - lo] = self.slice(i, key, s_hi - s_lo, dtype)[a - s_lo:b - s_lo]
        return out


@dataclass(slots=True)
class _Staged:
    params: list[tuple[ParamView, torch.Tensor, int]] = field(default_factory=list)
    buffers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    optimizer: dict | None = None
    extra: Any = None
    rng: dict | None = None


def _stage(reader: _Reader, index: dict, engine, views: list[ParamView], inner) -> _Staged:
    staged = _Staged()
    for view in views:
        entry = index["params"][view.name]
        lo, hi = load_range(view)
        values = reader.read_range(f"p/{view.name}", entry["shards"], lo, hi, fmt.dtype_from_name(entry["dtype"]))
        staged.params.append((view, values, lo))
    for name, buf in persistent_buffers(engine.model):
        value = reader.tensor(0, f"b/{name}")
        staged.buffers.append((buf, value.reshape(buf.shape)))
    rank0 = lambda key: reader.tensor(0, key)   # noqa: E731 - tensors referenced by the index live in rank 0's file
    if inner is not None:
        staged.optimizer = _stage_optimizer(reader, index, engine, views, inner, rank0)
    staged.extra = _decode(index.get("extra"), rank0, "extra")
    staged.extra = {} if staged.extra is None else staged.extra
    rank, world = engine.comm.rank, engine.comm.world_size
    if index["world_size"] == world:
        rng = reader.metadata(rank).get("rng")
        if rng is not None:
            staged.rng = _decode(json.loads(rng), lambda key: reader.tensor(rank, key), "rng state")
    return staged


def _stage_optimizer(reader: _Reader, index: dict, engine, views, inner, rank0) -> dict:
    """The wrapped optimizer's state dict for this rank's masters, in its own parameter order."""
    saved = index["optimizer"]
    by_name = {v.name: v for v in views}
    state, groups, pos = {}, [], 0
    for group, saved_group in zip(inner.param_groups, saved["param_groups"]):
        hyper = _decode(saved_group["hyper"], rank0, "optimizer param_groups")
        groups.append({**hyper, "params": list(range(pos, pos + len(group["params"])))})
        for master in group["params"]:
            name = engine.name_of_master(master)
            entry = _stage_state(reader, index, by_name[name], saved["state"].get(name, {}), rank0)
            if entry:
                state[pos] = entry
            pos += 1
    return {"state": state, "param_groups": groups}


def _stage_state(reader: _Reader, index: dict, view: ParamView, saved: dict, rank0) -> dict:
    entry = {}
    shards = index["params"][view.name]["shards"]
    lo, hi = view.slot.layout.bounds()
    for key, spec in saved.items():
        if "region" in spec:
            dtype = fmt.dtype_from_name(spec["region"])
            region = reader.read_range(f"o/{view.name}/{key}", shards, lo, hi, dtype)
            entry[key] = region.reshape(view.slot.master.shape)
        else:
            entry[key] = _decode(spec["value"], rank0, f"optimizer state {key!r} of {view.name!r}")
    return entry


def _decode(value: Any, tensor, what: str) -> Any:
    try:
        return decode(value, tensor)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint index: malformed {what}: {exc}") from exc


# -- copying in ------------------------------------------------------------------------
@torch.no_grad()
def _copy_in(staged: _Staged, inner) -> None:
    for view, values, lo in staged.params:
        copy_param_in(view, values, lo)
    for buf, value in staged.buffers:
        buf.copy_(value)
    if staged.optimizer is not None:
        inner.load_state_dict(staged.optimizer)
    if staged.rng is not None:
        restore_rng(staged.rng)
