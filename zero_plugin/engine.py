"""The per-model engine: the object ``zp.setup`` attaches to a model.

An engine is the composition of a parameter placement (replicated for stages
0-2, sharded for stage 3), a gradient reducer and an optimizer binding; the
table that picks them is in ``zero_plugin/stages.py``.  Public verbs in
``api.py`` find the engine of a model through :func:`engine_of`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from .collectives import Comm
from .config import ZeroConfig
from .optim.master import MasterParam
from .optim.offload import synchronize_copies

__all__ = ["Engine", "engine_of", "register_engine"]

# [Note: engine registry] The engine lives in the model's __dict__ (not in a global map whose values
# would keep every model alive): model -> engine -> model is a plain cycle the GC collects.
_ATTR = "_zero_plugin_engine"


def engine_of(model: Any, verb: str) -> "Engine":
    """The engine ``zp.setup`` attached to ``model`` (or to a module inside a wrapper around it)."""
    if isinstance(model, nn.Module):
        for module in model.modules():   # the model itself first, then e.g. a PEFT/Lightning-wrapped one
            found = module.__dict__.get(_ATTR)
            if isinstance(found, Engine):
                return found
    raise ValueError(
        f"zp.{verb}: {type(model).__name__} was not prepared by zp.setup; call "
        "`model, optimizer = zp.setup(model, optimizer, config)` first and pass that model"
    )


def register_engine(model: nn.Module, engine: "Engine") -> None:
    if isinstance(model.__dict__.get(_ATTR), Engine):
        raise ValueError("zp.setup: this model was already set up; call zp.setup once per model")
    model.__dict__[_ATTR] = engine


def unregister_engine(model: nn.Module) -> None:
    model.__dict__.pop(_ATTR, None)


class Engine:
    """What every stage provides to the optimizer wrapper and the public verbs."""

    grads_sharded: bool = False   # True when each rank's owned grads are disjoint (global norm needs a sum)

    def __init__(self, model: nn.Module, config: ZeroConfig, comm: Comm, slots: list[MasterParam]) -> None:
        self.model = model
        self.config = config
        self.comm = comm
        self.slots = slots
        self._master_names = {id(s.master): s.name for s in slots}
        # Global grad norm of this step, set by clip_grad_norm_ and consumed by the step's inf/NaN check.
        self.step_grad_norm: float | None = None

    # -- step ---------------------------------------------------------------
    def before_step(self, blocked: bool = False) -> None:
        """Give every master its gradient; ``blocked``: for the blocked step ([Note: cache-blocked offload
        step] in optim/blocked_step.py), which casts gradients and waits for each host copy itself."""
        for slot in self.slots:
            slot.set_grad(self.owned_grad(slot), blocked)
        if not blocked:
            self.wait_for_host_copies()

    def after_step(self) -> None:
        for slot in self.slots:
            slot.write_back()
            if not slot.is_identity:
                slot.master.grad = None

    @property
    def compute_device(self) -> torch.device:
        """Where forward and backward run; host copies issued there are waited for before a CPU step."""
        return next((s.param.device for s in self.slots), torch.device("cpu"))

    def wait_for_host_copies(self) -> None:
        """With offload, once before the step reads the host gradients ([Note: asynchronous host copies]
        in optim/offload.py); without offload nothing was copied and the device queue is left running."""
        if self.config.offload or self.config.offload_params:
            synchronize_copies(self.compute_device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError

    def owned_grad(self, slot: MasterParam) -> torch.Tensor | None:
        raise NotImplementedError

    def owned_grads(self) -> list[torch.Tensor]:
        return [g for g in (self.owned_grad(s) for s in self.slots) if g is not None]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        raise NotImplementedError
        yield

    # -- state ----------------------------------------------------------------
    def name_of_master(self, master: torch.Tensor) -> str:
        return self._master_names[id(master)]

    def shard_metadata(self) -> dict:
        return {
            "sharded": True,
            "stage": self.config.stage,
            "rank": self.comm.rank,
            "world_size": self.comm.world_size,
            "params": [(s.name, s.layout.numel) for s in self.slots],
        }

    def check_shard_metadata(self, meta: dict) -> None:
        mine = self.shard_metadata()
        for key in ("world_size", "rank", "stage", "params"):
            if _normalise(meta.get(key)) != _normalise(mine[key]):
                raise ValueError(
                    f"ZeroOptimizer.load_state_dict: the shard was saved with {key}={meta.get(key)!r} but this "
                    f"rank has {key}={mine[key]!r}; load a full state dict (consolidate_state_dict) or use "
                    "zp.load_checkpoint, which reshards"
                )

    def full_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        """Shape of ``param`` in the unsharded model."""
        return tuple(param.shape)

    def full_numel(self, param: nn.Parameter) -> int:
        """Elements of ``param`` in the unsharded model."""
        return param.numel()

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors of model states this rank holds, by category, for memory accounting."""
        raise NotImplementedError

    def remove(self) -> None:
        guard = getattr(self, "frozen_guard", None)
        if guard is not None:
            guard.remove()
        unregister_engine(self.model)


def _normalise(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    return value
