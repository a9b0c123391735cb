"""``zp.save_checkpoint``: every rank writes its own regions, in parallel; rank 0 publishes.

Steps: agree on the optimizer-state schema -> each rank streams its file into
``<path>.tmp-<uuid>`` -> rank 0 writes ``index.json`` and the ``COMPLETE``
manifest -> rename to ``<path>`` (an existing checkpoint is moved aside first
and deleted only once the new one is in place).  See [Note: checkpoint layout]
in ``format.py`` and [Note: checkpoint regions] in ``regions.py``.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import uuid
from typing import Any

import torch

from ..optim.state import optimizer_class
from ..tensors.flat import ShardLayout
from . import format as fmt
from .export_info import describe_model
from .format import CheckpointError
from .regions import ParamView, param_views, persistent_buffers, region_to_save, state_region_to_save
from .rng import capture_rng
from .sync import on_every_rank
from .tree import encode

__all__ = ["save"]


# [Note: one saved copy]
# With hierarchical sharding ([Note: hierarchical groups] in collectives.py) every replica group holds the same
# shards, so only the first shard group (global ranks 0..k-1) writes: the checkpoint is the one a run of world
# size k writes (``world_size`` k in the index, plus ``replicas``), and loads anywhere as one, resharded by
# the usual plan.  The others wait for its outcome over their replica group, so every rank returns once the
# checkpoint is published, or raises.  Only the writers' RNG states are saved, so a load restores RNG states
# only when neither run had replicas (and the world sizes match, as before).  Loading runs on every rank.
def save(
    path: str | os.PathLike, engine: Any, inner: torch.optim.Optimizer | None, extra: Any, guard: Any = None
) -> None:
    """``guard``: the ZeroOptimizer's loss scaler, whose state goes into the index ([Note: scaler state] in ``loss_scale.py``)."""
    replica = engine.comm.replica
    if replica is None:
        _save(path, engine, inner, extra, guard)
        return
    error = None
    if replica.rank == 0:  # the first shard group: [Note: one saved copy]
        try:
            _save(path, engine, inner, extra, guard)
        except Exception as exc:  # noqa: BLE001 - reported to the replicas, then re-raised
            error = exc
    outcome = replica.broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if outcome is not None:
        raise CheckpointError(f"zp.save_checkpoint: the writing shard group failed: {outcome}")


def _save(path: str | os.PathLike, engine: Any, inner: torch.optim.Optimizer | None, extra: Any, guard: Any) -> None:
    comm = engine.comm
    path = os.path.abspath(os.fspath(path))
    token = comm.broadcast_object(uuid.uuid4().hex if comm.rank == 0 else None)
    tmp = f"{path}.tmp-{token}"
    views = param_views(engine)
    try:
        schema = _agree_state_schema(comm, views, inner)
        index, json_tensors = on_every_rank(
            comm, lambda: _build_index(engine, views, inner, schema, extra, guard) if comm.rank == 0 else (None, {})
        )
        record = on_every_rank(comm, lambda: _write_rank_file(tmp, engine, views, inner, schema, json_tensors))
        records = comm.all_gather_object(record)
        on_every_rank(comm, lambda: _publish(tmp, path, token, index, records) if comm.rank == 0 else None)
    except BaseException:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


# -- what each rank holds ------------------------------------------------------
def _local_state_schema(views: list[ParamView], inner) -> dict[str, dict[str, str | None]]:
    """``{param name: {state key: region dtype name, or None for a value}}`` on this rank."""
    out: dict[str, dict[str, str | None]] = {}
    for view in views:
        if view.slot is None or inner is None:
            continue
        state = inner.state.get(view.slot.master, {})
        entry = {}
        for key, value in state.items():
            if not isinstance(key, str):
                raise CheckpointError(f"zp.save_checkpoint: optimizer state key {key!r} of {view.name!r} is not a str")
            is_region = (
                isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == view.slot.master.numel()
            )
            entry[key] = fmt.dtype_name(value.dtype) if is_region else None
        out[view.name] = entry
    return out


def _agree_state_schema(comm, views: list[ParamView], inner) -> dict[str, dict[str, str | None]]:
    """Merge the ranks' schemas: a rank whose region of a parameter is empty has no say about its state
    (it may hold none), and an entry is a region only when it is one everywhere (1 element is ambiguous)."""
    local = on_every_rank(comm, lambda: _local_state_schema(views, inner))
    empty = {v.name for v in views if not ShardLayout(v.numel, comm.world_size, comm.rank).local_numel}
    everyone = comm.all_gather_object((local, empty))
    merged: dict[str, dict[str, str | None]] = {}
    for name in local:
        voters = [schema[name] for schema, empty_here in everyone if name not in empty_here] or [local[name]]
        key_sets = [set(v) for v in voters]
        if any(k != key_sets[0] for k in key_sets):
            raise CheckpointError(
                f"zp.save_checkpoint: optimizer state keys of {name!r} differ across ranks "
                f"({[sorted(k) for k in key_sets]}); was optimizer.step() called on every rank?"
            )
        merged[name] = {k: (dtype if all(v[k] == dtype for v in voters) else None) for k, dtype in voters[0].items()}
    return merged


def _save_layout(view: ParamView, comm) -> ShardLayout:
    return ShardLayout(view.numel, comm.world_size, comm.rank)


def _build_index(engine, views: list[ParamView], inner, schema, extra, guard) -> tuple[dict, dict[str, torch.Tensor]]:
    """Rank 0: the JSON index, and the tensors it refers to (they go into rank 0's file)."""
    world = engine.comm.world_size
    tensors: dict[str, torch.Tensor] = {}
    params = {}
    for view in views:
        layouts = [ShardLayout(view.numel, world, r) for r in range(world)]
        params[view.name] = {
            "shape": list(view.shape),
            "dtype": fmt.dtype_name(view.stored_dtype),
            "trainable": view.slot is not None,
            "shards": [[r, *lay.bounds()] for r, lay in enumerate(layouts) if lay.local_numel],
        }
    buffers = {
        name: {"shape": list(b.shape), "dtype": fmt.dtype_name(b.dtype)} for name, b in persistent_buffers(engine.model)
    }
    index = {
        "format": fmt.FORMAT,
        "version": fmt.VERSION,
        "torch_version": torch.__version__,
        "world_size": world,
        **({"replicas": engine.comm.dp_size // world} if engine.comm.replica is not None else {}),  # one saved copy
        "stage": engine.config.stage,
        "config": engine.config.to_dict(),
        "files": [fmt.shard_file_name(r, world) for r in range(world)],
        "params": params,
        "buffers": buffers,
        "optimizer": None if inner is None else _optimizer_index(engine, views, inner, schema, tensors, guard),
        "extra": encode(extra, tensors, "x", "extra"),
        "export": describe_model(engine.model),
    }
    json.dumps(index)  # an unstorable value fails now, before any file is written
    return index, tensors


def _optimizer_index(engine, views, inner, schema, tensors, guard) -> dict:
    by_name = {v.name: v for v in views}
    groups = []
    for gi, group in enumerate(inner.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append(
            {
                "hyper": encode(hyper, tensors, "x", f"optimizer param_groups[{gi}]"),
                "param_names": [engine.name_of_master(p) for p in group["params"]],
            }
        )
    state = {}
    for name, keys in schema.items():
        values = inner.state.get(by_name[name].slot.master, {})
        state[name] = {
            k: {"region": dtype}
            if dtype is not None
            else {"value": encode(values[k], tensors, "x", f"optimizer state[{name!r}][{k!r}]")}
            for k, dtype in keys.items()
        }
    out = {"class": optimizer_class(inner), "param_groups": groups, "state": state}
    if guard is not None:
        out["grad_guard"] = guard.state_dict()  # JSON scalars
    return out


def _write_rank_file(tmp: str, engine, views, inner, schema, json_tensors) -> fmt.FileRecord:
    comm = engine.comm
    os.makedirs(tmp, exist_ok=True)
    entries: list[tuple[str, torch.Tensor]] = []
    for view in views:
        layout = _save_layout(view, comm)
        if not layout.local_numel:
            continue
        entries.append((f"p/{view.name}", region_to_save(view, layout)))
        state = inner.state.get(view.slot.master, {}) if view.slot is not None and inner is not None else {}
        for key, dtype in schema.get(view.name, {}).items():
            if dtype is not None:  # (the layout's region is not empty here, so this rank holds the state)
                entries.append((f"o/{view.name}/{key}", state_region_to_save(view, state[key], layout)))
    if comm.rank == 0:
        entries += [(f"b/{name}", b) for name, b in persistent_buffers(engine.model)]
        entries += list(json_tensors.items())
    rng_tensors: dict[str, torch.Tensor] = {}
    rng = encode(capture_rng(), rng_tensors, "r", "rng state")
    entries += list(rng_tensors.items())
    name = fmt.shard_file_name(comm.rank, comm.world_size)
    return fmt.write_safetensors(os.path.join(tmp, name), entries, {"rng": json.dumps(rng)})


# -- publishing (rank 0) ------------------------------------------------------------
def _publish(tmp: str, path: str, token: str, index: dict, records: list[fmt.FileRecord]) -> None:
    records = list(records) + [fmt.write_json(os.path.join(tmp, fmt.INDEX), index)]
    fmt.write_manifest(tmp, records)
    fmt.fsync_dir(tmp)
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{token}"
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except OSError:
        if old is not None:
            os.rename(old, path)  # put the previous checkpoint back
        raise
    fmt.fsync_dir(os.path.dirname(path))
    if old is not None:
        _remove(old)
    for stale in glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".old-*"):
        _remove(stale)  # leftovers of interrupted saves to this path; superseded now


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except OSError:
            pass
