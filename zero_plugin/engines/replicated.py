"""Stages 0-2: every rank keeps the full parameters (ZeRO paper, section 5.1-5.2).

What differs between the three stages is only the composition chosen in
``stages.py``: whether masters cover the whole parameter or this rank's
region, which reducer runs in backward, and whether updated regions are
all-gathered after the step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from ..comm.collectives import Comm
from ..config import ZeroConfig
from ..grads.reducer import GradReducer
from ..loading.quantized import is_packed_4bit
from ..optim.master import MasterParam
from ..optim.offload import host_for
from ..optim.pipelined_step import only_these, steps_in_pieces
from ..optim.state import gather_full
from ..tensors.flat import ShardLayout
from .engine import Engine, EngineBasis
from .param_sync import ParamAllGather

__all__ = ["ReplicatedEngine", "make_masters", "cast_frozen"]


@torch.no_grad()
def cast_frozen(model: nn.Module, trainable: list[tuple[str, nn.Parameter]], config: ZeroConfig) -> None:
    """Frozen floating-point parameters take ``param_dtype`` as stage 3 stores them (no master: nothing
    updates them); buffers keep their dtype, as at stage 3.  Trainable ones are cast by ``make_masters``."""
    if config.precision.param_dtype is None:
        return
    trained = {id(p) for _, p in trainable}
    for p in model.parameters():
        if (
            id(p) not in trained
            and p.is_floating_point()
            and p.dtype != config.precision.param_dtype
            and not is_packed_4bit(p)
        ):
            p.data = p.data.to(config.precision.param_dtype)


def make_masters(
    named: list[tuple[str, nn.Parameter]], comm: Comm, config: ZeroConfig, sharded: bool
) -> list[MasterParam]:
    """One master per trainable parameter; casts the model to ``param_dtype`` on the way."""
    master_dtype = config.precision.master_dtype if config.precision.param_dtype is not None else None
    slots = []
    for name, p in named:
        world, rank = (comm.world_size, comm.rank) if sharded else (1, 0)
        layout = ShardLayout(p.numel(), world, rank)
        source = None
        if config.precision.param_dtype is not None and p.dtype != config.precision.param_dtype:
            source = layout.local_view(p.data) if sharded else p.data.clone()
            p.data = p.data.to(config.precision.param_dtype)
        master_device = host_for(p.device) if config.offload.optimizer == "cpu" else None
        if sharded:
            local = layout.local_view(p.data)
        elif master_dtype in (None, p.dtype) and master_device is None:
            local = p  # plain DDP: the optimizer steps the parameter itself
        else:
            local = p.data
        slots.append(MasterParam(name, p, layout, local, master_dtype, source=source, master_device=master_device))
    return slots


class ReplicatedEngine(Engine):
    """Full parameters on every rank; gradients and optimizer state as the stage says."""

    def __init__(self, basis: EngineBasis, reducer: GradReducer, param_sync: ParamAllGather | None) -> None:
        super().__init__(basis)
        self.reducer = reducer
        self.param_sync = param_sync
        # [Note: writes to parameters behind separate masters]: the version of each such parameter when its
        # master last agreed with it
        self._versions = {id(s): s.param._version for s in self.slots if s.separate}
        self.grads_sharded = reducer.sharded
        reducer.register(basis.model, self.after_backward)

    def owned_grad(self, slot: MasterParam) -> torch.Tensor | None:
        return self.reducer.owned_grad(slot)

    def checked_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.reducer.checked_grads()

    # [Note: writes to parameters behind separate masters]
    # With fp32 masters of lower-precision parameters (or masters on the host), the optimizer steps the
    # master and writes it back into the parameter, so a write to the parameter itself between steps
    # (``model.load_state_dict``, an in-place edit under ``torch.no_grad()``) would be overwritten by the
    # next write-back: the model silently trained on from the old weights.  Our own writes go through
    # ``.data`` views and leave the parameter's autograd version counter alone; a user's write bumps it.  So
    # before a step (and before masters are read whole) each such parameter whose version moved hands its
    # master the elements that differ from the master rounded to the parameter's dtype, as a gathered edit
    # does ([Note: gathered edits] in optim/master.py): untouched elements keep the master's precision.
    # Writes through ``param.data`` are not seen (autograd does not count them either).
    @torch.no_grad()
    def take_param_writes(self) -> None:
        for slot in self.slots:
            version = slot.param._version
            if slot.separate and version != self._versions[id(slot)]:
                slot.take_edits(slot.master.to(device=slot.local.device, dtype=slot.local.dtype))
                self._versions[id(slot)] = version

    def before_step(self, blocked: bool = False, slots: list[MasterParam] | None = None) -> None:
        self.take_param_writes()
        super().before_step(blocked, slots)

    def after_step(self, slots: list[MasterParam] | None = None) -> None:
        super().after_step(slots)
        # A step consumes the reduced gradients: the next backward starts fresh even
        # when the script zeroes grads with model.zero_grad() (stage 2 keeps none in .grad).
        self.reducer.consume(slots)  # [Note: several optimizers] in engine.py
        if self.param_sync is not None:
            self.param_sync.run(slots)

    def can_step_pipelined(self, inner: torch.optim.Optimizer) -> bool:
        return (
            self.param_sync is not None
            and self.param_sync.pipelines
            and not (self.config.offload.optimizer == "cpu" or self.config.offload.params)
            and steps_in_pieces(inner)
            and {id(p) for g in inner.param_groups for p in g["params"]} == {id(s.master) for s in self.slots}
        )

    def step_pipelined(self, inner: torch.optim.Optimizer) -> None:
        """``inner.step()`` and :meth:`after_step`, one bucket at a time ([Note: pipelined step])."""

        def step(slots: list[MasterParam]) -> None:
            with only_these(inner, [slot.master for slot in slots]):
                inner.step()
            self.write_back(slots)

        self.param_sync.run_stepping(step)
        self.reducer.consume()  # as after_step

    def discard_grads(self, set_to_none: bool, slots: list[MasterParam] | None = None) -> None:
        self.reducer.zero_grad(set_to_none, slots)  # param.grad and the reduced grads it indexes (stage 2: the shards)
        for slot in self.slots if slots is None else slots:
            if not slot.is_identity:
                slot.master.grad = None

    def accumulator(self) -> Any:
        return self.reducer

    @contextlib.contextmanager
    def gathered(self, params: list[nn.Parameter], modifier_rank: int | None) -> Iterator[None]:
        # Parameters are already full on every rank; only edits need spreading, and only edited
        # elements reach the masters ([Note: gathered edits] in optim/master.py).
        wanted = {id(p) for p in params}
        before = [(s, s.snapshot()) for s in self.slots if id(s.param) in wanted] if modifier_rank is not None else []
        yield
        if modifier_rank is not None:
            with torch.no_grad():
                for p in params:
                    self.comm.world.broadcast(p.data, src=modifier_rank)
            for slot, snapshot in before:
                slot.take_edits(snapshot)

    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = True, trainable_only: bool = False) -> dict:
        """Full tensors; with mixed precision the trained parameters come from their fp32 masters."""
        self.take_param_writes()
        masters = {
            id(s.param): gather_full(self.comm, s.master.detach().reshape(-1), s.layout, tuple(s.param.shape))
            for s in self.slots
            if s.separate
        }  # collective: every rank takes part
        if rank0_only and self.comm.world.rank != 0:
            return {}
        keep = {id(s.param) for s in self.slots} if trainable_only else None
        out = {}
        for name, value in self.model.state_dict(keep_vars=True).items():
            if keep is not None and id(value) not in keep:
                continue
            out[name] = masters[id(value)] if id(value) in masters else value.detach().cpu().clone()
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        result = self.model.load_state_dict(state_dict, strict=strict)
        names = {id(p): n for n, p in self.model.named_parameters()}
        for slot in self.slots:
            value = state_dict.get(names[id(slot.param)])
            if slot.separate and value is not None:  # keep the fp32 precision the dict carries
                region = slot.layout.local_view(value.detach().reshape(-1).contiguous())
                slot.master.copy_(region.reshape(slot.master.shape))
            else:
                slot.refresh_from_param()
        return result

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = [p for p in self.model.parameters()]
        grads = [p.grad for p in params if p.grad is not None] + self.reducer.grad_tensors()
        masters = [s.master for s in self.slots if s.separate]
        return {"params": params, "grads": grads, "masters": masters}

    def remove(self) -> None:
        self.reducer.remove()
        super().remove()
