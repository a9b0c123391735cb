"""The parameter partition: each trainable parameter stepped whole, in its real shape, by the rank that owns it
([Note: optimizer partitions] in ``partition.py``).

The engine is the same as in the element partition: reduced gradients, masters and the parameter sync (stages
1-2) stay per-rank flat regions ([Note: masters] in ``master.py``).  What changes is what the user's optimizer
holds: one *whole master* per parameter (``WholeParams.wholes``), an ``nn.Parameter`` of the parameter's full
shape in the masters' dtype, whose storage exists only on its owner and only during the step.  A step is

    gather_to_owners (regions of the masters and of their gradients) -> inner.step() -> scatter_back (regions)

after which the engine writes the regions back into the parameters and, at stages 1-2, all-gathers them, as
in the element partition.  A parameter without a gradient (no rank used it; every rank agrees, as the
reducers give DDP's semantics) is neither sent nor stepped, as torch's optimizers skip it.

[Note: whole masters between steps] The optimizer's state (keyed by the whole masters) lives on the owner
only.  Between steps a whole master has the parameter's shape, dtype and device but no storage (resized to
0 bytes, as stage 3 releases a unit): an optimizer reads a parameter's values only in ``step``, when the
owner's are filled; the others have no gradient and are skipped.

[Note: the element view of parameter-partition state] Checkpoints and consolidated state dicts keep one
format, the element partition's (each rank its region of every parameter-shaped state tensor, other values
the same on every rank), so that they load at any world size, stage and partition.  :meth:`element_view`
converts to that form for the duration of a save or load and back after it: parameter-shaped state
tensors (the parameter's numel and shape) are scattered from the owner in regions, every other state value
(a step count, Adafactor's row and column factors) is sent to every rank.  Back from the element form, a
1-D tensor with this rank's region's numel is a region (the convention of ``state.py``), anything else a
value taken from the owner's copy.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from ..tensors.phases import phase
from .master import MasterParam
from .partition import assign_owners

__all__ = ["WholeParams"]

_GATHER = "parameter partition: regions to owners"
_SCATTER = "parameter partition: stepped regions back"
_STATE = "parameter partition: optimizer state regions"


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _fill_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


class WholeParams:
    """The whole masters of one engine's slots, who owns each, and the step over them."""

    def __init__(self, slots: list[MasterParam], comm: Any, full_shapes: list[tuple[int, ...]]) -> None:
        self.slots = slots
        self.comm = comm
        self.owners = assign_owners([s.layout.numel for s in slots], comm.world_size)
        self.wholes: list[nn.Parameter] = []
        for slot, shape in zip(slots, full_shapes):
            whole = nn.Parameter(torch.empty(shape, dtype=slot.master.dtype, device=slot.master.device))
            _free(whole)  # [Note: whole masters between steps]
            self.wholes.append(whole)
        self._index = {id(w): i for i, w in enumerate(self.wholes)}
        self._index.update({id(s.master): i for i, s in enumerate(slots)})

    def index_of(self, tensor: torch.Tensor) -> int:
        """The slot of a whole master or of a region master."""
        return self._index[id(tensor)]

    def owns(self, i: int) -> bool:
        return self.owners[i] == self.comm.rank

    # -- the step ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, inner: torch.optim.Optimizer) -> None:
        """``inner.step()`` over whole masters, between the gather of every region to its owner and the
        scatter of the stepped regions back into the region masters."""
        stepped = [i for i, s in enumerate(self.slots) if s.master.grad is not None]
        mine = [i for i in stepped if self.owns(i)]
        for i in mine:
            whole = self.wholes[i]
            _fill_storage(whole)
            whole.grad = torch.empty_like(whole)
        try:
            with phase("owner_gather"):  # [Note: profiler phases]
                self._gather(stepped)
            inner.step()
            with phase("owner_scatter"):
                self._scatter(stepped)
        finally:
            for i in mine:
                self.wholes[i].grad = None
                _free(self.wholes[i])

    def _exchange(
        self, sends: dict[int, list[torch.Tensor]], receives: dict[int, list[torch.Tensor]], tag: str
    ) -> None:
        """``Comm.exchange`` of tensors wherever they live: what is not a contiguous tensor on the group's device
        (host masters under offload with NCCL, a strided region) travels through a staging copy."""
        wire = self.comm.device
        sends = {peer: [t.to(wire).contiguous() for t in ts] for peer, ts in sends.items()}
        landing: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged: dict[int, list[torch.Tensor]] = {}
        for peer, ts in receives.items():
            for t in ts:
                if t.device == wire and t.is_contiguous():
                    staged.setdefault(peer, []).append(t)
                else:
                    stage = torch.empty(t.shape, dtype=t.dtype, device=wire)
                    staged.setdefault(peer, []).append(stage)
                    landing.append((t, stage))
        self.comm.exchange(sends, staged, tag=tag)
        for t, stage in landing:
            t.copy_(stage)

    def _regions(self, i: int, full: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's region of the flat ``full`` tensor, by rank."""
        flat = full.view(-1)
        layout = self.slots[i].layout
        return [flat[slice(*layout.bounds(r))] for r in range(self.comm.world_size)]

    def _gather(self, stepped: list[int]) -> None:
        """Each owner receives every rank's region of the master (unless its own full parameter already
        holds the current values: stages 1-2 without separate masters) and of its gradient."""
        sends: dict[int, list[torch.Tensor]] = {}
        receives: dict[int, list[torch.Tensor]] = {}
        rank = self.comm.rank
        for i in stepped:
            slot, owner, whole = self.slots[i], self.owners[i], self.wholes[i]
            local_values = _holds_full_values(slot)
            mine = [] if local_values else [slot.master.detach().reshape(-1)]
            mine.append(slot.master.grad.detach().reshape(-1).to(whole.dtype))
            if owner != rank:
                sends.setdefault(owner, []).extend(mine)  # made contiguous by _exchange
                continue
            values, grads = self._regions(i, whole), self._regions(i, whole.grad)
            if local_values:
                whole.view(-1).copy_(slot.param.detach().reshape(-1))
            else:
                values[rank].copy_(mine[0])
            grads[rank].copy_(mine[-1])
            for peer in range(self.comm.world_size):
                if peer != rank:
                    receives.setdefault(peer, []).extend(([] if local_values else [values[peer]]) + [grads[peer]])
        self._exchange(sends, receives, _GATHER)

    def _scatter(self, stepped: list[int]) -> None:
        """Each owner sends every rank its region of the stepped whole master."""
        sends: dict[int, list[torch.Tensor]] = {}
        receives: dict[int, list[torch.Tensor]] = {}
        rank = self.comm.rank
        for i in stepped:
            slot, owner = self.slots[i], self.owners[i]
            region = slot.master.detach().reshape(-1)
            if owner == rank:
                regions = self._regions(i, self.wholes[i])
                region.copy_(regions[rank])
                for peer in range(self.comm.world_size):
                    if peer != rank:
                        sends.setdefault(peer, []).append(regions[peer])
            else:
                receives.setdefault(owner, []).append(region)
        self._exchange(sends, receives, _SCATTER)

    # -- state in the element partition's form --------------------------------------------------------------
    @contextlib.contextmanager
    def element_view(self, inner: torch.optim.Optimizer) -> Iterator[None]:
        """Collective: for the duration, ``inner`` holds the region masters and its state in the element
        partition's form; what the block loads into it is taken back into whole form on exit ([Note: the
        element view of parameter-partition state]).  Left by an exception, the whole form is restored as
        it was (a failed load changes nothing)."""
        whole_groups = [group["params"] for group in inner.param_groups]
        whole_state = inner.state
        inner.state = self._to_regions(whole_state)
        for group in inner.param_groups:
            group["params"] = [self.slots[self.index_of(p)].master for p in group["params"]]
        try:
            yield
        except BaseException:
            self._restore(inner, whole_groups, whole_state)
            raise
        element_state = inner.state
        self._restore(inner, whole_groups, self._from_regions(element_state))

    @staticmethod
    def _restore(inner: torch.optim.Optimizer, groups: list[list], state: Any) -> None:
        for group, params in zip(inner.param_groups, groups):
            group["params"] = params
        inner.state = state

    def _to_regions(self, whole_state: Any) -> Any:
        """The element form of the owners' state: every rank its regions and every value."""
        described: dict[int, dict[str, tuple]] = {}  # {slot: {key: ("region", dtype name) | ("value", value)}}
        for i, whole in enumerate(self.wholes):
            entry = whole_state.get(whole) if self.owns(i) else None
            for key, value in (entry or {}).items():
                if _param_shaped(value, whole):
                    spec = ("region", str(value.dtype).removeprefix("torch."))
                else:
                    spec = ("value", _value(value))
                described.setdefault(i, {})[key] = spec
        merged: dict[int, dict[str, tuple]] = {}
        for part in self.comm.all_gather_object(described):
            merged.update(part)
        sends: dict[int, list[torch.Tensor]] = {}
        receives: dict[int, list[torch.Tensor]] = {}
        out = type(whole_state)() if not isinstance(whole_state, dict) else {}
        rank = self.comm.rank
        for i in sorted(merged):
            slot, owner = self.slots[i], self.owners[i]
            entry = {}
            for key, (kind, what) in merged[i].items():
                if kind == "value":
                    entry[key] = _copy(what, slot.master.device)
                    continue
                region = torch.empty(slot.master.shape, dtype=getattr(torch, what), device=slot.master.device)
                entry[key] = region
                if owner == rank:
                    regions = self._regions(i, whole_state[self.wholes[i]][key].detach())
                    region.reshape(-1).copy_(regions[rank])
                    for peer in range(self.comm.world_size):
                        if peer != rank:
                            sends.setdefault(peer, []).append(regions[peer])
                else:
                    receives.setdefault(owner, []).append(region.view(-1))
            out[slot.master] = entry
        self._exchange(sends, receives, _STATE)
        return out

    def _from_regions(self, element_state: Any) -> Any:
        """The whole form of element-partition state: each owner assembles its parameters' regions; values
        come from the owner's own copy."""
        rank = self.comm.rank
        schema = {}  # this rank's view: {i: {key: "region" | "value"}}
        for i, slot in enumerate(self.slots):
            entry = element_state.get(slot.master)
            if entry and slot.layout.local_numel:
                schema[i] = {k: _is_region(v, slot) for k, v in entry.items()}
        owners_schema: dict[int, dict[str, bool]] = {}
        for part in self.comm.all_gather_object({i: s for i, s in schema.items() if self.owns(i)}):
            owners_schema.update(part)
        sends: dict[int, list[torch.Tensor]] = {}
        receives: dict[int, list[torch.Tensor]] = {}
        out = type(element_state)() if not isinstance(element_state, dict) else {}
        for i in sorted(owners_schema):
            slot, owner, whole = self.slots[i], self.owners[i], self.wholes[i]
            entry = element_state.get(slot.master) or {}
            region_keys = [k for k, is_region in owners_schema[i].items() if is_region]
            if owner != rank:
                for key in region_keys:
                    if slot.layout.local_numel:
                        sends.setdefault(owner, []).append(entry[key].detach().reshape(-1))
                continue
            kept = {}
            for key, value in entry.items():
                if key not in region_keys:
                    kept[key] = value
                    continue
                full = torch.empty(whole.shape, dtype=value.dtype, device=whole.device)
                regions = self._regions(i, full)
                regions[rank].copy_(value.reshape(-1))
                for peer in range(self.comm.world_size):
                    if peer != rank and regions[peer].numel():
                        receives.setdefault(peer, []).append(regions[peer])
                kept[key] = full
            out[whole] = kept
        self._exchange(sends, receives, _STATE)
        return out


def _param_shaped(value: Any, whole: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == whole.shape


def _is_region(value: Any, slot: MasterParam) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == slot.layout.local_numel


def _value(v: Any) -> Any:
    return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v


def _copy(v: Any, device: torch.device) -> Any:
    if isinstance(v, torch.Tensor) and v.dim() > 0:
        return v.to(device).clone()
    return v.clone() if isinstance(v, torch.Tensor) else v


def _holds_full_values(slot: MasterParam) -> bool:
    """Stages 1-2 without a separate master: the parameter itself is full and current on every rank."""
    return not slot.separate and slot.param.numel() == slot.layout.numel and slot.param.dim() > 0
