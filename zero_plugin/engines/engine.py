"""The per-model engine: the object ``zp.setup`` attaches to a model.

An engine is the composition of a parameter placement (replicated for stages
0-2, sharded for stage 3), a gradient reducer and an optimizer binding; the
table that picks them is in ``zero_plugin/stages.py``.  Public verbs in
``api.py`` find the engine of a model through :func:`engine_of`.

[Note: per-step state] What a step has learnt about its gradients (``Engine.step_grad_norm``,
``grads_unscaled``, ``step_nonfinite``) is valid only for the
gradients it was computed from, so zero_grad (optimizer's or model's), the step and each later synced
backward (after_backward) reset it.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from ..comm.collectives import Comm
from ..config import ZeroConfig
from ..optim.master import MasterParam
from ..optim.offload import synchronize_copies
from .state_offload import refuse_if_offloaded

__all__ = ["Engine", "EngineBasis", "engine_of", "register_engine"]

# The engine lives in the model's __dict__ (not in a global map whose values would keep every model
# alive): model -> engine -> model is a plain cycle the GC collects.
_ATTR = "_zero_plugin_engine"


def engine_of(model: Any, verb: str) -> Engine:
    """The engine ``zp.setup`` attached to ``model`` (or to a module inside a wrapper around it)."""
    if isinstance(model, nn.Module):
        for module in model.modules():  # the model itself first, then e.g. a PEFT/Lightning-wrapped one
            found = module.__dict__.get(_ATTR)
            if isinstance(found, Engine):
                refuse_if_offloaded(found, f"zp.{verb}")  # [Note: parked states] in state_offload.py
                return found
    raise ValueError(
        f"zp.{verb}: {type(model).__name__} was not prepared by zp.setup; call "
        "`model, optimizer = zp.setup(model, optimizer, config)` first and pass that model"
    )


def register_engine(model: nn.Module, engine: Engine) -> None:
    if isinstance(model.__dict__.get(_ATTR), Engine):
        raise ValueError("zp.setup: this model was already set up; call zp.setup once per model")
    model.__dict__[_ATTR] = engine
    model.__dict__["zero_grad"] = types.MethodType(_model_zero_grad, model)  # [Note: model.zero_grad]


def unregister_engine(model: nn.Module) -> None:
    model.__dict__.pop(_ATTR, None)
    model.__dict__.pop("zero_grad", None)


# [Note: model.zero_grad]
# Stages 2-3 keep the reduced gradients outside `.grad` (stage 2: the reducer's shard-sized `owned`
# tensors; stage 3: each ShardedParam's `sharded_grad`), and stages 0-1 index them from the reducer;
# nn.Module.zero_grad only visits `.grad`, so gradients of a discarded backward would be added into
# the next one's.  The set-up module therefore gets an *instance* attribute `zero_grad` (in its
# __dict__, which attribute lookup reads before the class): its class's zero_grad, then the engine's.
# Only this one object changes -- no class is patched or swapped (FSDP2's `__class__` swap would change
# `type(model)`, which checkpoints, PEFT and Lightning look at) and nothing global -- and it is the
# object user loops, PEFT and HF Trainer call `zero_grad()` on; unregister_engine removes it.  A module
# built *around* the set-up model afterwards does not reach it (nn.Module.zero_grad walks parameters,
# not submodules' zero_grad); optimizer.zero_grad() always does.
def _model_zero_grad(model: nn.Module, set_to_none: bool = True) -> None:
    engine = model.__dict__.get(_ATTR)
    refuse_if_offloaded(engine, "model.zero_grad()")  # [Note: parked states] in state_offload.py
    type(model).zero_grad(model, set_to_none)
    if isinstance(engine, Engine):
        engine.zero_grad(set_to_none)


@dataclass(frozen=True, slots=True)
class EngineBasis:
    """What every engine is built on: the model, its config, the ranks' Comm and the optimizer's master slots
    (each stage's engine adds its own parts: a reducer and parameter sync at stages 0-2, units at stage 3)."""

    model: nn.Module
    config: ZeroConfig
    comm: Comm
    slots: list[MasterParam]


class Engine:
    """What every stage provides to the optimizer wrapper and the public verbs."""

    grads_sharded: bool = False  # True when each rank's owned grads are disjoint (global norm needs a sum)

    def __init__(self, basis: EngineBasis) -> None:
        self.model = basis.model
        self.config = basis.config
        self.comm = basis.comm
        self.slots = basis.slots
        self._master_names = {id(s.master): s.name for s in basis.slots}
        # [Note: per-step state]: reset by reset_step_state.
        self.step_grad_norm: float | None = None  # global norm from clip_grad_norm_, reused by the inf/NaN check
        self.grads_unscaled = False  # fp16: the owned gradients were divided by the loss scale
        self.unscale_check: Any = (
            None  # fp16: the inf/NaN flags that unscale took ([Note: finite check in the unscale])
        )
        self.step_nonfinite: bool | None = None  # fp16: the inf/NaN answer taken before clamping could hide it
        # What zp.setup attaches once the engine exists (attach_setup / attach_optimizer), and zp.offload_states'
        # parked copies ([Note: parked states] in state_offload.py): declared here, set only through those verbs.
        self.optimizer: Any = None  # the ZeroOptimizer (the first of several: [Note: several optimizers])
        self.frozen_guard: Any = None  # [Note: frozen at setup] in frozen.py
        self.buffer_sync: Any = None  # engines/buffers.py
        self.input_cast_handle: Any = None  # param_dtype: the forward pre-hook casting inputs
        self.offloaded_states: Any = None  # an OffloadedStates while zp.offload_states holds the model states
        # Stage 3's parts that other modules read, empty at stages 0-2: its units, the ShardedParam of each
        # parameter (by id), its module state-dict hooks ([Note: stage-3 state dicts])
        self.units: list = []
        self.sharded: dict = {}
        self.state_dict_hooks: Any = None

    # -- what zp.setup attaches ----------------------------------------------------
    def attach_setup(self, frozen_guard: Any, buffer_sync: Any, input_cast_handle: Any) -> None:
        """The set-up model's guards and hooks, removed with the engine."""
        self.frozen_guard, self.buffer_sync, self.input_cast_handle = frozen_guard, buffer_sync, input_cast_handle

    def attach_optimizer(self, optimizer: Any) -> None:
        """The ZeroOptimizer the public verbs consult (loss scale, clipping); a later rebind replaces it."""
        self.optimizer = optimizer

    def hold_offloaded(self, states: Any) -> None:
        """``zp.offload_states``' parked copies, or None once reloaded ([Note: parked states])."""
        self.offloaded_states = states

    # -- what a step learnt about its gradients ([Note: per-step state]) --------------------------
    def note_grad_norm(self, norm: float) -> None:
        """The global gradient norm clipping computed (the inf/NaN check reuses it)."""
        self.step_grad_norm = norm

    def note_unscaled(self, check: Any = None) -> None:
        """fp16: the owned gradients were divided by the loss scale; ``check``: the inf/NaN flags taken on the
        way, if any ([Note: finite check in the unscale] in optim/loss_scale.py)."""
        self.grads_unscaled = True
        self.unscale_check = check

    def note_nonfinite(self, found: bool) -> None:
        """fp16: the inf/NaN answer, taken before clamping could hide it."""
        self.step_nonfinite = found

    # -- what other modules ask of any stage ------------------------------------------
    @property
    def storage_pool(self) -> Any:
        """Stage 3 on CPU: the pool lending unsharded storage ([Note: lent storage]); None elsewhere."""
        return None

    def unsharded_units(self) -> list:
        """Units gathered now (stage 3); none at stages 0-2."""
        return []

    def in_backward(self) -> bool:
        """A backward is running (stage 3's hooks know; stages 0-2 never ask to wait)."""
        return False

    def open_blocks(self) -> int:
        """``zp.gathered_parameters`` blocks open now (stage 3)."""
        return 0

    # -- step ---------------------------------------------------------------
    # [Note: several optimizers] ``zp.setup(model, [muon, adamw], config)``: one engine, one ZeroOptimizer per
    # optimizer, each stepping the slots of its own parameters.  ``slots`` (None: every slot) is that subset
    # in before_step, after_step and zero_grad, so one optimizer's step or zero_grad leaves the other's
    # gradients in place, as with torch optimizers over disjoint parameters.
    def before_step(self, blocked: bool = False, slots: list[MasterParam] | None = None) -> None:
        """Give every master (of ``slots``) its gradient; ``blocked``: for the blocked step ([Note: cache-blocked
        offload step] in optim/blocked_step.py), which casts gradients and waits for each host copy itself."""
        for slot in self.slots if slots is None else slots:
            slot.set_grad(self.owned_grad(slot), blocked)
        if not blocked:
            self.wait_for_host_copies()

    def after_step(self, slots: list[MasterParam] | None = None) -> None:
        self.write_back(self.slots if slots is None else slots)

    @staticmethod
    def write_back(slots: list[MasterParam]) -> None:
        """After their step: each master into its parameter region, and the master's gradient let go."""
        for slot in slots:
            slot.write_back()
            if not slot.is_identity:
                slot.master.grad = None

    def can_step_pipelined(self, inner: torch.optim.Optimizer) -> bool:
        """Whether :meth:`step_pipelined` may replace ``inner.step()`` + :meth:`after_step` ([Note: pipelined
        step] in optim/pipelined_step.py); only stages 1-2 on gloo can."""
        return False

    def step_pipelined(self, inner: torch.optim.Optimizer) -> None:
        raise NotImplementedError

    @property
    def compute_device(self) -> torch.device:
        """Where forward and backward run; host copies issued there are waited for before a CPU step."""
        return next((s.param.device for s in self.slots), torch.device("cpu"))

    def wait_for_host_copies(self) -> None:
        """With offload, once before the step reads the host gradients ([Note: asynchronous host copies]
        in optim/offload.py); without offload nothing was copied and the device queue is left running."""
        if self.config.offload.optimizer == "cpu" or self.config.offload.params:
            synchronize_copies(self.compute_device)

    def forget_forward(self) -> None:
        """Before a write to the weights outside forward and backward (a checkpoint load): let go of what the
        last forward kept for a backward that did not come.  Stages 0-2 keep nothing; stage 3: [Note: pending
        forward] in stage3/hooks.py."""

    def zero_grad(self, set_to_none: bool = True, slots: list[MasterParam] | None = None) -> None:
        """Discard every gradient of this step (of ``slots``: [Note: several optimizers]), wherever the stage
        keeps it, and the step's cached state."""
        refuse_if_offloaded(self, "zero_grad()")  # [Note: parked states] in state_offload.py
        self.discard_grads(set_to_none, slots)
        self.reset_step_state()

    def discard_grads(self, set_to_none: bool, slots: list[MasterParam] | None = None) -> None:
        raise NotImplementedError

    def after_backward(self) -> None:
        """A synced backward added gradients to the owned ones: what this step cached about them is stale
        ([Note: per-step state]).  A cached norm is dropped (the step's inf/NaN check looks again); fp16
        gradients already divided by the loss scale cannot be mixed with newly scaled ones."""
        self.step_grad_norm = None
        self.step_nonfinite = None
        self.unscale_check = None
        if self.grads_unscaled:
            self.grads_unscaled = False
            raise RuntimeError(
                "zero_plugin: a backward ran after this step's gradients were unscaled (clip_grad_norm_ with fp16 "
                "loss scaling), so old unscaled and new scaled gradients would be summed. Clip once per step, "
                "after the last backward and before optimizer.step() (as with torch.amp.GradScaler.unscale_)."
            )

    def reset_step_state(self) -> None:
        """Forget what this step learnt about its gradients ([Note: per-step state])."""
        self.step_grad_norm = None
        self.grads_unscaled = False
        self.unscale_check = None
        self.step_nonfinite = None

    def owned_grad(self, slot: MasterParam) -> torch.Tensor | None:
        raise NotImplementedError

    def owned_grads(self) -> list[torch.Tensor]:
        return [g for g in (self.owned_grad(s) for s in self.slots) if g is not None]

    def checked_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The owned gradients as the step's inf/NaN check needs them: one-element float32 flags (1: inf/NaN)
        the reduction already took for some of them, and the rest, to read ([Note: finite check in the
        average] in comm/layout.py)."""
        return [], self.owned_grads()

    def accumulator(self) -> Any:
        """What ``zp.no_sync`` suspends: the stage's gradient reducer, whose ``no_sync()`` is a context."""
        raise NotImplementedError

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.accumulator().no_sync():
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
        for handle in (self.frozen_guard, self.input_cast_handle):  # attached by zp.setup where asked for
            if handle is not None:
                handle.remove()
        unregister_engine(self.model)


def _normalise(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    return value
