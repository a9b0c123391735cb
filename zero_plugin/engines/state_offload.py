"""Model states parked in host memory while another program uses the device (``zp.offload_states``).

[Note: parked states]
GRPO / RLOO with vLLM in colocate mode run generation on the device training uses.  DeepSpeed users call
``engine.offload_states()`` before it and ``engine.reload_states()`` after; ``zp.offload_states(model)`` /
``zp.reload_states(model)`` are the same for every stage.  What moves is what ``memory_report`` counts
(``Engine.model_state_tensors`` plus the optimizer's state): parameters (stage 3: the shards), gradients
(mid-accumulation ones too) and optimizer state with the fp32 masters, each category on request.

The unit that moves is the *storage*, not the tensor: a master is a view of its parameter's storage (stages
1-2), gradients are views of bucket buffers (stage 0) or of a unit's reduced row (stage 3), autograd and the
optimizer hold the tensor objects themselves.  Each distinct storage on the device is copied byte for byte
into a host buffer (pinned on CUDA) and then resized to 0 bytes; reloading resizes it back and copies the
bytes in.  Every tensor object, view and alias stays what it was, so training continues bit for bit.  A
storage named by two categories belongs to the first, as in ``memory_report`` (params, grads, optimizer).
Storages already in host memory are left alone: on CUDA every CPU tensor (ZeRO-Offload's masters and
optimizer state, stage-3 ``offload_params`` shards); on a CPU-only run, where host and device are one
memory, the categories the config offloads (as ``memory_report``'s placement counts them).  So with
``offload_optimizer="cpu"`` the optimizer category is a no-op (reported under ``already_on_host``).

While states are parked their device tensors have no memory: any kernel reading them would read freed
memory (a segfault on CPU).  So everything of ours that reads them refuses, naming ``zp.reload_states``:
the model's forward (``generate`` too), ``model.state_dict()`` / ``load_state_dict()``, the optimizer's
step, ``zero_grad`` and every ``zp`` verb except ``memory_report``.  No verb reloads by itself: as with
DeepSpeed the pair is explicit, and a hidden host-to-device copy inside the next forward would land while
vLLM may still hold the memory.  Not caught: a backward of a graph built *before* ``offload_states``
(offload after the backward or the step, never between a forward and its backward) and a user's own read
of a parameter (``model.lm_head.weight.sum()``), e.g. a vLLM weight sync: push weights before offloading.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CATEGORIES", "StatesOffloaded", "OffloadedStates", "refuse_if_offloaded"]

CATEGORIES = ("params", "grads", "optimizer")  # memory_report's categories, in its order of attribution

# zp verbs that touch no model state, allowed while states are offloaded (engine_of's verb names)
_ALLOWED_VERBS = frozenset(
    f"zp.{verb}"
    for verb in ("memory_report", "offload_states", "reload_states", "is_set_up", "integrations", "prepare")
)


class StatesOffloaded(RuntimeError):
    """A forward, backward, step or verb reached model states that ``zp.offload_states`` moved to the host."""


def refuse_if_offloaded(engine, verb: str) -> None:
    """Raise :class:`StatesOffloaded` naming ``verb`` and the fix when ``engine``'s states are parked."""
    parked = engine.offloaded_states
    if parked is not None and verb not in _ALLOWED_VERBS:
        raise StatesOffloaded(
            f"zero_plugin: {verb} while the model states are offloaded to host memory (zp.offload_states: "
            f"{', '.join(parked.categories)}); call zp.reload_states(model) first, e.g. right after generation"
        )


def _is_host(t: torch.Tensor, category: str, cpu_only: bool, host_categories: set[str]) -> bool:
    """Already in host memory: [Note: parked states]."""
    if t.device.type == "cpu":
        return not cpu_only or category in host_categories
    return False


class _Parked:
    """One device storage and its host copy."""

    __slots__ = ("storage", "host", "nbytes")

    def __init__(self, storage: torch.UntypedStorage, pin: bool) -> None:
        self.storage = storage
        self.nbytes = storage.nbytes()
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin).untyped_storage()
        self.host.copy_(storage, non_blocking=pin)

    def free(self) -> None:
        self.storage.resize_(0)

    def restore(self) -> None:
        self.storage.resize_(self.nbytes)
        self.storage.copy_(self.host, non_blocking=self.host.is_pinned())


class OffloadedStates:
    """The storages of one engine's model states, copied to the host and freed on the device; built by
    :meth:`offload`, undone once by :meth:`reload`."""

    def __init__(self, engine, categories: tuple[str, ...]) -> None:
        self.engine = engine
        self.categories = categories
        self.parked: dict[str, list[_Parked]] = {c: [] for c in categories}
        self.already_on_host: dict[str, int] = {}  # bytes of requested categories that were on the host
        self.kept: dict[str, int] = {}  # bytes of storages that cannot be resized (left on the device)
        self._handles: list = []

    # -- offload ----------------------------------------------------------------------------------
    @classmethod
    def offload(cls, engine, categories: tuple[str, ...]) -> OffloadedStates:
        device = engine.compute_device
        _synchronize(device)  # every kernel that writes the states has finished before they are copied
        parked = cls(engine, categories)
        for category, storage, on_host in _storages_by_category(engine):
            if category not in categories:
                continue
            if on_host:
                parked.already_on_host[category] = parked.already_on_host.get(category, 0) + storage.nbytes()
            elif not storage.resizable():
                parked.kept[category] = parked.kept.get(category, 0) + storage.nbytes()
            else:
                parked.parked[category].append(_Parked(storage, pin=device.type == "cuda"))
        _synchronize(device)  # the host copies are complete before the device memory goes
        for entries in parked.parked.values():
            for entry in entries:
                entry.free()
        _drop_cached_buffers(engine)
        parked._install_guards()
        return parked

    # -- reload -----------------------------------------------------------------------------------
    def reload(self) -> None:
        for entries in self.parked.values():
            for entry in entries:
                entry.restore()
        _synchronize(self.engine.compute_device)
        self.remove_guards()
        self.parked = {c: [] for c in self.categories}

    # -- accounting -------------------------------------------------------------------------------
    def host_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The host copies by category, for ``memory_report``."""
        return {
            c: [torch.empty(0, dtype=torch.uint8).set_(e.host) for e in entries] for c, entries in self.parked.items()
        }

    def moved_bytes(self) -> dict[str, int]:
        return {c: sum(e.nbytes for e in entries) for c, entries in self.parked.items()}

    def summary(self) -> dict:
        return {"moved": self.moved_bytes(), "already_on_host": dict(self.already_on_host), "kept": dict(self.kept)}

    # -- guards -----------------------------------------------------------------------------------
    def _install_guards(self) -> None:
        model = self.engine.model
        self._handles.append(model.register_forward_pre_hook(self._refuse_forward, prepend=True))
        # before stage 3's own state-dict hooks (registered at setup), which would gather the parked shards
        self._handles.append(
            _first(model, "_state_dict_pre_hooks", model.register_state_dict_pre_hook(self._refuse_save))
        )
        self._handles.append(
            _first(model, "_load_state_dict_pre_hooks", model.register_load_state_dict_pre_hook(self._refuse_load))
        )
        optimizer = self.engine.optimizer
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._refuse_step))

    def remove_guards(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _refuse_forward(self, module: nn.Module, args) -> None:
        refuse_if_offloaded(self.engine, "a forward (or generate) of the model")

    def _refuse_save(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        refuse_if_offloaded(self.engine, "model.state_dict()")

    def _refuse_load(self, module: nn.Module, *args) -> None:
        refuse_if_offloaded(self.engine, "model.load_state_dict()")

    def _refuse_step(self, optimizer, args, kwargs) -> None:
        refuse_if_offloaded(self.engine, "optimizer.step()")


def _first(module: nn.Module, attr: str, handle):
    """Move the hook just registered under ``handle`` to the front of ``module.<attr>``."""
    hooks = getattr(module, attr, None)
    if hooks is not None and handle.id in hooks:
        hooks.move_to_end(handle.id, last=False)
    return handle


def _storages_by_category(engine) -> list[tuple[str, torch.UntypedStorage, bool]]:
    """Each distinct storage with bytes, once, under the first category naming it; and whether it is in host
    memory already ([Note: parked states])."""
    held = engine.model_state_tensors()
    optimizer = engine.optimizer
    state = [v for s in optimizer.state.values() for v in s.values()] if optimizer is not None else []
    tensors = {
        "params": held["params"],
        "grads": held["grads"],
        "optimizer": list(held["masters"]) + [v for v in state if isinstance(v, torch.Tensor)],
    }
    cpu_only = engine.compute_device.type == "cpu"
    cfg = engine.config  # the categories memory_report places on the host of a CPU-only run
    host_categories = {"optimizer"} if cfg.offload.optimizer == "cpu" else set()
    host_categories |= {"params"} if cfg.offload.params else set()
    seen: set[tuple[str, int]] = set()
    out = []
    for category in CATEGORIES:
        for t in tensors[category]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            out.append((category, storage, _is_host(t, category, cpu_only, host_categories)))
    return out


def _drop_cached_buffers(engine) -> None:
    """Memory our pools keep for reuse is memory generation could use: stage 3's collective buffers and lent
    storages; on CUDA, the caching allocator's free blocks."""
    if engine.storage_pool is not None:
        engine.storage_pool.clear()
    for unit in engine.units:
        if unit.pool is not None:
            unit.pool.clear()
    if engine.compute_device.type == "cuda":
        torch.cuda.empty_cache()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
