"""ZeRO-Offload (arXiv 2101.06840) as a policy applied at two points, not a branch through the engine.

* after gradient reduction: a master's gradient is copied to the host (``MasterParam.set_grad``);
* after the step: the updated master is copied back into the device shard in ``param_dtype``
  (``MasterParam.write_back``).
Masters and all optimizer state live on the host (pinned when CUDA is present, so the copies are
asynchronous).  On a CPU-only machine the host *is* the device: no copy is made that would do nothing,
and offload only changes which kernel steps (torch's fused CPU kernels, see ``use_fast_cpu_kernels``).
"""
from __future__ import annotations

import torch

__all__ = ["HOST", "host_for", "pin", "use_fast_cpu_kernels", "synchronize_copies"]

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
    if not isinstance(optimizer, _FUSED_CPU):
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


def synchronize_copies(tensors) -> None:
    """Wait for non-blocking device->host copies before the CPU step reads them."""
    if torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors):
        torch.cuda.current_stream().synchronize()
