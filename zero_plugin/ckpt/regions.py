"""Where each parameter's values live on this rank, for every stage.

[Note: checkpoint regions]
The checkpoint stores each parameter *flattened and unpadded* (``numel``
elements) and cut into the regions ``ShardLayout(numel, N, r).bounds()`` of the
N saving ranks: exactly what a rank owns at stage 3 (its shard) and stages 1-2
(its optimizer region), and a slice of the full tensor at stage 0.  So every
stage writes the same layout, each rank writes only its region, and loading at
any stage and world size is slicing: a rank reads ``[lo, hi)`` of its own
layout (stage 3 parameters, stages 1-3 optimizer state) or ``[0, numel)``
(stage 0-2 parameters, stage 0 optimizer state).

A region is read from the optimizer's copy when it has its own (the fp32
master when ``param_dtype`` is lower, the host master with offload), else from
the parameter (stages 0-2) or its shard (stage 3).
This module only reads engine attributes (``engine.model``, ``engine.slots``,
stage 3's ``engine.sharded``); it changes nothing in the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..optim.master import MasterParam
from ..state_dict import raw_state_dict
from ..tensors.flat import ShardLayout
from .format import CheckpointError

__all__ = [
    "ParamView",
    "param_views",
    "persistent_buffers",
    "tied_aliases",
    "region_to_save",
    "state_region_to_save",
    "load_range",
    "copy_param_in",
]


@dataclass(slots=True)
class ParamView:
    """One (deduplicated) parameter of the set-up model, as the checkpoint sees it."""

    name: str
    param: nn.Parameter
    shape: tuple
    slot: MasterParam | None  # None for frozen parameters
    sharded: object | None  # stage 3: the ShardedParam holding the local shard

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def separate_master(self) -> torch.Tensor | None:
        """The optimizer's own copy (fp32 and/or on the host) when it is not the parameter's storage."""
        return self.slot.master if self.slot is not None and self.slot.separate else None

    @property
    def stored_dtype(self) -> torch.dtype:
        if self.separate_master is not None:
            return self.separate_master.dtype
        if self.sharded is not None:
            return self.sharded.local.dtype
        return self.param.dtype


def param_views(engine) -> list[ParamView]:
    sharded = engine.sharded  # stage 3's ShardedParams; empty at stages 0-2
    slots = {id(s.param): s for s in engine.slots}
    views = []
    for name, p in engine.model.named_parameters():
        sp = sharded.get(id(p))
        shape = tuple(sp.shape) if sp is not None else tuple(p.shape)
        views.append(ParamView(name, p, shape, slots.get(id(p)), sp))
    return views


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Entries of ``model.state_dict()`` that are not parameters (persistent buffers); torch's own state dict
    (raw_state_dict: no stage-3 gather, the model's own objects, which the filter below compares)."""
    param_ids = {id(p) for p in model.parameters()}
    with raw_state_dict(model):
        entries = model.state_dict(keep_vars=True)
    return [(k, v) for k, v in entries.items() if isinstance(v, torch.Tensor) and id(v) not in param_ids]


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """``{name: saved name}`` for every second name of a tied parameter: ``zp.save_checkpoint`` stores each
    parameter once (under its first name) while ``module.state_dict()`` -- and so a strict
    ``load_state_dict`` -- has every name."""
    saved = {id(p): name for name, p in module.named_parameters()}
    return {name: saved[id(p)] for name, p in module.named_parameters(remove_duplicate=False) if saved[id(p)] != name}


def region_to_save(view: ParamView, layout: ShardLayout) -> torch.Tensor:
    """This rank's region of the flattened parameter, as a 1-D tensor (a view where possible)."""
    lo, hi = layout.bounds()
    if view.separate_master is not None:
        return _region_of_master(view, view.separate_master, layout)
    if view.sharded is not None:
        assert view.sharded.layout == layout, f"{view.name}: stage-3 layout differs from the save layout"
        return view.sharded.local.reshape(-1)
    return view.param.data.reshape(-1)[lo:hi]


def _region_of_master(view: ParamView, tensor: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """A master-shaped tensor (the master or its optimizer state) cut to the save layout's region."""
    lo, hi = layout.bounds()
    flat = tensor.detach().reshape(-1)
    if view.slot.layout.world_size == 1:  # stage 0: the master (and its state) is the whole parameter
        return flat[lo:hi]
    assert view.slot.layout.bounds() == (lo, hi) and flat.numel() == hi - lo, f"{view.name}: unexpected master size"
    return flat


def state_region_to_save(view: ParamView, value: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """This rank's region of an optimizer state tensor shaped like the master."""
    return _region_of_master(view, value, layout)


def load_range(view: ParamView) -> tuple[int, int]:
    """The flat range of the parameter this rank must read: its shard at stage 3, all of it otherwise."""
    if view.sharded is not None:
        return view.sharded.layout.bounds()
    return 0, view.numel


@torch.no_grad()
def copy_param_in(view: ParamView, values: torch.Tensor, at: int, flat_start: int) -> None:
    """Write ``values``, the elements ``[flat_start, flat_start + len)`` of the flattened parameter, into the
    model at offset ``at`` of this rank's :func:`load_range`, and into the overlapping part of the master."""
    n = values.numel()
    target = view.sharded.local if view.sharded is not None else view.param.data
    target.view(-1)[at : at + n].copy_(values)
    master = view.separate_master
    if master is not None:  # from the stored values, not the (possibly lower precision) parameter
        m_lo, m_hi = view.slot.layout.bounds()
        a, b = max(flat_start, m_lo), min(flat_start + n, m_hi)
        if a < b:
            master.view(-1)[a - m_lo : b - m_lo].copy_(values[a - flat_start : b - flat_start])


def check_loadable(engine) -> None:
    if engine.unsharded_units():
        raise CheckpointError(
            "zp.load_checkpoint: some stage-3 units are gathered; load outside forward/backward "
            "and outside zp.gathered_parameters"
        )
