"""What a process group's backend decides for ``Comm``: the collective layout ([Note: in-place region
gather] in ``collectives.py``) and the device its collectives, and stage 3's units, run on."""

from __future__ import annotations

import os

import torch

__all__ = ["backend_uses_cuda", "regions_in_place"]


def regions_in_place(backend: str) -> bool:
    """Whether ``Comm`` on ``backend`` gathers and reduces regions in place ([Note: in-place region
    gather]): gloo, unless ZERO_PLUGIN_BUFFERED_COLLECTIVES=1."""
    return backend == "gloo" and os.environ.get("ZERO_PLUGIN_BUFFERED_COLLECTIVES", "0") != "1"


def backend_uses_cuda(backend: str) -> bool:
    """Whether a group on ``backend`` moves CUDA tensors: NCCL, alone or in a composite backend such as
    ``"cpu:gloo,cuda:nccl"``; torch's ``"fake"`` group (it moves nothing, and its users measure the memory of
    the job it stands in for) on a machine with CUDA."""
    if "nccl" in backend:
        return True
    return backend == "fake" and torch.cuda.is_available()
