"""ZeRO-Offload (arXiv 2101.06840) as a policy applied at two points, not a branch through the engine.

* after gradient reduction: a master's gradient is copied to the host (``MasterParam.set_grad``);
* after the step: the updated master is copied back into the device shard in ``param_dtype``
  (``MasterParam.write_back``).
Masters and all optimizer state live on the host (pinned when CUDA is present, so the copies are
asynchronous).  On a CPU-only machine the host *is* the device: no copy is made that would do nothing,
and offload only changes which kernel steps (torch's fused CPU kernels, see ``use_fast_cpu_kernels``,
called directly by ``cpu_step.fused_cpu_step`` for Adam/AdamW: [Note: direct fused step]).

[Note: asynchronous host copies]
Every copy between host and device is ``non_blocking`` from or into pinned memory (``to_host``,
``to_device``), so the host goes on issuing work while the copy engine runs.  A device->host copy is
complete only when the stream that issued it has passed it: the engine calls ``synchronize_copies``
once, after the last gradient copy and before the CPU optimizer reads anything (``before_step``).
Host->device copies (the updated master written back) need no wait: later device work on the same
stream, or on a side stream that waits for it ([Note: side streams] in ``zero_plugin/comm/streams.py``),
is ordered after them, and the host writes those masters again only after the next
``synchronize_copies``.  Dtype casts happen on the device (a host-side cast of a pinned tensor would
produce pageable memory, which the copy engine cannot read asynchronously).
"""

from __future__ import annotations

import torch

__all__ = ["HOST", "host_for", "pin", "to_host", "to_device", "use_fast_cpu_kernels", "synchronize_copies", "copy_done"]

HOST = torch.device("cpu")

# torch ships fused CPU kernels for these (torch >= 2.4); measured in benchmarks/cpu_adam.py.
_FUSED_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def host_for(device: torch.device) -> torch.device | None:
    """Where an offloaded master lives, or None when that is the device itself (CPU-only)."""
    return None if device.type == "cpu" else HOST


def pin(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if torch.cuda.is_available() and t.device.type == "cpu" else t


def use_fast_cpu_kernels(optimizer: torch.optim.Optimizer) -> bool:
    """Switch a known optimizer to torch's fused CPU kernel (about 5x the for-loop kernel here)."""
    if not isinstance(optimizer, _FUSED_CPU) or _sgd_with_momentum(optimizer):
        return False
    for group in optimizer.param_groups:
        tensors = group["params"]
        if any(t.device.type != "cpu" or not t.is_floating_point() for t in tensors):
            return False
    for group in optimizer.param_groups:
        group["fused"] = True
        group["foreach"] = False
        if "differentiable" in group:
            group["differentiable"] = False
    return True


def _sgd_with_momentum(optimizer: torch.optim.Optimizer) -> bool:
    """torch's fused SGD (2.13) passes the momentum buffers as one list and fails with a TypeError when some
    parameter with a gradient has none yet while others have one: a parameter first used after the first
    step, as under uneven use or unfreezing.  Such an optimizer keeps the kernel the user chose."""
    return isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum", 0) for g in optimizer.param_groups)


def to_host(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy ``src`` into the (pinned) host tensor ``dst`` without blocking; a cast runs on ``src``'s device
    ([Note: asynchronous host copies]).  Complete after :func:`synchronize_copies`."""
    return dst.copy_(src.reshape(dst.shape), non_blocking=True)


def to_device(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy ``src`` into ``dst`` without blocking the host; from a pinned host tensor of another dtype the
    raw bytes move first and the cast runs on the device ([Note: asynchronous host copies])."""
    if src.device != dst.device and src.dtype != dst.dtype:
        src = src.to(dst.device, non_blocking=True)
    return dst.copy_(src.reshape(dst.shape), non_blocking=True)


def synchronize_copies(device: torch.device) -> None:
    """Wait for the non-blocking device->host copies issued so far on ``device``'s current stream (and on
    the side streams it waited for) before the CPU step reads them.  Nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def copy_done(device: torch.device):
    """A CUDA event marking the copies issued so far on ``device``'s current stream (None on the CPU): the
    blocked step waits for each master's gradient copy alone, so the CPU step of the first masters overlaps
    the copies of the later ones ([Note: cache-blocked offload step] in ``blocked_step.py``)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
