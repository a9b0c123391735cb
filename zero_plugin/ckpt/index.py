"""``index.json``: its structure, and whether it fits the model and optimizer being loaded.

The index is untrusted input: every field is type-checked before it is used,
so a tampered or truncated index is a :class:`CheckpointError`, never a crash
half-way through a load.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..optim.loss_scale import scaler_state_problem
from ..optim.state import class_mismatch
from . import format as fmt
from .format import CheckpointError
from .regions import ParamView

__all__ = ["check_index", "match_model", "match_optimizer"]

_LIST_AT_MOST = 8


def _bad(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"malformed checkpoint index {path}/{fmt.INDEX}: {what}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_index(index: Any, manifest: dict, path: str) -> None:
    if not isinstance(index, dict) or index.get("format") != fmt.FORMAT or index.get("version") != fmt.VERSION:
        raise _bad(path, f"not a {fmt.FORMAT} index of version {fmt.VERSION}")
    world, files = index.get("world_size"), index.get("files")
    if not (_is_int(world) and world >= 1 and isinstance(files, list) and len(files) == world):
        raise _bad(path, "world_size and files do not agree")
    for name in files:
        if name not in manifest or name == fmt.INDEX:
            raise _bad(path, f"file {name!r} is not a data file listed in the {fmt.COMPLETE} manifest")
    params, buffers = index.get("params"), index.get("buffers")
    if not isinstance(params, dict) or not isinstance(buffers, dict):
        raise _bad(path, "params and buffers must be objects")
    for name, entry in params.items():
        _check_tensor_entry(path, name, entry)
        _check_shards(path, name, entry.get("shards"), math.prod(entry["shape"]), world)
    for name, entry in buffers.items():
        _check_tensor_entry(path, name, entry)
    _check_optimizer_index(path, index.get("optimizer"), params)


def _check_tensor_entry(path: str, name: str, entry: Any) -> None:
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
        raise _bad(path, f"{name!r} has no valid shape")
    if not isinstance(entry.get("dtype"), str):
        raise _bad(path, f"{name!r} has no dtype")
    fmt.dtype_from_name(entry["dtype"])


def _check_shards(path: str, name: str, shards: Any, numel: int, world: int) -> None:
    """The shards ``[[file, lo, hi], ...]`` must tile ``[0, numel)`` in order."""
    if not isinstance(shards, list):
        raise _bad(path, f"{name!r} has no shard list")
    expect = 0
    for shard in shards:
        ok = (
            isinstance(shard, list)
            and len(shard) == 3
            and all(_is_int(x) for x in shard)
            and 0 <= shard[0] < world
            and shard[1] == expect
            and shard[1] < shard[2] <= numel
        )
        if not ok:
            raise _bad(path, f"shards of {name!r} do not tile its {numel} elements: {shards!r}")
        expect = shard[2]
    if expect != numel:
        raise _bad(path, f"shards of {name!r} cover {expect} of its {numel} elements")


def _check_optimizer_index(path: str, opt: Any, params: dict) -> None:
    if opt is None:
        return
    groups, state = (opt.get("param_groups"), opt.get("state")) if isinstance(opt, dict) else (None, None)
    if not (isinstance(groups, list) and isinstance(state, dict)):
        raise _bad(path, "optimizer needs param_groups and state")
    if not isinstance(opt.get("class", ""), str):
        raise _bad(path, "optimizer class must be a string")
    if "grad_guard" in opt and (problem := scaler_state_problem(opt["grad_guard"])):
        raise _bad(path, f"optimizer grad_guard (loss scaler): {problem}")
    for g in groups:
        names = g.get("param_names") if isinstance(g, dict) else None
        if not (
            isinstance(names, list) and all(isinstance(n, str) for n in names) and isinstance(g.get("hyper"), dict)
        ):
            raise _bad(path, "each optimizer param group needs hyper and param_names")
    for name, entry in state.items():
        if name not in params or not isinstance(entry, dict):
            raise _bad(path, f"optimizer state for unknown parameter {name!r}")
        for key, spec in entry.items():
            region = spec.get("region") if isinstance(spec, dict) else None
            if not (isinstance(spec, dict) and ("value" in spec or isinstance(region, str))):
                raise _bad(path, f"optimizer state {key!r} of {name!r}")
            if region is not None:
                fmt.dtype_from_name(region)


# -- matching the live model and optimizer ------------------------------------------------
def _names(names) -> str:
    names = sorted(names)
    more = f" and {len(names) - _LIST_AT_MOST} more" if len(names) > _LIST_AT_MOST else ""
    return f"{names[:_LIST_AT_MOST]}{more}"


def _compare(kind: str, saved: dict, live: dict[str, tuple]) -> list[str]:
    problems = []
    missing, unexpected = live.keys() - saved.keys(), saved.keys() - live.keys()
    if missing:
        problems.append(f"missing {kind} (in the model, not in the checkpoint): {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected {kind} (in the checkpoint, not in the model): {_names(unexpected)}")
    for name in sorted(live.keys() & saved.keys()):
        if tuple(saved[name]["shape"]) != live[name]:
            problems.append(
                f"shape mismatch for {name!r}: checkpoint has {tuple(saved[name]['shape'])}, the model has {live[name]}"
            )
    return problems


def match_model(index: dict, views: list[ParamView], buffers: list[tuple[str, torch.Tensor]], path: str) -> None:
    problems = _compare("parameters", index["params"], {v.name: v.shape for v in views})
    problems += _compare("buffers", index["buffers"], {n: tuple(b.shape) for n, b in buffers})
    if problems:
        raise CheckpointError(
            f"zp.load_checkpoint: checkpoint {path} does not match this model (saved from a "
            f"different model?): " + "; ".join(problems)
        )


def match_optimizer(index: dict, engine, inner, path: str) -> None:
    saved = index["optimizer"]
    if saved is None:
        raise CheckpointError(
            f"zp.load_checkpoint: checkpoint {path} holds no optimizer state (saved with "
            "optimizer=None); load it with optimizer=None"
        )
    error = class_mismatch(
        saved.get("class"),
        inner,
        "zp.load_checkpoint",
        f"or load the model alone (zp.load_checkpoint({path!r}, model)) and start this optimizer fresh",
    )
    if error is not None:
        raise CheckpointError(error)
    groups = saved["param_groups"]
    if len(groups) != len(inner.param_groups):
        raise CheckpointError(
            f"zp.load_checkpoint: checkpoint {path} has {len(groups)} optimizer param groups, "
            f"this optimizer has {len(inner.param_groups)}"
        )
    for gi, (saved_group, group) in enumerate(zip(groups, inner.param_groups)):
        live = {engine.name_of_master(p) for p in group["params"]}
        stored = set(saved_group["param_names"])
        if live != stored:
            raise CheckpointError(
                f"zp.load_checkpoint: optimizer param group {gi} of checkpoint {path} does not match: missing "
                f"{_names(live - stored)} (trained here, not in the checkpoint), unexpected {_names(stored - live)}"
            )
    trained = {s.name for s in engine.slots}
    unknown = set(saved["state"]) - trained
    if unknown:
        raise CheckpointError(
            f"zp.load_checkpoint: checkpoint {path} has optimizer state for parameters this "
            f"optimizer does not train: {_names(unknown)}"
        )
