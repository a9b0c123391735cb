"""``zp.load_checkpoint``: check everything, then read this rank's slices straight into the model.

Phases (each one collective, so a failure on any rank raises on every rank):
manifest and file sizes -> sha256 (files split round-robin over the ranks) ->
index.json -> match against the model and optimizer -> plan: every stored piece
this rank needs is located and its header checked (key, shape, dtype), small
values are read -> read in.

[Note: loading in place]
Nothing in the model or optimizer changes before the last phase, so every
error the checks can find -- a truncated, corrupted (sha256), incomplete or
mismatched checkpoint -- leaves them untouched.  The last phase then reads each
stored piece straight into its destination: the parameter (or stage-3 shard),
the fp32 master, and the optimizer's existing state tensors where they have the
right shape and dtype (new ones otherwise).  So a load needs no second copy of
the model state: a 1B-parameter stage-3 rank (6 GB of parameters and AdamW
state) would otherwise need 12 GB while loading.  What the checks cannot see is
an I/O error part-way through that last phase (a disk failing under the read):
it raises, and the model may then be partly loaded; load again.  With
``verify=False`` changed data bytes are not detected at all (headers still are).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open

from . import dcp_source, deepspeed_reader
from . import format as fmt
from .dcp_reader import DcpLayout, find_layout
from .format import CheckpointError
from .index import match_model, match_optimizer
from .regions import (
    ParamView,
    check_loadable,
    copy_param_in,
    load_range,
    param_views,
    persistent_buffers,
    tied_aliases,
)
from .rng import restore_rng
from .sync import on_every_rank
from .tree import decode
from .verify import check_hashes, read_index, read_sized_manifest

__all__ = ["Reader", "load"]


def load(
    path: str | os.PathLike, engine: Any, inner: torch.optim.Optimizer | None, verify: bool = True, guard: Any = None
) -> Any:
    """``guard``: the ZeroOptimizer's loss scaler; it takes the index's record if there is one (checkpoints
    written before it was saved have none: the scaler is left as it is) ([Note: scaler state] in ``loss_scale.py``)."""
    world = engine.comm.world  # every rank loads (replicas too) and fails together: [Note: one saved copy]
    path = os.path.abspath(os.fspath(path))
    if (dcp := on_every_rank(world, lambda: find_layout(path))) is not None:  # FSDP / torch DCP
        return _load_dcp(dcp, engine, inner, guard)
    tag_dir = on_every_rank(world, lambda: deepspeed_reader.find_tag_dir(path))
    if tag_dir is not None:
        return _load_deepspeed(tag_dir, engine, inner, guard)
    files = on_every_rank(world, lambda: _manifest(engine, path))
    if verify:
        mine = _files_to_verify(sorted(files), world.rank, world.world_size)
        on_every_rank(world, lambda: check_hashes(path, files, mine))
    views = param_views(engine)
    index = on_every_rank(world, lambda: _index(path, files, views, engine, inner))
    with contextlib.ExitStack() as stack:
        reader = Reader(path, index["files"], stack)
        plan = on_every_rank(world, lambda: _plan(reader, index, engine, views, inner))
        on_every_rank(world, lambda: _read_in(plan, reader, inner, guard))
    return plan.extra


def _load_deepspeed(tag_dir: str, engine: Any, inner, guard) -> Any:
    """A DeepSpeed ZeRO checkpoint ([Note: DeepSpeed checkpoint layout] in ``deepspeed_reader.py``): it has no
    manifest or hashes to check; its files are read as weights only, then matched, planned and read in as ours."""
    world = engine.comm.world
    source = on_every_rank(world, lambda: _open_deepspeed(tag_dir, engine, inner))
    views = deepspeed_reader.stored_views(source, param_views(engine))
    on_every_rank(world, lambda: _match(source.index, views, engine, inner, tag_dir))
    plan = on_every_rank(world, lambda: _plan(source, source.index, engine, views, inner))
    on_every_rank(world, lambda: _read_in(plan, source, inner, guard))
    return plan.extra


def _load_dcp(layout: DcpLayout, engine: Any, inner, guard: Any) -> dict:
    """A DCP checkpoint ([Note: DCP as a zero_plugin index] in ``dcp_source.py``): opened as an index, then
    matched, planned and read in as ours."""
    world = engine.comm.world

    def open_and_match():
        engine.forget_forward()  # as _manifest does
        check_loadable(engine)
        buffers = persistent_buffers(engine.model)
        source = dcp_source.open_checkpoint(
            layout, {n for n, _ in buffers}, optimizer=inner is not None, tied=tied_aliases(engine.model)
        )
        match_model(source.index, param_views(engine), buffers, source.directory)
        if inner is not None:
            match_optimizer(source.index, engine, inner, source.directory)
            dcp_source.fit_optimizer(source, inner)
        return source

    source = on_every_rank(world, open_and_match)
    views = param_views(engine)
    plan = on_every_rank(world, lambda: _plan(source, source.index, engine, views, inner))
    on_every_rank(world, lambda: _read_in(plan, source, inner, guard))
    return plan.extra


def _open_deepspeed(tag_dir: str, engine, inner):
    engine.forget_forward()  # as _manifest does
    check_loadable(engine)
    source = deepspeed_reader.open_checkpoint(tag_dir)
    if inner is not None:
        deepspeed_reader.fit_optimizer(source, inner)
    return source


def _files_to_verify(names: list[str], rank: int, world: int) -> list[str]:
    """Each file is hashed by one rank: the n-th data file by rank n mod world (at an unchanged world
    size, the file this rank reads next, now in the page cache), the index by rank 0."""
    data = [n for n in names if n != fmt.INDEX]
    return ([fmt.INDEX] if rank == 0 else []) + [n for i, n in enumerate(data) if i % world == rank]


def _manifest(engine, path: str) -> dict[str, dict]:
    # stage 3: units kept gathered by a forward whose backward did not come are released, as a forward under
    # no_grad leaves them; no value changes ([Note: pending forward] in stage3/hooks.py)
    engine.forget_forward()
    check_loadable(engine)
    return read_sized_manifest(path)


def _index(path: str, files: dict, views: list[ParamView], engine, inner) -> dict:
    index = read_index(path, files)
    _match(index, views, engine, inner, path)
    return index


def _match(index: dict, views: list[ParamView], engine, inner, path: str) -> None:
    match_model(index, views, persistent_buffers(engine.model), path)
    if inner is not None:
        match_optimizer(index, engine, inner, path)


# -- reading -------------------------------------------------------------------------
class Reader:
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
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(f"checkpoint file {full} is not a valid safetensors file: {exc}") from exc
            self.keys[i] = set(self.handles[i].keys())
        if key is not None and key not in self.keys[i]:
            raise CheckpointError(f"{self.where(i, key)} is missing")
        return self.handles[i]

    def where(self, i: int, key: str) -> str:
        return f"tensor {key!r} in checkpoint file {os.path.join(self.directory, self.files[i])}"

    def slice(self, i: int, key: str, length: int, dtype: torch.dtype):
        piece = self.handle(i, key).get_slice(key)
        shape, stored = list(piece.get_shape()), piece.get_dtype()
        if shape != [length] or stored != fmt.safetensors_code(dtype):
            raise CheckpointError(
                f"{self.where(i, key)} has shape {shape} and dtype {stored}, the index says "
                f"[{length}] and {fmt.safetensors_code(dtype)}"
            )
        return piece

    def tensor(self, i: int, key: str) -> torch.Tensor:
        return self.handle(i, key).get_tensor(key)

    def metadata(self, i: int) -> dict[str, str]:
        return self.handle(i).metadata() or {}


@dataclass(slots=True)
class _Region:
    """Where the elements ``[lo, hi)`` of one stored flat tensor come from: ``pieces`` are
    ``(file, key, s_lo, a, b)`` -- elements ``[a, b)`` are ``[a - s_lo, b - s_lo)`` of that stored piece."""

    lo: int
    hi: int
    pieces: list[tuple[int, str, int, int, int]]


@dataclass(slots=True)
class _Plan:
    """Everything a load reads, checked against the files' headers before anything is changed.
    Large tensors are only described (``_Region``); small values (buffers, scalars, ``extra``,
    RNG states) are read here."""

    params: list[tuple[ParamView, _Region]] = field(default_factory=list)
    buffers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    optimizer: dict | None = None
    grad_guard: dict | None = None
    extra: Any = None
    rng: dict | None = None


def _plan(reader: Reader, index: dict, engine, views: list[ParamView], inner) -> _Plan:
    plan = _Plan()
    for view in views:
        entry = index["params"][view.name]
        lo, hi = load_range(view)
        plan.params.append(
            (view, _region(reader, f"p/{view.name}", entry["shards"], lo, hi, fmt.dtype_from_name(entry["dtype"])))
        )
    for name, buf in persistent_buffers(engine.model):
        value = reader.tensor(0, f"b/{name}")
        if value.numel() != buf.numel():
            raise CheckpointError(
                f"{reader.where(0, f'b/{name}')} has {value.numel()} elements, the model's buffer "
                f"{name!r} has {buf.numel()}"
            )
        plan.buffers.append((buf, value.reshape(buf.shape)))
    rank0 = lambda key: reader.tensor(0, key)  # noqa: E731 - tensors referenced by the index live in rank 0's file
    if inner is not None:
        plan.optimizer = _plan_optimizer(reader, index, engine, views, inner, rank0)
        plan.grad_guard = index["optimizer"].get("grad_guard")
    plan.extra = _decode(index.get("extra"), rank0, "extra")
    plan.extra = {} if plan.extra is None else plan.extra
    rank, world = engine.comm.rank, engine.comm.world_size
    replicas = engine.comm.dp_size // world  # only one replica's RNG was saved: [Note: one saved copy]
    if index["world_size"] == world and index.get("replicas", 1) == replicas == 1:
        rng = reader.metadata(rank).get("rng")
        if rng is not None:
            plan.rng = _decode(json.loads(rng), lambda key: reader.tensor(rank, key), "rng state")
    return plan


def _region(reader: Reader, key: str, shards: list, lo: int, hi: int, dtype: torch.dtype) -> _Region:
    """Check every stored piece overlapping ``[lo, hi)`` (present, right shape and dtype) and describe the reads."""
    pieces, covered = [], 0
    for i, s_lo, s_hi in shards:
        a, b = max(lo, s_lo), min(hi, s_hi)
        if a < b:
            reader.slice(i, key, s_hi - s_lo, dtype)
            pieces.append((i, key, s_lo, a, b))
            covered += b - a
    if covered != hi - lo:
        raise CheckpointError(
            f"checkpoint index: the shards of {key!r} cover {covered} of the elements [{lo}, {hi}) this rank needs"
        )
    return _Region(lo, hi, pieces)


def _plan_optimizer(reader: Reader, index: dict, engine, views, inner, rank0) -> dict:
    """The wrapped optimizer's state dict for this rank's masters, in its own parameter order; large
    state tensors are ``(region, dtype, shape)`` placeholders until :func:`_read_in`."""
    saved = index["optimizer"]
    by_name = {v.name: v for v in views}
    state, groups, pos = {}, [], 0
    for group, saved_group in zip(inner.param_groups, saved["param_groups"]):
        hyper = _decode(saved_group["hyper"], rank0, "optimizer param_groups")
        groups.append({**hyper, "params": list(range(pos, pos + len(group["params"])))})
        for master in group["params"]:
            name = engine.name_of_master(master)
            entry = _plan_state(reader, index, by_name[name], saved["state"].get(name, {}), rank0)
            if entry:
                state[pos] = entry
            pos += 1
    return {"state": state, "param_groups": groups}


def _plan_state(reader: Reader, index: dict, view: ParamView, saved: dict, rank0) -> dict:
    entry = {}
    shards = index["params"][view.name]["shards"]
    lo, hi = view.slot.layout.bounds()
    for key, spec in saved.items():
        if "region" in spec:
            dtype = fmt.dtype_from_name(spec["region"])
            entry[key] = _StateRegion(
                _region(reader, f"o/{view.name}/{key}", shards, lo, hi, dtype), dtype, tuple(view.slot.master.shape)
            )
        else:
            entry[key] = _decode(spec["value"], rank0, f"optimizer state {key!r} of {view.name!r}")
    return entry


@dataclass(slots=True)
class _StateRegion:
    region: _Region
    dtype: torch.dtype
    shape: tuple


def _decode(value: Any, tensor, what: str) -> Any:
    try:
        return decode(value, tensor)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint index: malformed {what}: {exc}") from exc


# -- reading in -----------------------------------------------------------------------
@torch.no_grad()
def _read_in(plan: _Plan, reader: Reader, inner, guard) -> None:
    """Read every planned region straight into the model and optimizer, one stored piece at a time
    ([Note: loading in place])."""
    for view, region in plan.params:
        for piece, a, _b in _pieces(reader, region):
            copy_param_in(view, piece, a - region.lo, a)
    for buf, value in plan.buffers:
        buf.copy_(value)
    if plan.optimizer is not None:
        live = _live_state(inner)
        for pos, entry in plan.optimizer["state"].items():
            for key, value in list(entry.items()):
                if isinstance(value, _StateRegion):
                    entry[key] = _fill(reader, value, live.get((pos, key)))
        inner.load_state_dict(plan.optimizer)
        if plan.grad_guard is not None and guard is not None:
            guard.load_state_dict(plan.grad_guard)  # checked with the index (check_index)
    if plan.rng is not None:
        restore_rng(plan.rng)


def _pieces(reader: Reader, region: _Region):
    for i, key, s_lo, a, b in region.pieces:
        yield reader.handle(i).get_slice(key)[a - s_lo : b - s_lo], a, b


def _live_state(inner) -> dict:
    """``{(position, key): tensor}`` of the optimizer's current state, to be overwritten in place."""
    live, pos = {}, 0
    for group in inner.param_groups:
        for p in group["params"]:
            for key, value in inner.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    live[(pos, key)] = value
            pos += 1
    return live


def _fill(reader: Reader, spec: _StateRegion, current: torch.Tensor | None) -> torch.Tensor:
    """The state tensor ``spec`` describes: read into ``current`` when it can hold it, else into a new tensor."""
    fits = (
        current is not None
        and current.dtype == spec.dtype
        and tuple(current.shape) == spec.shape
        and current.is_contiguous()
    )
    out = current if fits else torch.empty(spec.shape, dtype=spec.dtype, device=_state_device(current))
    flat = out.view(-1)
    for piece, a, b in _pieces(reader, spec.region):
        flat[a - spec.region.lo : b - spec.region.lo].copy_(piece)
    return out


def _state_device(current: torch.Tensor | None) -> torch.device:
    return current.device if current is not None else torch.device("cpu")
