"""Activation offload: the inputs of activation-checkpointed layers wait in host memory between forward and the
recompute in backward (``ZeroConfig(offload_activations="cpu")``; DeepSpeed ALST's offload of the checkpointed
hidden states, arXiv 2506.13996, and FSDP's ``CheckpointWrapper`` + ``OffloadWrapper``).

[Note: activation offload]
With every decoder layer checkpointed, what a layer keeps between forward and backward is its input: the hidden
states, ``batch x tokens x hidden`` per layer, ``layers x tokens x hidden`` in all, which is what fills a device at
long sequences once the logits are tiled.  torch's non-reentrant ``checkpoint`` keeps the positional inputs of the
function it checkpoints as saved tensors (``_CheckpointFrame.save_inputs``, before it enters its own saved-tensor
hooks), and the reentrant one saves them with ``ctx.save_for_backward`` (its forward runs without grad); the layer's
own saves go to the checkpoint's inner hooks.  So saved-tensor hooks entered *around* the ``checkpoint`` call see
exactly the layer's positional inputs: ``OffloadedCheckpoint`` wraps the model's checkpoint function (transformers'
``_gradient_checkpointing_func``, a ``partial`` of ``torch.utils.checkpoint.checkpoint``) in the hooks of one
``ActivationOffload`` per model.  Its pack copies a tensor to host memory and drops the device reference; its
unpack brings it back when backward recomputes the layer.  transformers binds the keyword arguments (rotary
position embeddings, masks) in a ``partial``: they stay where they are, one copy shared by every layer.
Parameters are never packed (stage 3 swaps their data; a layer does not take them positionally anyway).

CUDA: the host copy is pinned and written on a side stream after it waited for the compute stream, so layer
``i``'s copy overlaps layer ``i``'s forward.  The device tensor is kept until the next layer's pack (or its own
unpack) makes the compute stream wait for the copy's event and only then drops it: a block is reusable exactly
when the host frees it, as [Note: side streams] in ``comm/streams.py`` has it for the collectives (no
``record_stream``), so at most one layer input more than the packed ones is on the device at any time, and the
last layer's input, the first one backward needs, never leaves.  Unpack copies back on the compute stream
(non-blocking from pinned memory); it is not prefetched.
CPU: the tensor already lives in host memory; pack keeps it as it is and unpack returns it, through the same
code and counters (``copy=True``, for tests, copies even there).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["ActivationOffload", "OffloadStats", "OffloadedCheckpoint", "checkpointing_modules", "enable", "offload_of"]


@dataclasses.dataclass
class OffloadStats:
    """What one model's activation offload moved since setup (or the last ``reset``), in bytes of tensor data."""

    packed_tensors: int = 0
    """Layer inputs handed to host memory (on CPU: kept where they are, counted the same)."""
    packed_bytes: int = 0
    """Their bytes: on CUDA the device-to-host copies."""
    unpacked_tensors: int = 0
    """Layer inputs brought back for a recompute."""
    unpacked_bytes: int = 0
    """Their bytes: on CUDA the host-to-device copies."""
    host_bytes: int = 0
    """Bytes parked in host memory now."""
    host_peak_bytes: int = 0
    """The most ever parked at once: one forward's layer inputs."""

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)


class _Parked:
    """One packed tensor: its host copy, and on CUDA the device tensor until the copy is known done."""

    __slots__ = ("host", "device", "event", "where", "nbytes", "owner", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.Tensor | None, event: Any, owner: ActivationOffload):
        self.host, self.device, self.event, self.owner = host, device, event, owner
        self.where = device.device if device is not None else host.device
        self.nbytes = host.numel() * host.element_size()
        owner.stats.host_bytes += self.nbytes
        owner.stats.host_peak_bytes = max(owner.stats.host_peak_bytes, owner.stats.host_bytes)

    def __del__(self) -> None:
        self.owner.stats.host_bytes -= self.nbytes


class ActivationOffload:
    """The pack / unpack pair of [Note: activation offload] and its counters."""

    def __init__(self, *, copy: bool = False) -> None:
        self.copy = copy
        self.stats = OffloadStats()
        self._copy_stream: Any = None
        self._pending: weakref.ref | None = None  # the last CUDA pack whose device tensor is still held

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> Any:
        if isinstance(tensor, nn.Parameter) or tensor.device.type == "meta":
            return tensor
        self.stats.packed_tensors += 1
        self.stats.packed_bytes += tensor.numel() * tensor.element_size()
        if tensor.device.type == "cuda":
            return self._pack_cuda(tensor)
        host = tensor.detach().clone() if self.copy else tensor.detach()
        return _Parked(host, None, None, self)

    def unpack(self, parked: Any) -> torch.Tensor:
        if not isinstance(parked, _Parked):
            return parked
        self.stats.unpacked_tensors += 1
        self.stats.unpacked_bytes += parked.nbytes
        if parked.device is not None:  # the copy may not be done: the device tensor is still valid
            return parked.device
        if parked.event is not None:  # CUDA, the device tensor let go: bring the host copy back
            return parked.host.to(parked.where, non_blocking=True)
        return parked.host.clone() if self.copy else parked.host

    # -- CUDA ---------------------------------------------------------------------------------------------
    def _pack_cuda(self, tensor: torch.Tensor) -> _Parked:
        self._release_pending()
        compute = torch.cuda.current_stream(tensor.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(tensor.device)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream):
            host.copy_(tensor.detach(), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        parked = _Parked(host, tensor.detach(), event, self)
        self._pending = weakref.ref(parked)
        return parked

    def _release_pending(self) -> None:
        """The compute stream waits for the last copy, then its device tensor may go ([Note: activation
        offload])."""
        parked = self._pending() if self._pending is not None else None
        self._pending = None
        if parked is not None and parked.device is not None:
            torch.cuda.current_stream(parked.where).wait_event(parked.event)
            parked.device = None


class OffloadedCheckpoint:
    """A model's checkpoint function run inside its ``ActivationOffload``'s hooks ([Note: activation offload]);
    called as transformers calls ``_gradient_checkpointing_func``: ``(function, *args, **kwargs)``."""

    def __init__(self, inner: Callable, offload: ActivationOffload) -> None:
        self.inner, self.offload = inner, offload

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        with self.offload.hooks():
            return self.inner(function, *args, **kwargs)


_OF_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def offload_of(model: nn.Module) -> ActivationOffload | None:
    """The activation offload ``zp.setup`` installed on ``model`` (its ``stats``), or None."""
    return _OF_MODEL.get(model)


def enable(model: nn.Module, where: str, *, copy: bool = False) -> ActivationOffload | None:
    """Wrap the checkpoint function of every checkpointed module of ``model`` (``where`` "cpu"), or nothing
    ("none").  ``ValueError`` when no module of ``model`` checkpoints: there is nothing to offload.  A forward
    pre-hook wraps again a function set after setup (``activation_checkpointing_enable`` called again)."""
    if where == "none":
        return None
    offload = _OF_MODEL.get(model)
    if offload is None:
        offload = ActivationOffload(copy=copy)
    if not _wrap_all(model, offload):
        raise ValueError(
            f"ZeroConfig.offload_activations={where!r} moves the inputs of activation-checkpointed layers to the "
            f"host, but no module of {type(model).__name__} checkpoints: call "
            "model.activation_checkpointing_enable() (transformers; gradient_checkpointing_enable in older "
            "versions, or TrainingArguments(gradient_checkpointing=True)) before zp.setup, or set "
            "offload_activations='none'"
        )
    if model not in _OF_MODEL:
        model.register_forward_pre_hook(functools.partial(_rewrap, weakref.ref(offload)))
        _OF_MODEL[model] = offload
    return offload


def checkpointing_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that run their layers through a checkpoint function (transformers' gradient
    checkpointing): whose ``_gradient_checkpointing_func`` the offload wraps."""
    return [
        m
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", False) and callable(getattr(m, "_gradient_checkpointing_func", None))
    ]


def _wrap_all(model: nn.Module, offload: ActivationOffload) -> bool:
    modules = checkpointing_modules(model)
    for module in modules:
        inner = module._gradient_checkpointing_func
        if isinstance(inner, OffloadedCheckpoint):
            continue
        _refuse_own_offload(inner)
        module._gradient_checkpointing_func = OffloadedCheckpoint(inner, offload)
    return bool(modules)


def _refuse_own_offload(inner: Callable) -> None:
    """transformers' ``activation_checkpointing_enable(offload=True)`` enters ``save_on_cpu`` inside our hooks,
    which then see nothing; one offload is enough."""
    name = getattr(getattr(inner, "func", inner), "__qualname__", "")
    if "activation_checkpointing_enable" in name or "save_on_cpu" in name:
        raise ValueError(
            "ZeroConfig.offload_activations='cpu' and transformers' own activation_checkpointing_enable(offload=True) "
            'both offload the checkpointed inputs; enable checkpointing without offload=True (or drop "offload" '
            "from activation_checkpointing_kwargs), zero_plugin's offload copies on a side stream"
        )


def _rewrap(offload_ref: weakref.ref, module: nn.Module, args: Any) -> None:
    offload = offload_ref()
    if offload is not None and module.training and torch.is_grad_enabled():
        _wrap_all(module, offload)
