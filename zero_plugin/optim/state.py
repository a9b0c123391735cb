"""Optimizer state between its sharded (per-rank) and full (unsharded) forms.

A state tensor belongs to a master when it has the master's numel (exp_avg,
exp_avg_sq, momentum_buffer...); it is then this rank's region of a tensor
shaped like the parameter.  Anything else (``step``, scalars) is the same on
every rank and passes through unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .master import MasterParam

__all__ = [
    "consolidate_optimizer_state",
    "shard_optimizer_state",
    "gather_full",
    "region_of",
    "optimizer_class",
    "class_mismatch",
]


def _ordered_slots(opt: Any) -> list[MasterParam]:
    by_master = {id(s.master): s for s in opt.engine.slots}
    if opt.whole is not None:  # the parameter partition's whole masters ([Note: optimizer partitions])
        by_master.update({id(w): s for w, s in zip(opt.whole.wholes, opt.whole.slots)})
    return [by_master[id(p)] for g in opt.inner.param_groups for p in g["params"]]


def _is_region_state(value: Any, slot: MasterParam) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == slot.master.numel()


@torch.no_grad()
def gather_full(comm, local: torch.Tensor, layout, shape: tuple) -> torch.Tensor:
    """Collective: every rank's region of a flattened tensor -> the full tensor (CPU) on every rank."""
    if layout.world_size == 1:
        return local.detach().reshape(shape).cpu().clone()
    padded = torch.zeros(layout.shard_numel, dtype=local.dtype, device=local.device)
    padded[: local.numel()].copy_(local.reshape(-1))
    out = torch.empty(layout.padded_numel, dtype=local.dtype, device=local.device)
    comm.all_gather(out, padded)
    rows = out.view(layout.world_size, layout.shard_numel)
    full = torch.empty(layout.numel, dtype=local.dtype)
    for r in range(layout.world_size):
        lo, hi = layout.bounds(r)
        full[lo:hi].copy_(rows[r, : hi - lo])
    return full.view(shape)


def consolidate_optimizer_state(opt: Any, to_rank: int | None) -> dict:
    comm = opt.engine.comm
    local_sd = opt.inner.state_dict()
    slots = _ordered_slots(opt)
    keys = [sorted(k for k, v in opt.inner.state.get(s.master, {}).items() if _is_region_state(v, s)) for s in slots]
    all_keys = comm.all_gather_object(keys)
    if any(k != all_keys[0] for k in all_keys):
        raise RuntimeError("zero_plugin: optimizer state keys differ across ranks; was step() called on every rank?")
    full_state: dict[int, dict] = {}
    for idx, (slot, region_keys) in enumerate(zip(slots, keys)):
        state = opt.inner.state.get(slot.master, {})
        entry = {}
        for k, v in state.items():
            if k in region_keys:
                entry[k] = gather_full(comm, v, slot.layout, opt.engine.full_shape(slot.param))
            else:
                entry[k] = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
        if entry:
            full_state[idx] = entry
    if to_rank is not None and comm.world.rank != to_rank:
        return {}
    groups = []
    for group, g_sd in zip(opt.inner.param_groups, local_sd["param_groups"]):
        g = dict(g_sd)
        g["param_names"] = [opt.engine.name_of_master(p) for p in group["params"]]
        groups.append(g)
    return {"state": full_state, "param_groups": groups}


def shard_optimizer_state(opt: Any, full_sd: dict, owns: Callable[[int], bool] | None = None) -> dict:
    """Slice a full optimizer state dict down to this rank's regions (no communication); with ``owns`` (the
    parameter partition: ``owns(slot index)``), keep the full entries of the parameters this rank owns."""
    if "state" not in full_sd or "param_groups" not in full_sd:
        raise ValueError("ZeroOptimizer.load_state_dict: expected a dict with 'state' and 'param_groups'")
    slots = _ordered_slots(opt)
    n_full = sum(len(g["params"]) for g in full_sd["param_groups"])
    if n_full != len(slots) or len(full_sd["param_groups"]) != len(opt.inner.param_groups):
        raise ValueError(
            f"ZeroOptimizer.load_state_dict: the state dict has {len(full_sd['param_groups'])} groups / "
            f"{n_full} params but this optimizer has {len(opt.inner.param_groups)} groups / {len(slots)} "
            "trainable params; load a state dict saved from the same model and param groups"
        )
    order = [i for g in full_sd["param_groups"] for i in g["params"]]
    state = {}
    for pos, (full_idx, slot) in enumerate(zip(order, slots)):
        entry = full_sd["state"].get(full_idx)
        if entry is None:
            continue
        if owns is None:
            state[pos] = {k: _slice_value(k, v, slot) for k, v in entry.items()}
        elif owns(opt.whole.index_of(slot.master)):
            state[pos] = {k: _whole_value(k, v, slot) for k, v in entry.items()}
    groups = []
    for pos_group, (g_full, _g_local) in enumerate(zip(full_sd["param_groups"], opt.inner.param_groups)):
        g = {k: v for k, v in g_full.items() if k not in ("params", "param_names")}
        start = sum(len(x["params"]) for x in full_sd["param_groups"][:pos_group])
        g["params"] = list(range(start, start + len(g_full["params"])))
        groups.append(g)
    return {"state": state, "param_groups": groups}


def _whole_value(key: str, value: Any, slot: MasterParam) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == slot.layout.numel:
        return value.detach().clone()
    return value


def region_of(value: Any, slot: MasterParam) -> Any:
    """This rank's region of a parameter-shaped state tensor (a copy shaped like the master); else ``value``."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.numel() != slot.layout.numel:
        return value
    lo, hi = slot.layout.bounds()
    return value.detach().reshape(-1)[lo:hi].clone().view_as(slot.master)


def _slice_value(key: str, value: Any, slot: MasterParam) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() != slot.layout.numel:
        raise ValueError(
            f"ZeroOptimizer.load_state_dict: state {key!r} of parameter {slot.name!r} has {value.numel()} "
            f"elements, the parameter has {slot.layout.numel}"
        )
    return region_of(value, slot)


def optimizer_class(optimizer: Any) -> str:
    """The qualified class name saved with optimizer state, e.g. ``torch.optim.adamw.AdamW``."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def class_mismatch(saved: Any, optimizer: Any, verb: str, fix: str) -> str | None:
    """The error for state saved from another optimizer class, or None.  torch's load_state_dict would take
    it: the param groups' hyper-parameters are replaced by the saved ones and the state keys differ, so the
    next step fails (AdamW into SGD: ``KeyError: 'momentum'``) or, worse, runs with the wrong settings.
    ``saved`` None: nothing recorded (a plain torch state dict), nothing to check."""
    live = optimizer_class(optimizer)
    if saved is None or saved == live:
        return None
    return (
        f"{verb}: the optimizer state was saved from a {saved}, this optimizer is a {live}; its state and "
        f"hyper-parameters do not fit. Load it into the same optimizer class ({saved}), {fix}"
    )
